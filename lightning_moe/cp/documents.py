"""Document-causal attention: packed documents attend causally, each only within itself.

A batch that packs several documents per row carries ``document_ids [batch, seq]`` (equal ids: the
same document; documents contiguous, numbered in increasing order along the row). Query ``i`` then
sees key ``j`` when ``j <= i`` (sequence order, not the per-document ``position_ids``) and both
belong to the same document.

:func:`document_attention` makes every ``F.scaled_dot_product_attention(..., is_causal=True)`` of
any module document-causal while it is active, on one process; the strategy does the same for
every layout (context parallel ring and all-to-all attention mask their blocks with the same rule).

Example::

    with document_attention(batch["document_ids"]):
        logits = model(batch["input_ids"], batch["position_ids"])   # positions restart per document
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_moe._compat import torch_function_disabled

__all__ = [
    "DocumentAttentionMode",
    "DocumentAwareMode",
    "check_document_ids",
    "current_document_ids",
    "document_attention",
    "document_causal_mask",
    "recompute_in_active_attention_mode",
    "SequenceShardedAttentionMode",
    "refuse_mask_with_documents",
    "set_document_ids",
]


def check_document_ids(document_ids: torch.Tensor, input_shape: torch.Size | tuple[int, ...] | None = None) -> None:
    """``ValueError`` naming the fix unless ``document_ids`` is an integer ``[batch, seq]`` tensor (of
    ``input_shape`` when given) whose documents are contiguous and numbered in increasing order."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2 or document_ids.is_floating_point():
        shape = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
        raise ValueError(f"document_ids must be an integer [batch, seq] tensor, got {shape}")
    if input_shape is not None and tuple(document_ids.shape) != tuple(input_shape[:2]):
        raise ValueError(
            f"document_ids of shape {tuple(document_ids.shape)} do not match the inputs' [batch, seq] ="
            f" {tuple(input_shape[:2])}: give one document id per input token"
        )
    if document_ids.shape[1] > 1 and bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise ValueError(
            "document_ids must not decrease along a row: each document is one contiguous run of tokens, numbered"
            " in order (e.g. 0 0 0 1 1 2); a document that reappears after another is not contiguous"
        )


def document_causal_mask(
    query_documents: torch.Tensor,
    key_documents: torch.Tensor,
    query_index: torch.Tensor | None = None,
    key_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``[batch, 1, queries, keys]``: True where the query may attend to the key.

    ``*_documents`` are ``[batch, n]`` document ids; ``*_index`` the tokens' places in the whole
    sequence (``[n]``; default ``arange``). Same document and ``key_index <= query_index``.
    """
    if query_index is None:
        query_index = torch.arange(query_documents.shape[1], device=query_documents.device)
    if key_index is None:
        key_index = torch.arange(key_documents.shape[1], device=key_documents.device)
    same = query_documents[:, :, None] == key_documents[:, None, :]
    causal = key_index[None, :] <= query_index[:, None]
    return (same & causal).unsqueeze(1)


def _masks_by_blocks(q: torch.Tensor) -> bool:
    """Whether document masks of attention on ``q`` take :func:`_flex_attention` (CUDA) instead of a dense
    boolean mask (CPU, where flex attention has no backward). One place, so that a test can send CPU
    tensors through the CUDA branch (forward only)."""
    return q.is_cuda


@functools.cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_kernel(q: torch.Tensor) -> Any:
    """Compiled flex attention on CUDA: eager flex attention computes the whole [S, S] score matrix, the
    compiled kernel skips the blocks the mask leaves out. Eager elsewhere (CPU tests run the branch forward
    only, and eager needs no compile per shape)."""
    if q.is_cuda:
        return _compiled_flex_attention()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, scale: float | None, enable_gqa: bool
) -> torch.Tensor:
    """CUDA: flex attention under a block mask (no dense [S, S] mask; blocks no document spans are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (kv_idx <= q_idx)

    mask = create_block_mask(visible, document_ids.shape[0], None, q.shape[-2], k.shape[-2], device=q.device)
    return _flex_kernel(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)


def sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict[str, Any]:
    """SDPA's arguments by name (the torch function's signature)."""
    return dict(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


# The document-aware attention modes now active, innermost last (see set_document_ids).
_ACTIVE_MODES: list["DocumentAwareMode"] = []


class DocumentAwareMode(TorchFunctionMode):
    """An attention mode that masks by ``document_ids`` when it has them (None: plain causal attention).

    ``set_document_ids`` changes them between micro-batches without leaving the mode (a pipeline stage
    receives each micro-batch's ids with its inputs); :func:`set_document_ids` reaches the innermost
    active mode.
    """

    def __init__(self, document_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.document_ids: torch.Tensor | None = None
        self.set_document_ids(document_ids)

    def set_document_ids(self, document_ids: torch.Tensor | None) -> None:
        if document_ids is not None:
            check_document_ids(document_ids)
        self.document_ids = document_ids

    def __enter__(self) -> "DocumentAwareMode":
        _ACTIVE_MODES.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _ACTIVE_MODES.remove(self)


def recompute_in_active_attention_mode() -> contextlib.AbstractContextManager:
    """For activation checkpointing: a context that, entered when backward recomputes a forward, puts
    back the attention mode (and the document ids) that were active when the forward first ran."""
    if not _ACTIVE_MODES:
        return contextlib.nullcontext()
    return copy.copy(_ACTIVE_MODES[-1])


def set_document_ids(document_ids: torch.Tensor | None) -> bool:
    """Give the innermost active attention mode these ``document_ids``; False when none is active."""
    if not _ACTIVE_MODES:
        return False
    _ACTIVE_MODES[-1].set_document_ids(document_ids)
    return True


def current_document_ids() -> torch.Tensor | None:
    """The ``document_ids`` of the innermost active attention mode (None: none active, or no documents)."""
    return _ACTIVE_MODES[-1].document_ids if _ACTIVE_MODES else None


def refuse_mask_with_documents(attn_mask: Any) -> None:
    if attn_mask is not None:
        raise ValueError(
            "scaled_dot_product_attention got an explicit attn_mask while the batch carries document_ids: pass"
            " is_causal=True and let the documents mask it, or drop document_ids from the batch"
        )


class DocumentAttentionMode(DocumentAwareMode):
    """Make causal ``F.scaled_dot_product_attention`` document-causal over ``document_ids`` while active.

    Calls with ``is_causal=False`` (e.g. cross-attention, a decoder's cache step) pass through; an
    explicit ``attn_mask`` together with the documents is refused (which of the two would hold is
    not decidable here). On CPU the mask is a dense boolean ``[batch, 1, S, S]`` (exact); on CUDA it
    is a flex-attention block mask. Without ids (None) every call passes through.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.document_ids is None:
            return func(*args, **kwargs)
        call = sdpa_arguments(*args, **kwargs)
        refuse_mask_with_documents(call["attn_mask"])
        if not call["is_causal"]:
            return func(*args, **kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        documents = self.document_ids.to(q.device)
        if documents.shape != (q.shape[0], q.shape[-2]) or k.shape[-2] != q.shape[-2]:
            raise ValueError(
                f"document_ids of shape {tuple(documents.shape)} do not match attention over queries"
                f" {tuple(q.shape)} and keys {tuple(k.shape)}: one id per token of each sequence"
            )
        if _masks_by_blocks(q):
            return _flex_attention(q, k, v, documents, call["scale"], call["enable_gqa"])
        # Outer modes must not see the mask (a recomputation's mode may sit above the next micro-batch's).
        with torch_function_disabled():
            return func(
                q,
                k,
                v,
                attn_mask=document_causal_mask(documents, documents),
                dropout_p=call["dropout_p"],
                scale=call["scale"],
                enable_gqa=call["enable_gqa"],
            )


class SequenceShardedAttentionMode(DocumentAwareMode):
    """Base of the context-parallel attention modes (ring, all-to-all): SDPA over a sequence sharded on ``group``.

    On a cp group of one rank SDPA stays local (document-causal while documents are set). On more,
    an explicit ``attn_mask`` or ``dropout_p > 0`` raises ``NotImplementedError`` (no rank holds
    the mask's full rows, and dropout would need the one-process RNG stream) and a mask together
    with documents ``ValueError``; every other call goes to :meth:`sharded_attention`.
    """

    # How the attention crosses the ranks, in error messages.
    communication = "context parallelism"

    def __init__(self, group: Any, document_ids: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        super().__init__(document_ids)
        self.group = group
        self.cp_size = dist.get_world_size(group)

    def sharded_attention(self, call: dict[str, Any], where: str) -> torch.Tensor:
        """SDPA's bound arguments (:func:`sdpa_arguments`) on this rank's part of the sequence, cp > 1."""
        raise NotImplementedError

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if self.cp_size == 1:
            if self.document_ids is None:
                return func(*args, **kwargs)
            with DocumentAttentionMode(self.document_ids):
                return func(*args, **kwargs)
        call = sdpa_arguments(*args, **kwargs)
        if self.document_ids is not None:
            refuse_mask_with_documents(call["attn_mask"])
        where = f"scaled_dot_product_attention under {self.communication} (cp = {self.cp_size})"
        if call["attn_mask"] is not None:
            raise NotImplementedError(f"{where} does not support attn_mask; use is_causal=True for causal attention")
        if call["dropout_p"] > 0.0:
            raise NotImplementedError(
                f"{where} does not support dropout_p={call['dropout_p']}; set attention dropout to 0"
            )
        return self.sharded_attention(call, where)


def document_attention(document_ids: torch.Tensor | None) -> DocumentAttentionMode:
    """A context manager in which causal SDPA attends within documents (see :class:`DocumentAttentionMode`).

    Example::

        with document_attention(torch.tensor([[0, 0, 0, 1, 1, 2]])):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # 3 documents, each causal
    """
    return DocumentAttentionMode(document_ids)
