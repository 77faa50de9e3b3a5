"""`LLMEngine`: the serving loop, one `step()` = schedule -> run -> postprocess (nano-vllm's shape).

Owns requests (ids, detokenizers, per-request generators) and turns sampled tokens into
`RequestOutput`s. Scheduling lives in scheduler.py, KV blocks in block_manager.py, tensors in
runner.py, sampling in sampler.py. Not thread-safe: the async engine drives it from one thread.
"""

import dataclasses
import itertools
import math
import numbers
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from qkiln.errors import QkilnError, RequestError
from qkiln.plugins import allocate_kv_cache, kv_bytes_per_block
from qkiln.plugins.kv_cache import KV_DTYPES, KV_SCALE_NAMES, float_dtype_name
from qkiln.quant.scheme import KV_INT4_GROUP_SIZE

from .bad_words import bad_words_token_ids
from .block_manager import KVCacheManager
from .cuda_graphs import GraphRunner
from .detokenizer import IncrementalDetokenizer, NoText
from .memory_limits import available_bytes
from .model import CausalLM
from .runner import ModelRunner
from .sampler import Sampler, SamplerOutput, make_generator, score_tokens
from .sampling_params import SamplingParams, TokenIds, valid_sampling_defaults
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence

# Prompt rows turned into logits at once for prompt logprobs: 256 x a 128k vocabulary in fp32 is
# 128 MB (a whole 1024-token step's would be 0.5 GB, and as much again for its log_softmax).
PROMPT_SCORE_ROWS = 256


class NonFiniteLogitsError(QkilnError):
    """The model's logits for some of a step's requests hold NaN or inf: their tokens would be
    garbage. The step is rolled back; the caller fails `request_ids` and may go on with the rest,
    telling each one `for_request(id)` (the message names them all: a server's ids carry its
    clients' x-request-id, a gateway's trace id, which no other client is to see)."""

    def __init__(self, where: dict[str, str], dtype_name: str):
        """where: request id -> the token whose logits are not finite ("output token 3")."""
        self.request_ids, self._where, self._dtype_name = tuple(where), where, dtype_name
        more = f" and {len(where) - 1} more" if len(where) > 1 else ""
        super().__init__(self._message(self.request_ids[0], more))
        # LLM.generate: every prompt's output, None for those that failed (the others ran to the end)
        self.outputs: list | None = None

    def for_request(self, request_id: str) -> str:
        return self._message(request_id, "")

    def _message(self, request_id: str, more: str) -> str:
        return (f"the model's logits are not finite (NaN or inf) for request {request_id!r} at "
                f"{self._where[request_id]}{more}: its activations overflowed {self._dtype_name} or the weights "
                "hold NaN; the request was stopped rather than answered with garbage (with --dtype fp16, try bf16 "
                "or fp32)")


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from kv_cache_bytes
    kv_cache_bytes: int = 512 << 20
    enable_prefix_caching: bool = True
    kv_dtype: str = "auto"  # auto: the model's dtype, or what the artifact's KV scheme says
    kv_group_size: int = KV_INT4_GROUP_SIZE  # a build's int4 KV groups (quant/scheme.py)
    max_model_len: int | None = None
    device: str = "cpu"
    # > 0: one sequence's prefill chunk per step is at most this many tokens, so a long prompt
    # leaves budget for requests behind it (0: as vLLM's default, a prompt takes what is left)
    long_prefill_token_threshold: int = 0
    # False: prompts are split only at fixed positions, so scores repeat whatever else runs
    # (scheduler.py, "Fixed chunks"); vLLM's --no-enable-chunked-prefill
    enable_chunked_prefill: bool = True
    # "auto": a request's unset sampling values default to the model's generation_config.json
    # (vLLM's default); "vllm": to SamplingParams' own, whatever the model recommends
    generation_config: str = "auto"
    # vLLM's: the seed of the random draws of requests without their own seed (None: torch's global
    # generator), and on a GPU, run decode steps without CUDA graphs
    seed: int | None = None
    enforce_eager: bool = False

    def __post_init__(self):
        """Each bad value is refused here, with the option to change (the scheduler's asserts met
        `serve --max-num-seqs 0` as a traceback)."""
        for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("block_size", 1),
                          ("kv_cache_bytes", 1), ("num_kv_blocks", 1), ("max_model_len", 2),
                          ("long_prefill_token_threshold", 0)):
            value = getattr(self, name)
            if value is None and name in ("num_kv_blocks", "max_model_len"):
                continue  # sized from kv_cache_bytes / the model's context
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise QkilnError(f"{name} must be an integer >= {low}, got {value!r}")
        for f in dataclasses.fields(self):
            if f.name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
                setattr(self, f.name, _switch(f.name, getattr(self, f.name), f.default))
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise QkilnError(f"seed must be an integer or None, got {self.seed!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise QkilnError(f"kv_dtype must be 'auto' (the model's, or the artifact's KV scheme) or one of "
                             f"{', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise QkilnError(f"generation_config must be 'auto' (the model's sampling defaults) or 'vllm' "
                             f"(SamplingParams' own), got {self.generation_config!r}")


def _switch(name: str, value, default: bool) -> bool:
    """An on/off option: a bool (numpy's too); None is the default, as vLLM's configs take it. Text
    is refused: "false" was truthy, so the switch an evaluation job turned off stayed on."""
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_)):
        raise QkilnError(f"{name} must be True or False, got {value!r}")
    return bool(value)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    # vLLM's extension: the stop string or stop_token_ids entry that ended the text; None for EOS,
    # length and abort
    stop_reason: int | str | None = None
    # for new tokens, when asked: {"token_id", "logprob", "rank", "top": {token id: logprob}} each
    logprobs: list[dict] = field(default_factory=list)
    # vLLM's request timing stats, in seconds. On the first token's output: "ttft" (arrival to first
    # token). On the finished output of a request that ran to its end, also: "e2e" (arrival to last
    # token), "queue" (the engine's receipt to first schedule), "prefill" (first schedule to first
    # token), "decode" (first to last token), "inference" (first schedule to last token) and
    # "num_output_tokens"
    metrics: dict = field(default_factory=dict)
    # Seconds from the request's previous output token to each new token after its first (vLLM's
    # inter-token latency, one a step; a merged output carries those of every output it merged)
    inter_token_latencies: list[float] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs, on the first output only: one entry per prompt token,
    # None for the first (nothing scores it), else {"token_id", "logprob", "rank", "top"} as in `logprobs`
    prompt_logprobs: list[dict | None] | None = None
    num_cached_tokens: int = 0  # the prompt's tokens a prefix-cache hit spared computing (vLLM's field)

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This output and the next of the same request as one (a stream consumer that fell behind):
        the new tokens, text and logprobs of both; everything else as of `later`; timing stats and
        prompt logprobs from whichever has them."""
        return dataclasses.replace(
            later, new_token_ids=self.new_token_ids + later.new_token_ids, new_text=self.new_text + later.new_text,
            logprobs=self.logprobs + later.logprobs, metrics=self.metrics | later.metrics,
            inter_token_latencies=self.inter_token_latencies + later.inter_token_latencies,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


def truncation(truncate_prompt_tokens: int | None, max_model_len: int, max_request_len: int) -> int | None:
    """The prompt tokens a request keeps (SamplingParams.truncate_prompt_tokens; -1: as many as a
    request may hold, max_request_len: the context, or less where the KV cache holds less, the
    max_model_len a server reports; -1 had kept the whole context, which such a server refused)."""
    if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_model_len:  # as vLLM refuses it
        raise RequestError(f"truncate_prompt_tokens {truncate_prompt_tokens} is more than the model's context of "
                           f"{max_model_len}; lower it, or send -1 for the context", "truncate_prompt_tokens")
    if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_request_len:
        raise RequestError(f"truncate_prompt_tokens {truncate_prompt_tokens} is more than the {max_request_len} tokens "
                           "a request may hold here (the KV cache's size, serve --kv-cache-mb); lower it, or send -1 "
                           "for that limit", "truncate_prompt_tokens")
    return max_request_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def last_tokens(ids: list[int], keep: int | None) -> list[int]:
    """A token-id prompt cut to its last `keep` ids (taken as they are, BOS or not); None keeps all."""
    return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep:]


def is_token_ids(x) -> bool:
    """A prompt given as token ids: a list or tuple of integers (numpy's too, not bools)."""
    return isinstance(x, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x)


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | NoText
    generator: torch.Generator | None
    arrival: float  # time.perf_counter() clock, as the other times
    queued_time: float  # received by the engine
    scheduled_time: float | None = None  # first put in a step
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_logprobs: list[dict | None] | None = None  # filled as prompt chunks are computed
    # the prompt's distinct ids, which repetition_penalty reads each step: found once (the whole
    # prompt made into a tensor and sorted each step cost 151 ms a step at 64 x 3000-token prompts)
    prompt_token_set: torch.Tensor | None = None

    def penalty_history(self) -> tuple[torch.Tensor, list[int]]:
        if self.prompt_token_set is None:
            self.prompt_token_set = torch.tensor(self.seq.prompt_token_ids, dtype=torch.int64).unique()
        return self.prompt_token_set, self.seq.output_token_ids


def stop_token_ids(config, tokenizer) -> tuple[int, ...]:
    """What ends a generation: the model's EOS ids (config.json and generation_config.json) and,
    as in vLLM, the tokenizer's EOS: a fine-tune's end-of-turn token is often named only there."""
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    return tuple(dict.fromkeys([*config.eos_token_ids, *([] if tokenizer_eos is None else [tokenizer_eos])]))


def check_in_vocabulary(token_ids, vocab_size: int, what: str, param: str) -> None:
    """Refuse the first id outside [0, vocab_size), naming it and the request field it came in."""
    bad = next((t for t in token_ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"{what} {bad} is outside the vocabulary: ids must be in [0, {vocab_size})", param)


def check_sampling_token_ids(params: SamplingParams, vocab_size: int, bad_words=()) -> None:
    """A request's token-id fields against the vocabulary: a stop token id or a biased one indexes
    the logits (a ban, a bias), and one outside them failed the whole step, every request in it.
    The server runs this before it decides capacity, so such a request is a 400 even when the
    server is full, not a 429 that clients retry. bad_words: their token ids, where tokenized."""
    for what, param, token_ids in (("stop_token_ids entry", "stop_token_ids", params.stop_token_ids),
                                   ("logit_bias token", "logit_bias", params.logit_bias or ()),
                                   ("allowed_token_ids entry", "allowed_token_ids", params.allowed_token_ids or ()),
                                   ("bad_words token", "bad_words", itertools.chain.from_iterable(bad_words))):
        if isinstance(token_ids, TokenIds) and token_ids.largest < vocab_size:
            continue  # checked >= 0 when made: its largest says it all (a whole vocabulary is 2^18 ids)
        check_in_vocabulary(token_ids, vocab_size, what, param)


def check_kv_pool_fits(pool_bytes: int) -> None:
    """The KV pool is allocated whole at start: one larger than the memory left (the host's, or a
    container's limit) died in an allocation traceback after the model loaded, or was OOM-killed."""
    available = available_bytes()
    if pool_bytes > available:
        raise QkilnError(f"the KV cache pool needs {pool_bytes / 2**20:.0f} MiB and {available / 2**20:.0f} MiB is "
                         "free (the host's, or the container's limit): lower --kv-cache-mb (kv_cache_bytes) or "
                         "num_kv_blocks")


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig | None = None, kv_scales=None,
                 name: str = "the model"):
        """name: what messages call the model (an eval job loading many is told which one)."""
        config = config or EngineConfig()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config
        self.dtype_name = float_dtype_name(next(model.parameters()).dtype)  # the activations'
        kv_dtype = config.kv_dtype if config.kv_dtype != "auto" else self.dtype_name
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            # as vLLM: positions past the trained context are not extended (no RoPE scaling is applied)
            raise QkilnError(f"max_model_len {config.max_model_len} exceeds the model's context of "
                             f"{mc.max_position_embeddings} tokens; lower it or leave it out")
        block_bytes = kv_bytes_per_block(mc.num_hidden_layers, config.block_size, mc.num_key_value_heads,
                                         mc.head_dim, kv_dtype, config.kv_group_size)
        num_blocks = config.num_kv_blocks or max(2, config.kv_cache_bytes // block_bytes)
        self.kv_pool_bytes = num_blocks * block_bytes
        if str(config.device) == "cpu":
            check_kv_pool_fits(self.kv_pool_bytes)
        self.caches = allocate_kv_cache(mc.num_hidden_layers, num_blocks, config.block_size, mc.num_key_value_heads,
                                        mc.head_dim, kv_dtype, config.kv_group_size, config.device,
                                        has_k_channel_scale=bool(kv_scales and kv_scales.get("k_channel_scale")),
                                        has_k_offset=bool(kv_scales and kv_scales.get("k_offset")))
        _install_kv_scales(self.caches, kv_scales)
        if kv_dtype == "fp8" and not (kv_scales and kv_scales.get("k_scale")):
            # as vLLM says it: keys or values past +-448 saturate, and nothing else would tell
            # named: Python shows a warning once per text and place, and a job loads artifacts from one line
            warnings.warn(f"{name}: the fp8 KV cache has no calibrated scales here, so K and V are stored at "
                          "scale 1.0 (values past +-448 saturate); build the artifact with a kv-fp8 recipe for "
                          "calibrated scales", stacklevel=2)
        self.kv_dtype = kv_dtype
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # the longest prompt, or prompt + output, one request can reach: the context, or the pool's
        # slots when fewer (a prompt that fills them is scored in full, as evaluations read it; a
        # generated last token would need no slot, but one more would be a prompt that cannot run)
        self.max_request_len = min(self.max_model_len, num_blocks * config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.long_prefill_token_threshold,
                            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill),
            self.kv_manager, eos_token_ids=stop_token_ids(mc, tokenizer),
            primary_eos_token_id=getattr(tokenizer, "eos_token_id", None))
        model.rope.fit(self.max_model_len)  # before a runner hands its tables to a decode stack or a graph
        if str(config.device).startswith("cuda") and not config.enforce_eager:  # decode steps replay CUDA graphs
            self.runner = GraphRunner(model, self.caches, config.block_size, config.device,
                                      max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs)
        else:
            self.runner = ModelRunner(model, self.caches, config.block_size, config.device)
        self.sampler = Sampler(None if config.seed is None else make_generator(config.seed, config.device))
        # what a request's unset sampling fields take (EngineConfig.generation_config)
        self.sampling_defaults = valid_sampling_defaults(mc.sampling_defaults) \
            if config.generation_config == "auto" else {}
        self.requests: dict[str, _Request] = {}
        self.last_step_request_ids: tuple[str, ...] | None = ()  # set by step() before it runs
        self._ids = itertools.count()
        self.stats = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_steps": 0, "num_finished": 0,
                      "num_aborted": 0}

    # ---- requests -------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's recommended values (sampling_defaults) in place."""
        return SamplingParams(**self.sampling_defaults)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """arrival_time: when the request arrived, a time.time() (vLLM's arrival_time; None: now); a
        server passes the moment it received it, so the time it waited to be handed to the engine
        counts in its latencies. params None: the model's recommended values
        (default_sampling_params), as LLM.generate takes them."""
        if params is not None and not isinstance(params, SamplingParams):  # vLLM's order is (id, prompt, params)
            raise RequestError(f"params must be a SamplingParams, not {type(params).__name__} (the order is prompt, "
                               "params, request_id)", "sampling_params")
        params = (params or self.default_sampling_params()).admitted()
        if params.n != 1:  # one request is one sequence
            raise RequestError(f"the engine runs one choice per request, got n {params.n}: add params.choices() "
                               "one by one (LLM.generate and the server do)", "n")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        keep = truncation(params.truncate_prompt_tokens, self.max_model_len, self.max_request_len)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, keep_last=keep)
        elif is_token_ids(prompt):
            ids = last_tokens([int(t) for t in prompt], keep)
        else:  # int() of whatever it iterated failed with a message about int()
            raise RequestError(f"a prompt is a string or a list of token ids (ints), got {type(prompt).__name__}",
                               "prompt")
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        check_in_vocabulary(ids, self.model.config.vocab_size, "prompt token id", "prompt")
        check_sampling_token_ids(params, self.model.config.vocab_size, bad_words)
        if len(ids) > self.max_model_len:  # one of exactly max_model_len gets one token (as in vLLM)
            raise RequestError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len}: shorten it",
                               "prompt")
        if params.max_tokens is None:  # the rest of the context (or of what the KV cache holds)
            room = max(self.max_request_len - len(ids), 1)
            if params.min_tokens > room:
                raise RequestError(f"min_tokens {params.min_tokens} does not fit: the prompt takes {len(ids)} of the "
                                   f"{self.max_request_len} tokens a request may reach; lower it", "min_tokens")
            params = dataclasses.replace(params, max_tokens=room)
        seq = Sequence(request_id, ids, params, bad_words_token_ids=bad_words)
        # everything that can fail comes before the scheduler holds the sequence: a sequence it
        # holds without a record here would break every later step
        generator = make_generator(params.seed, self.config.device) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                       params.include_stop_str_in_output, params.min_tokens) \
            if params.detokenize else NoText()
        self.scheduler.add(seq)  # raises RequestError for anything it cannot ever schedule
        scored = None if params.prompt_logprobs is None else [None] * len(ids)  # filled as the prompt is computed
        now = time.perf_counter()  # the latencies' clock: monotonic, unlike time.time()
        arrival = now if arrival_time is None else now - max(0.0, time.time() - arrival_time)
        self.requests[request_id] = _Request(seq, detok, generator, arrival, now, prompt_logprobs=scored)
        self.stats["num_prompt_tokens"] += len(ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            self.stats["num_aborted"] += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------
    def step(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One step: schedule, run the model, sample. on_scheduled: called once the step's requests are
        scheduled, before the model runs (a server publishes its gauges then: a prefill step can take
        seconds, and gauges from before it showed its requests as still waiting)."""
        # which requests a step that raises had in it (None: it failed before it knew), so that a
        # server fails those and keeps the rest
        self.last_step_request_ids = None
        plan = self.scheduler.schedule()
        self.last_step_request_ids = tuple(s.seq_id for s in plan.scheduled)
        if plan.is_empty:
            return []
        now = time.perf_counter()
        for seq_id in self.last_step_request_ids:
            req = self.requests.get(seq_id)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = now
        if on_scheduled is not None:
            on_scheduled()
        try:
            out = self._run(plan)
        except BaseException:  # an interrupt too: the caller may abort the requests or go on
            self.scheduler.rollback(plan)
            raise
        sampling = plan.sampling
        sampled = dict(zip((s.seq_id for s in sampling), out.token_ids.tolist()))
        finished = {seq.seq_id for seq in self.scheduler.update(plan, sampled)}
        self.stats["num_steps"] += 1
        outputs = []
        try:
            for row, s in enumerate(sampling):
                outputs.append(self._postprocess(s, sampled[s.seq_id], out, row, finished))
        except BaseException:
            # The sequences hold this step's tokens already; one not post-processed (an interrupt, or a
            # detokenizer failure) would go on with its text a token short, or, finished, never leave
            # `requests`: those are aborted, so the caller may go on with the rest.
            for s in sampling[len(outputs):]:
                self.abort_request(s.seq_id)
            raise
        return outputs

    def _run(self, plan) -> SamplerOutput:
        """The model and the sampler on one step's plan (prompt logprobs recorded on the way)."""
        sampling = plan.sampling
        params = [s.seq.sampling_params for s in sampling]
        banned = [s.banned_token_ids for s in sampling]
        # Plain greedy steps may get their tokens with the logits (the native decode stack's head)
        step = self.runner.run(plan, argmax=self.sampler.is_plain_argmax(params, banned))
        if step.prompt_hidden is not None:
            self._score_prompts(plan, step.prompt_hidden)
        saved = []
        if step.argmax is not None:
            out = SamplerOutput(step.argmax)
        else:
            history = [self.requests[s.seq_id].penalty_history() for s in sampling] \
                if any(p.has_penalties for p in params) else None
            generators = [self.requests[s.seq_id].generator for s in sampling]
            # A step failed by non-finite rows is run again without them: seeded requests draw again
            # what they drew (their outputs had changed with a failed neighbour). ~1 us a request.
            saved = [(g, g.get_state()) for g in generators if g is not None]
            out = self.sampler.sample(step.logits, params, generators, banned, history)
        try:
            self._check_finite(step.logits, out.token_ids, sampling)
        except NonFiniteLogitsError:
            for generator, state in saved:
                generator.set_state(state)
            raise
        return out

    def _check_finite(self, logits: torch.Tensor, token_ids: torch.Tensor, sampling) -> None:
        """Raise NonFiniteLogitsError naming the rows whose chosen token's logit is NaN or inf: an
        fp16 overflow or NaN weights make a whole row NaN, and a greedy row's argmax is a NaN
        wherever the row has one (NaN counts as the largest). One value a row: ~10 us a step, where
        a pass over every logit cost ~100 us at batch 1 (SmolLM2, bf16)."""
        chosen = logits.gather(1, token_ids[:, None]).view(-1).tolist()
        bad = [row for row, value in enumerate(chosen) if not math.isfinite(value)]
        if bad:
            seqs = [sampling[row].seq for row in bad]
            raise NonFiniteLogitsError({s.seq_id: f"output token {s.num_output_tokens + 1}" for s in seqs},
                                       self.dtype_name)

    def _score_prompts(self, plan, hidden: torch.Tensor) -> None:
        """Record the logprob of each prompt token the step's prompt rows predict (a preempted
        prompt computed again overwrites its entries with the same quantities). The rows' logits
        are made PROMPT_SCORE_ROWS at a time, which bounds their memory whatever the vocabulary."""
        first = 0
        for s in plan.scheduled:
            positions = s.prompt_logprob_positions
            if not positions:
                continue
            n = s.seq.sampling_params.prompt_logprobs
            entries = self.requests[s.seq_id].prompt_logprobs
            for lo in range(0, len(positions), PROMPT_SCORE_ROWS):
                part = positions[lo:lo + PROMPT_SCORE_ROWS]
                rows = self.runner.compute_logits(hidden[first + lo:first + lo + len(part)])
                targets = s.seq.prompt_token_ids[part.start + 1:part.stop + 1]
                scores = score_tokens(rows, torch.tensor(targets, device=rows.device), n)
                chosen, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
                bad = next((k for k, value in enumerate(chosen) if not math.isfinite(value)), None)
                if bad is not None:  # an overflow at one position only: the sampled row can be fine
                    raise NonFiniteLogitsError({s.seq_id: f"prompt token {part[bad] + 2} (its prompt logprob)"},
                                               self.dtype_name)
                for k, (position, target) in enumerate(zip(part, targets)):
                    top = {} if n == 0 else dict(zip(scores.top_token_ids[k].tolist(), scores.top_logprobs[k].tolist()))
                    entries[position + 1] = {"token_id": target, "logprob": chosen[k], "rank": ranks[k], "top": top}
            first += len(positions)

    def _postprocess(self, s, token_id, out, row, finished) -> RequestOutput:
        req = self.requests[s.seq_id]
        now = time.perf_counter()
        first_token = req.first_token_time is None
        req.first_token_time = req.first_token_time or now
        gaps = [] if req.last_token_time is None else [now - req.last_token_time]
        req.last_token_time = now
        is_done = s.seq_id in finished
        if is_done and s.seq.finish_reason == "stop":  # the scheduler stops on tokens: EOS, stop_token_ids
            req.detok.finish_on_stop_token(token_id)
            stop_str, stop_reason = None, self.scheduler.stop_token(s.seq)
        else:
            stop_str = stop_reason = req.detok.update([token_id], is_final=is_done)
        if stop_str is not None and not is_done:
            self.scheduler.finish(s.seq_id, "stop")
            is_done = True
        elif stop_str is not None and s.seq.finish_reason == "length":  # the stop string came with the last token
            s.seq.set_finished("stop")
        self.stats["num_generated_tokens"] += 1
        logprobs = []
        if s.seq.sampling_params.logprobs is not None and out.logprobs is not None:
            n = s.seq.sampling_params.logprobs  # 0: the sampled token's logprob only (no top tensors then)
            top = {} if n == 0 else dict(zip(out.top_token_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist()))
            logprobs = [{"token_id": token_id, "logprob": float(out.logprobs[row]), "rank": int(out.ranks[row]),
                         "top": top}]
        result = RequestOutput(
            s.seq_id, s.seq.prompt_token_ids, [token_id], req.detok.get_next_output_text(is_done),
            s.seq.output_token_ids, req.detok.output_text, is_done,
            s.seq.finish_reason if is_done else None, stop_reason, logprobs, inter_token_latencies=gaps,
            num_cached_tokens=s.seq.num_cached_tokens)
        if req.prompt_logprobs is not None and s.seq.num_output_tokens == 1:
            assert all(e is not None for e in req.prompt_logprobs[1:]), f"{s.seq_id!r}: a prompt token went unscored"
            result.prompt_logprobs = req.prompt_logprobs
        if is_done:
            self.requests.pop(s.seq_id, None)
            self.stats["num_finished"] += 1
            scheduled = req.scheduled_time  # set by the step that produced its first token
            result.metrics = {"ttft": req.first_token_time - req.arrival, "e2e": now - req.arrival,
                              "queue": scheduled - req.queued_time, "prefill": req.first_token_time - scheduled,
                              "decode": now - req.first_token_time, "inference": now - scheduled,
                              "num_output_tokens": s.seq.num_output_tokens}
        elif first_token:
            result.metrics = {"ttft": now - req.arrival}
        return result

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()  # the KV manager's checks too


def _install_kv_scales(caches, kv_scales: dict | None) -> None:
    """Static per-layer scales from the artifact: {"k_scale": [t...], "v_scale": [...], "k_channel_scale": [...],
    "k_offset": [...]}."""
    if not kv_scales:
        return
    for name in KV_SCALE_NAMES:
        values = kv_scales.get(name) or []
        assert not values or len(values) == len(caches), f"{len(values)} {name} for {len(caches)} layers"
        for cache, value in zip(caches, values):
            target = getattr(cache, name)
            if target is not None:  # fp8 scales mean nothing to a cache of another dtype (--kv-dtype)
                target.copy_(value)
