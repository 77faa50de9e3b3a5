"""qkiln: quantization-first model compilation pipeline for LLMs."""

from qkiln import host_memory

# Before torch loads: huge pages for large tensors (host_memory.py).
host_memory.set_up()
