"""Host memory of CPU ranks: large tensors go back to the system when freed.

glibc's ``malloc`` serves a block above its mmap threshold (128 KiB at start) with ``mmap`` and
returns it on ``free``, but each time such a block is freed it raises the threshold to that
block's size (up to 32 MiB). From then on tensors of that size come from the heap, and the heap
keeps what is freed in the process. A training step allocates and frees many same-sized tensors
(FSDP's gathered parameters, gradients, expert activations), so the resident set climbs past what
is live: an ep4 run of 200M expert parameters with AdamW peaked at 1.74-1.97 GB per rank where
its live tensors need about 1.3 (docs/strategy.md). Setting the threshold explicitly turns the
adjustment off, and the same run peaks at 1.31-1.33 GB.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value


def return_large_blocks_to_the_system(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (``mallopt``).

    Does nothing, and returns False, where the C library has no ``mallopt`` (not glibc) or the
    user set ``MALLOC_MMAP_THRESHOLD_`` (glibc then already fixed it at their value). Blocks
    allocated before the call keep their place.

    Example::

        return_large_blocks_to_the_system()  # True on Linux/glibc
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
