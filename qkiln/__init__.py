"""qkiln: quantization-first model compilation pipeline for LLMs."""
