"""qkiln.runtime: the serving engine. `from qkiln.runtime import LLM, SamplingParams` is the
offline API (llm.py, with its output types); they load on first use, so importing a submodule
stays light."""

__all__ = ["LLM", "SamplingParams", "PromptOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    if name in ("LLM", "PromptOutput", "CompletionOutput", "Logprob"):
        from . import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
