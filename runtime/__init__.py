"""qkiln.runtime: the serving engine. `from qkiln.runtime import LLM, SamplingParams` is the
offline API (llm.py); they load on first use, so importing a submodule stays light."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
