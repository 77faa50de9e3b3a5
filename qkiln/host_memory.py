"""How the process gets memory from the OS for CPU tensors; set up once by `import qkiln`.

Huge pages: torch's CPU allocator madvises allocations of 2 MB and more for transparent huge pages
when THP_MEM_ALLOC_ENABLE=1. It reads the variable once, at its first allocation, so this only
takes effect when qkiln is imported before torch (the `qkiln` command always is). Offline SmolLM2
W4A16, 64 x 128/128 on 2 threads: +9% output tokens/s (decode step median 104 -> 90 ms), peak RSS
+3%; HF generate unchanged. An explicit THP_MEM_ALLOC_ENABLE=0 in the environment is respected.

Freed memory kept: by default glibc gives large freed blocks back to the OS (munmap of an mmap'd
block, or trimming the top of its heap), so every step's large temporaries (a 64 x 49152 logits
tensor, a 1024-token prefill's MLP activations) are faulted in again, and on huge pages each fault
zeroes 2 MB: a bf16 -> fp32 copy of 64 x 49152 logits measured 11.5 ms against 0.2 ms
into reused memory (2 threads). Raising the mmap and trim thresholds makes glibc recycle freed
blocks from its heap instead; the heap keeps its peak size. Offline SmolLM2 W4A16 64 x 128/128, same
process, 3 rounds: the 8 prefill steps 6.67 -> 5.76 s (median), decode steps unchanged within
noise, peak RSS 1373 -> 1370 MiB. QKILN_KEEP_FREED_MEMORY=0 turns it off.
"""

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_THRESHOLD_BYTES = 1 << 30  # tensors up to 1 GB come from the heap and go back to it


def set_up() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if os.environ.get("QKILN_KEEP_FREED_MEMORY", "1") != "0":
        keep_freed_memory()


def keep_freed_memory() -> bool:
    """mallopt the thresholds up; False where the C library is not glibc (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD_BYTES))
