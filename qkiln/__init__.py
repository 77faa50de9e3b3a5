"""qkiln: quantization-first model compilation pipeline for LLMs."""

import os

# Large CPU tensors (weights, the paged KV cache) on transparent huge pages: torch's CPU allocator
# madvises allocations of 2 MB and more when THP_MEM_ALLOC_ENABLE=1. It reads the variable once,
# at its first allocation, so this only takes effect when qkiln is imported before torch (the
# `qkiln` command always is). Offline SmolLM2 W4A16, 64 x 128/128 on 2 threads: +9% output
# tokens/s (decode step median 104 -> 90 ms), peak RSS +3%; HF generate unchanged. An explicit
# THP_MEM_ALLOC_ENABLE=0 in the environment is respected.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
