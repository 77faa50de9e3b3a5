"""qkiln: quantization-first model compilation pipeline for LLMs."""

from qkiln import host_memory, host_threads

# Before torch loads: huge pages for large tensors (host_memory.py), OpenMP workers that spin a
# little longer before they sleep (host_threads.py).
host_memory.set_up()
host_threads.set_up()
