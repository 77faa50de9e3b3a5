"""How the process gets memory from the OS for CPU tensors; set up once by `import qkiln`.

Huge pages: torch's CPU allocator madvises allocations of 2 MB and more for transparent huge pages
when THP_MEM_ALLOC_ENABLE=1. It reads the variable once, at its first allocation, so this only
takes effect when qkiln is imported before torch (the `qkiln` command always is). Offline SmolLM2
W4A16, 64 x 128/128 on 2 threads: +9% output tokens/s (decode step median 104 -> 90 ms), peak RSS
+3%; HF generate unchanged. An explicit THP_MEM_ALLOC_ENABLE=0 in the environment is respected.

Freed memory is left to glibc. Its default mmap threshold is dynamic: once a block of up to 32 MB
is given back with munmap, blocks of that size come from the heap, so a step's large temporaries
(64 x 49152 logits, a prefill chunk's MLP activations) are recycled without help. Earlier sessions
raised the mmap / trim thresholds to 1 GB here; that was measured against a fixed 128 KB
threshold, not the real default, and it is not dependable: torch allocates through
posix_memalign, which glibc 2.36 serves by asking for size + alignment + 32 bytes, so a freed block
pinned by a neighbour never fits the same request again (a probe's heap grew 16 MB a call, and a
CI machine saw 1560 page faults where this one saw 1 for the same five 16 MB tensors). Against
the defaults it gained nothing measurable: offline int8-activation runs, separate processes in
turn, 608-629 tok/s with it and 450-683 without (this host's noise). A caching allocator of our own
(freed blocks >= 2 MB pooled by size, installed as torch's CPU allocator) was tried too: same
process A/B, 407 vs 397 tok/s exact W4A16 and 568 vs 595 with int8 activations, so it was not kept.
"""

import os


def set_up() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
