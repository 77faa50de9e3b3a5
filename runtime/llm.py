"""`LLM`: the offline API. `LLM(model).generate(prompts, SamplingParams)` runs every prompt
through the continuously batched engine and returns the outputs in prompt order."""

from dataclasses import dataclass

from tqdm import tqdm

from qkiln.errors import RequestError

from .loader import load_for_serving
from .sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None  # the stop string or stop token id that ended the text (engine.RequestOutput)
    # SamplingParams.logprobs / prompt_logprobs: entries {"token_id", "logprob", "top"} (engine.RequestOutput)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None


class LLM:
    def __init__(self, model: str, dtype: str = "auto", int8_activations: bool = False, **engine_kwargs):
        """int8_activations: see loader.load_for_serving (CPU, artifacts, opt-in, not exact)."""
        loaded = load_for_serving(model, dtype=dtype, int8_activations=int8_activations)
        self.engine = loaded.engine(**engine_kwargs)
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[CompletionOutput]:
        """Outputs in prompt order. `params`: one for all prompts, or one per prompt. A prompt the
        engine refuses, or an interrupt, aborts every request of this call: the LLM stays usable."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(params, list) and len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} SamplingParams; give one for all "
                               "or one per prompt")
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(p, sp))
            return self._run(ids, params_list, progress)
        finally:
            for request_id in ids:  # those still running after an error or an interrupt
                self.engine.abort_request(request_id)

    def _run(self, ids: list[str], params_list: list, progress: bool) -> list[CompletionOutput]:
        done: dict[str, CompletionOutput] = {}
        # generated tokens' logprobs, for the requests that asked (None for the others)
        logprobs: dict[str, list | None] = {i: [] if sp is not None and sp.logprobs is not None else None
                                            for i, sp in zip(ids, params_list)}
        prompt_logprobs: dict[str, list | None] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not progress) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if logprobs[out.request_id] is not None:
                        logprobs[out.request_id] += out.logprobs
                    prompt_logprobs.setdefault(out.request_id, out.prompt_logprobs)  # the first output's
                    if out.finished:
                        done[out.request_id] = CompletionOutput(
                            out.prompt_token_ids, out.token_ids, out.text, out.finish_reason, out.stop_reason,
                            logprobs[out.request_id], prompt_logprobs[out.request_id])
                        bar.update(1)
        return [done[i] for i in ids]
