"""CPU ranks fix glibc's mmap threshold, so that freed tensors leave the process (docs/strategy.md)."""

from __future__ import annotations

import subprocess
import sys

# A child process: the setting lasts for the process, and the test measures its resident set.
_CHILD = """
import sys, torch
from lightning_moe.parallel.runtime.host_memory import return_large_blocks_to_the_system

def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) // 1024

if sys.argv[1] == "fixed":
    assert return_large_blocks_to_the_system()
before = rss_mb()
# Free a 16 MiB block (glibc then raises its threshold to 16 MiB), then allocate 8 MiB tensors and
# free every other one, as a step frees activations between live ones.
big = torch.ones(4 * 1024 * 1024); del big
held = [torch.ones(2 * 1024 * 1024) for _ in range(32)]  # 256 MiB of 8 MiB tensors
del held[::2]  # 128 MiB stay live
print(rss_mb() - before)
"""


def _rss_left_mb(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_freed_tensors_leave_the_process_once_the_threshold_is_fixed():
    """Without the fix glibc keeps the freed 8 MiB blocks in its heap between live ones (its threshold
    rose to 16 MiB when the first block was freed): the process holds all 256 MiB. With it every block
    is mmapped and returned on free: about the 128 MiB still live."""
    assert _rss_left_mb("default") > 240
    assert _rss_left_mb("fixed") < 150


def test_a_users_own_threshold_wins(monkeypatch):
    from lightning_moe.parallel.runtime.host_memory import return_large_blocks_to_the_system

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_large_blocks_to_the_system() is False
