"""`LLM`: the offline API. `LLM(model).generate(prompts, SamplingParams)` runs every prompt
through the continuously batched engine and returns the outputs in prompt order; `LLM.chat`
renders conversations with the model's chat template first. Names follow vLLM's `LLM` where
qkiln has the feature (`sampling_params`, `use_tqdm`, `{"prompt_token_ids": ...}` prompts)."""

import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from qkiln.errors import RequestError, SourceModelError

from .engine import NonFiniteLogitsError, RequestOutput, is_token_ids
from .hf_tokenizer import TransformersStyleTokenizer
from .loader import check_engine_options, load_for_serving
from .logprob_dicts import Logprob, LogprobConverter, TokenLogprobs  # noqa: F401 (Logprob: part of this API)
from .memory_limits import release_freed_memory
from .sampling_params import SamplingParams, check_unicode


@dataclass
class CompletionOutput:
    """One choice (vLLM's CompletionOutput): choice `index` of its prompt's n."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None  # the stop string or stop token id that ended the text (engine.RequestOutput)
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, with SamplingParams.logprobs
    cumulative_logprob: float | None = None  # the generated tokens' logprobs summed, with logprobs


@dataclass
class PromptOutput:
    """One prompt's result, shaped as vLLM's RequestOutput: its `outputs` are its n choices. The
    first choice's fields read through (`out.text`, ...), as they did before n, for n == 1."""
    request_id: str  # vLLM's field: here the engine request id of choice 0
    prompt: str | None  # the prompt's text, when it was given as text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = True
    num_cached_tokens: int = 0  # of choice 0's prompt, taken from the prefix cache

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
    stop_reason = property(lambda self: self.outputs[0].stop_reason)
    logprobs = property(lambda self: self.outputs[0].logprobs)
    cumulative_logprob = property(lambda self: self.outputs[0].cumulative_logprob)


class LLM:
    def __init__(self, model: str, dtype: str = "auto", int8_activations: bool = False, device: str = "cpu",
                 *, dense_prefill: bool = True, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 kv_cache_dtype: str | None = None, **engine_kwargs):
        """model: an artifact directory or archive, or a source model (alias, HF directory, .gguf).
        engine_kwargs: EngineConfig's fields (max_num_seqs, num_kv_blocks, kv_dtype, seed, ...).
        int8_activations: see loader.load_for_serving (CPU, artifacts, opt-in, not exact).
        dense_prefill=False: an artifact's int4 / int8 linears keep no dense copy for prompts (CPU:
        less memory, slower prefill; quantized_linear.make_quantized_linear).
        vLLM's options, for scripts written for it: trust_remote_code changes nothing (qkiln runs no
        code of a checkpoint's, only the architectures it implements), tensor_parallel_size must be
        1 (one device), kv_cache_dtype is kv_dtype ("fp8" / "fp8_e4m3": fp8)."""
        if not isinstance(model, (str, os.PathLike)):  # None had been looked up as a model named 'None'
            raise TypeError(f"model must be a path or a name (an artifact, an archive or a source model), got "
                            f"{type(model).__name__}")
        if not isinstance(trust_remote_code, bool):
            raise TypeError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        if type(tensor_parallel_size) is not int or tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size!r}: qkiln runs a model on one device; "
                             "leave it at 1")
        if kv_cache_dtype is not None:
            engine_kwargs["kv_dtype"] = _kv_dtype(kv_cache_dtype, engine_kwargs.get("kv_dtype"))
        check_engine_options(engine_kwargs, device, "LLM()", "model, dtype, int8_activations, device, dense_prefill, "
                             "vLLM's trust_remote_code, tensor_parallel_size and kv_cache_dtype")
        loaded = load_for_serving(model, dtype=dtype, device=device, int8_activations=int8_activations,
                                  dense_prefill=dense_prefill)
        self.engine = loaded.engine(device=device, **engine_kwargs)
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        # One call steps the engine at a time: two threads stepping it took each other's outputs.
        self._lock = threading.Lock()

    def __del__(self):
        # An eval job drops one model and loads the next: glibc kept the freed weights (SmolLM2 W4A16,
        # a process of 0.23 GB: 1.20 GB live, 0.48-0.54 GB after `del llm`, 0.25 GB trimmed). Dropping
        # the references first frees them (the engine is the LLM's alone unless the caller kept it).
        self.__dict__.clear()
        release_freed_memory()

    def get_tokenizer(self) -> TransformersStyleTokenizer:
        """The tokenizer with transformers' calls and defaults (apply_chat_template(..., tokenize=False),
        tok(text), decode), as vLLM's get_tokenizer gives; `llm.tokenizer` is qkiln's own."""
        return TransformersStyleTokenizer(self.tokenizer, self.name)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling_params: SamplingParams() with the values the model's
        generation_config.json recommends (vLLM's; LLM(..., generation_config="vllm") turns them off)."""
        return self.engine.default_sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True) -> list[PromptOutput]:
        """Outputs in prompt order, each with its SamplingParams.n choices. prompts: a string, token
        ids, {"prompt": str} or {"prompt_token_ids": [...]}, or a list of those. sampling_params: one
        for all prompts, or one per prompt. A prompt the engine refuses, or an interrupt, aborts every
        request of this call: the LLM stays usable. Calls from several threads run one after another.
        use_tqdm: a progress bar over the prompts on stderr (vLLM's default), or, as in vLLM, a
        callable that makes one (called with total, desc and dynamic_ncols; then update and close)."""
        prompts = _prompt_list(prompts)
        if isinstance(sampling_params, tuple):  # any sequence of them, as vLLM takes
            sampling_params = list(sampling_params)
        if isinstance(sampling_params, list) and len(sampling_params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams; give one for "
                               "all or one per prompt")
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        wrong = next((p for p in params_list if p is not None and not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise RequestError(f"sampling_params must be a SamplingParams (or one per prompt), not "
                               f"{type(wrong).__name__}", "sampling_params")
        if None in params_list:  # made once: the model's recommended values (generation_config.json)
            default = self.get_default_sampling_params()
            params_list = [default if params is None else params for params in params_list]
        detokenizes = [params.detokenize for params in params_list]
        with self._lock:
            request_ids: list[list[str]] = []  # each prompt's choices' engine requests
            logprobs: dict[str, list | None] = {}  # the generated tokens' of a request that asks, else None
            try:
                for prompt, params in zip(prompts, params_list):
                    choices = params.choices()  # choice 0 scores the prompt; the others share its KV blocks
                    request_ids.append([])
                    for choice in choices:  # appended one by one: a refused one aborts those before it
                        request_ids[-1].append(self.engine.add_request(prompt, choice))
                        logprobs[request_ids[-1][-1]] = None if choice.logprobs is None else []
                return self._run(prompts, request_ids, logprobs, detokenizes, use_tqdm)
            finally:
                for request_id in itertools.chain.from_iterable(request_ids):  # those still running after an error
                    self.engine.abort_request(request_id)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool | Callable = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[PromptOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, rendered with the model's
        chat template (or `chat_template`) and tokenized as `/v1/chat/completions` does
        (Tokenizer.chat_prompt_ids); the options are vLLM's. `tools` go to the template, which
        describes them to the model; its calls come back as text (offline vLLM parses none either)."""
        if not isinstance(messages, (list, tuple)):  # a lone message dict indexed as a list was a KeyError
            raise RequestError("messages must be one conversation, a list of {'role', 'content'} dicts, or a list "
                               f"of conversations, got {type(messages).__name__}", "messages")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise RequestError("chat_template_kwargs must be a dict of the template's variables, got "
                               f"{type(chat_template_kwargs).__name__}", "chat_template_kwargs")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        conversations = [[_template_message(m) for m in c] for c in conversations]
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message continues the last message, so it needs "
                               "add_generation_prompt=False", "continue_final_message")
        template_kwargs = dict(chat_template_kwargs or {}, **({"tools": tools} if tools is not None else {}))
        try:
            prompts = [self.tokenizer.chat_prompt_ids(c, add_generation_prompt, chat_template=chat_template,
                                                      continue_final_message=continue_final_message,
                                                      template_kwargs=template_kwargs) for c in conversations]
        except SourceModelError as e:  # no template, or the template refused these messages
            raise RequestError(str(e), "messages") from e
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, request_ids: list[list[str]], logprobs: dict[str, list | None],
             detokenizes: list[bool], use_tqdm: bool | Callable) -> list[PromptOutput]:
        finished: dict[str, RequestOutput] = {}
        prompt_logprobs: dict[str, list | None] = {}  # from a request's first output
        prompt_of = {i: k for k, ids in enumerate(request_ids) for i in ids}
        unfinished = [len(ids) for ids in request_ids]  # choices per prompt: the bar counts prompts, as vLLM's
        failed: list[NonFiniteLogitsError] = []
        if callable(use_tqdm):  # vLLM's use: a factory called with total, desc, dynamic_ncols; update, close
            bar = use_tqdm(total=len(request_ids), desc="generate", dynamic_ncols=True)
        else:
            bar = tqdm(total=len(request_ids), desc="generate", unit="prompt", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except NonFiniteLogitsError as e:  # the step was rolled back: those requests end, the rest go on
                    failed.append(e)
                    for request_id in e.request_ids:
                        self.engine.abort_request(request_id)
                    continue
                for out in outputs:
                    if logprobs[out.request_id] is not None:
                        logprobs[out.request_id] += out.logprobs
                    prompt_logprobs.setdefault(out.request_id, out.prompt_logprobs)
                    if out.finished:
                        finished[out.request_id] = out
                        unfinished[prompt_of[out.request_id]] -= 1
                        bar.update(unfinished[prompt_of[out.request_id]] == 0)
        finally:
            bar.close()
        results, convert = [], LogprobConverter(self.tokenizer)
        for prompt, ids, detokenize in zip(prompts, request_ids, detokenizes):
            if any(i not in finished for i in ids):  # a choice failed
                results.append(None)
                continue
            outs = [finished[i] for i in ids]
            choices = []
            for j, o in enumerate(outs):
                entries = logprobs[o.request_id]
                cumulative = None if entries is None else sum(e["logprob"] for e in entries)
                choices.append(CompletionOutput(j, o.text, o.token_ids, o.finish_reason, o.stop_reason,
                                                convert.all(entries, detokenize), cumulative))
            results.append(PromptOutput(ids[0], prompt if isinstance(prompt, str) else None, outs[0].prompt_token_ids,
                                        choices, convert.all(prompt_logprobs[ids[0]], detokenize),
                                        num_cached_tokens=outs[0].num_cached_tokens))
        if failed:  # one prompt's overflow had thrown away a whole batch's outputs
            error = failed[0]
            error.outputs = results
            bad = [k for k, out in enumerate(results) if out is None]
            error.add_note(f"prompt(s) {', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''} of "
                           f"{len(results)} failed; the others ran to the end: their outputs are in this error's "
                           ".outputs (None for a failed prompt)")
            raise error
        return results


def _kv_dtype(kv_cache_dtype: str, kv_dtype: str | None) -> str:
    """vLLM's kv_cache_dtype as qkiln's kv_dtype: "auto", fp8 (e4m3, what qkiln stores), bfloat16 /
    float16, or qkiln's names."""
    if kv_dtype is not None:
        raise TypeError("give kv_dtype or vLLM's kv_cache_dtype, not both")
    named = {"fp8_e4m3": "fp8", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(kv_cache_dtype,
                                                                                           kv_cache_dtype)
    if named == "fp8_e5m2":
        raise ValueError("kv_cache_dtype fp8_e5m2: qkiln's fp8 KV cache is e4m3; use 'fp8' or 'fp8_e4m3'")
    return named  # EngineConfig / the KV cache name what they do not take


def _template_message(message: dict) -> dict:
    """A chat message as templates read it: OpenAI's content parts joined as the server joins them
    (text parts with "\n"; a template would otherwise print the parts' Python repr)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        check_unicode(content, "a message's content", "messages")
    if not isinstance(content, list):
        return message
    kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content} - {"text"})
    if kinds:
        raise RequestError(f"only text content parts are supported, not {', '.join(kinds)}", "messages")
    return {**message, "content": "\n".join(p["text"] for p in content)}


def _prompt_list(prompts) -> list[str | list[int]]:
    """The engine's prompt forms (text, or token ids as a list of ints) from what vLLM users pass."""
    if isinstance(prompts, (str, dict)) or _token_ids(prompts) is not None:
        prompts = [prompts]
    elif hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 2:  # a batch of token-id rows
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(f"prompts must be a string, token ids, a prompt dict or a list of those, "
                           f"got {type(prompts).__name__}", "prompt")
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


def _one_prompt(prompt, index: int) -> str | list[int]:
    if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
        if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
            raise RequestError(f"prompt {index}: multi_modal_data needs a multimodal model; qkiln serves text models",
                               "prompt")
        keys = set(prompt) - {"multi_modal_data", "mm_processor_kwargs"}
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return _one_prompt(prompt["prompt"], index)
        if keys == {"prompt_token_ids"} and not isinstance(prompt["prompt_token_ids"], (str, dict)):
            return _one_prompt(prompt["prompt_token_ids"], index)  # its own checks: empty, not ints
        raise RequestError(f"prompt {index}: a prompt dict holds one of 'prompt' (a string) or 'prompt_token_ids' "
                           f"(a list of ints), got keys {sorted(prompt)}", "prompt")
    if isinstance(prompt, str):
        check_unicode(prompt, f"prompt {index}", "prompt")
        return prompt
    ids = _token_ids(prompt)
    if ids is None and hasattr(prompt, "__len__") and len(prompt) == 0:
        raise RequestError(f"prompt {index} is empty; send at least one token", "prompt")
    if ids is None:
        raise RequestError(f"prompt {index} must be a string or a list of token ids (ints), "
                           f"got {type(prompt).__name__}", "prompt")
    return ids


def _token_ids(x) -> list[int] | None:
    """x as a list of ints when it is a 1-D sequence of integers (list, tuple, numpy, torch), else None."""
    if hasattr(x, "tolist") and getattr(x, "ndim", None) == 1:  # numpy / torch, without importing either
        x = x.tolist()
    return [int(t) for t in x] if is_token_ids(x) and len(x) > 0 else None
