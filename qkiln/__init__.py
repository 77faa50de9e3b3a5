"""qkiln: quantization-first model compilation pipeline for LLMs."""

from qkiln import host_memory, host_threads

# Before torch loads: huge pages for large tensors (host_memory.py), OpenMP workers that spin a
# little longer before they sleep (host_threads.py).
host_memory.set_up()
host_threads.set_up()

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    """`from qkiln import LLM, SamplingParams`, as vLLM's users write it: loaded on first use, so
    `import qkiln` stays light (the CLI's start-up)."""
    if name == "__version__":  # the installed distribution's, as `qkiln --version` prints it
        from importlib.metadata import version

        return version("qkiln")
    if name in __all__:
        from qkiln import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'qkiln' has no attribute {name!r}")
