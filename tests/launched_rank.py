"""Run code on a rank of a test pool as on a rank that an outside launcher (torchrun) started.

Lightning starts the processes of a multi-device Trainer itself unless ``LOCAL_RANK`` is set: set, it
takes the process for one rank of a job launched for it and uses the initialised process group as it
is. A test pool's ranks (tests/dist_pool.py) have the group but none of torchrun's variables;
:func:`launched_rank` sets them for the span of a block.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator, Mapping


class Output:
    """What the rank warned, logged and printed in ``launched_rank(capture=True)``; ``text`` is complete
    once the block is left ("" without ``capture``)."""

    text = ""


@contextlib.contextmanager
def launched_rank(
    devices: int | None = None, env: Mapping[str, str] | None = None, capture: bool = False
) -> Iterator[Output]:
    """This rank of the initialised process group as one of ``devices`` per node (default: all of them on
    one node): ``LOCAL_RANK`` and ``NODE_RANK`` set as torchrun sets them, and ``env`` besides; on leaving,
    every variable is back as it was.

    ``capture``: every warning, log record and print of the block goes to the yielded :class:`Output`, a
    warning also when an earlier task of the same process already emitted it (the default filter shows
    each only once).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    devices = devices or dist.get_world_size()
    with environ_set({"LOCAL_RANK": str(rank % devices), "NODE_RANK": str(rank // devices), **(env or {})}):
        with _captured() if capture else contextlib.nullcontext(Output()) as output:
            yield output


@contextlib.contextmanager
def environ_set(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in ``os.environ`` for the span of the block; on leaving, each is back as it was (unset
    again where it was unset)."""
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _captured() -> Iterator[Output]:
    output, buffer = Output(), io.StringIO()
    handler = logging.StreamHandler(buffer)
    logging.getLogger().addHandler(handler)
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(buffer),
            contextlib.redirect_stderr(buffer),
        ):
            warnings.simplefilter("always")
            yield output
    finally:
        logging.getLogger().removeHandler(handler)
    output.text = buffer.getvalue() + "".join(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught
    )
