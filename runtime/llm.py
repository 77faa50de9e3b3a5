"""`LLM`: the offline API. `LLM(model).generate(prompts, SamplingParams)` runs every prompt
through the continuously batched engine and returns the outputs in prompt order."""

from dataclasses import dataclass

from tqdm import tqdm

from .engine import EngineConfig, LLMEngine
from .loader import load_for_serving
from .sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    def __init__(self, model: str, dtype: str = "auto", int8_activations: bool = False, **engine_kwargs):
        """int8_activations: see loader.load_for_serving (CPU, artifacts, opt-in, not exact)."""
        loaded = load_for_serving(model, dtype=dtype, int8_activations=int8_activations)
        kv_dtype = engine_kwargs.pop("kv_dtype", loaded.kv_dtype)
        self.engine = LLMEngine(loaded.model, loaded.tokenizer,
                                EngineConfig(kv_dtype=kv_dtype, kv_group_size=loaded.kv_group_size, **engine_kwargs),
                                kv_scales=loaded.kv_scales)
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, CompletionOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not progress) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = CompletionOutput(out.prompt_token_ids, out.token_ids, out.text,
                                                                out.finish_reason)
                        bar.update(1)
        return [done[i] for i in ids]
