"""`SamplingParams`: how one request wants its tokens chosen and when it wants to stop.

Owns the parameter set and its validation at the request edge (construction and `validate()`
raise `RequestError` with a message saying what to change; the engine validates again, since
fields can be changed after construction). Must not know about sequences, blocks
or tensors. Invariant after `validate()`: every field is in its documented range, so the
sampler and the scheduler never re-check.
"""

import copy
import dataclasses
import functools
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from qkiln.errors import RequestError

# Above this the sampler would have to sort and gather a very wide top-n per step; OpenAI caps at 20.
MAX_LOGPROBS = 20
# Stop strings are matched on the engine thread after every token of the request: 20,000 of them
# slowed every other client's tokens 20x. OpenAI takes 4; evaluation tasks send a handful.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 512
# what torch.Generator.manual_seed takes: a seed outside it failed only after the request was queued
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# A positive temperature below this is raised to it, as vLLM does: logits / 1e-38 overflows float32
# (NaN probabilities, token 0 every step), and at 0.01 sampling is already all but the argmax.
MIN_TEMPERATURE = 0.01
# OpenAI's ranges: presence/frequency penalties in [-2, 2], a logit bias in [-100, 100]. Each biased
# token is written on every step of the request: a bound, well above the few that ban or force one.
MAX_PENALTY, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS = 2.0, 100.0, 1024
# bad_words are matched against every request's output on each step; vLLM caps them at 128 too.
MAX_BAD_WORDS = 128
# stop_token_ids are looked up after every token; allowed_token_ids may be a whole vocabulary (the
# largest today hold 2^18 tokens). Unbounded, a 1 MB request had held every client for 80 s.
MAX_STOP_TOKEN_IDS, MAX_ALLOWED_TOKEN_IDS = 1024, 1 << 18
# OpenAI's cap on n. Each choice is an engine request of its own; admitted in one step, they
# compute the prompt's full KV blocks once and share them (block_manager.py).
MAX_N = 128


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options (vLLM / OpenAI semantics).

    temperature == 0 means greedy; a positive one below MIN_TEMPERATURE (0.01) is raised to it, as
    vLLM does. top_k <= 0 and top_p == 1 switch those filters off.
    `stop` strings are matched by the engine on detokenized text; `stop_token_ids` and EOS by
    the scheduler. `min_tokens` suppresses every stop condition except `max_tokens` until that
    many tokens have been generated.

    Logits are adjusted in vLLM's order before the choice, greedy included: `logit_bias` is added
    (token id -> bias), then `repetition_penalty` (CTRL, Keskar et al. 2019: a positive logit of a
    token in the prompt or the output is divided by it, a negative one multiplied), then
    `frequency_penalty` x its count in the output and `presence_penalty` once if it is in the output
    are subtracted (OpenAI's formula). After temperature, `min_p` drops tokens whose probability is
    below min_p x the top token's. `logprobs` asks for the generated tokens' logprobs (and the
    top n), `prompt_logprobs` for the prompt's (vLLM's semantics: every prompt token after the
    first, scored by the model given the ones before it; what loglikelihood evaluations read).

    `allowed_token_ids` keeps only those tokens (every other logit -inf); `bad_words` bans each
    word's last token wherever the output ends with the word's other tokens (vLLM's rule: each word
    is tokenized as it is and with a leading space, `bad_words.bad_words_token_ids`).

    Text (vLLM's options): `detokenize=False` returns token ids only (no text, no stop strings);
    `skip_special_tokens=False` keeps special tokens' text; `include_stop_str_in_output` keeps the
    stop string, or the stop token's text, that ended the output. `truncate_prompt_tokens` k keeps
    a prompt's last k tokens (-1: the context's length; a text prompt keeps its BOS in front, as
    left truncation in transformers does). `max_tokens=None` generates up to the end of the context.

    `n` asks for that many choices per prompt. The engine runs one sequence per request, so the
    callers (`LLM`, the server) fan a request out into `choices()`: with a seed, choice j samples
    with seed + j, as vLLM's n does, so the choices differ and each reproduces.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        # Accept lists (JSON bodies) and a single stop string, as OpenAI's API does.
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str) or (isinstance(value, Iterable)
                                                               and not isinstance(value, (bytes, Mapping))), name,
                   f"{name} must be a string or a list of strings, got {type(value).__name__} {value!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop or ())
        if isinstance(self.bad_words, str):
            self.bad_words = (self.bad_words,)
        self.bad_words = tuple(self.bad_words or ())
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
               f"logit_bias maps token ids to biases, got {type(self.logit_bias).__name__}")
        if self.logit_bias:  # JSON's keys are strings: "50256" means token 50256, as in OpenAI's API
            self.logit_bias = {_token_id_key(k): v for k, v in self.logit_bias.items()}
        if self.seed == -1:  # vLLM's "no seed": a fixed seed made every such request the same sample
            self.seed = None
        self.validate()  # a bad value is refused where it is written (RequestError is a ValueError)

    def __setattr__(self, name: str, value) -> None:
        # vLLM's options qkiln lacks (skip_special_tokens, include_stop_str_in_output, ...) had been
        # set as plain attributes and ignored, silently
        if name not in _FIELDS:
            raise AttributeError(f"SamplingParams has no option {name!r} (qkiln's are {', '.join(sorted(_FIELDS))})")
        super().__setattr__(name, value)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the choice depends on the tokens so far (prompt and output)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the choice, so a greedy row is not their argmax."""
        return self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None

    def choices(self, score_prompt_once: bool = True) -> list["SamplingParams"]:
        """The n choices' own SamplingParams (n 1 each): choice j's seed is seed + j. The choices
        share one prompt, so only the first scores it (prompt_logprobs) and the others take its KV
        blocks from the prefix cache; score_prompt_once=False keeps the scores in every choice (a
        stream echoes each choice's prompt logprobs as it goes)."""
        first = copy.copy(self.validate())
        first.n = 1
        others = [_with_seed(first, None if self.seed is None else self.seed + j) for j in range(1, self.n)]
        if score_prompt_once:
            for choice in others:
                choice.prompt_logprobs = None
        return [first] + others

    def admitted(self) -> "SamplingParams":
        """A validated copy for the engine to hold (vLLM clones too): a caller that reuses one params
        object and changes it (a loop setting max_tokens) changed the requests it had submitted,
        and one grown past the KV cache after the scheduler had checked it waited for ever."""
        return dataclasses.replace(self)  # __post_init__: fresh tuples and logit_bias dict, validated

    def validate(self) -> "SamplingParams":
        """Raise `RequestError` naming the bad field and its allowed range; return self (with a
        tiny positive temperature raised to MIN_TEMPERATURE)."""
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               f"max_tokens must be an integer >= 1, or None for the rest of the context, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature < float("inf"),
               "temperature", f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        _check(_is_int(self.top_k) and self.top_k >= -1,
               "top_k", f"top_k must be an integer >= 1, or -1 / 0 to disable it, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               "top_p", f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               "seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], or null / -1 for none, got {self.seed!r}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(self.seed is None or self.seed + self.n - 1 <= SEED_MAX, "seed",
               f"seed + n - 1 must be at most {SEED_MAX} (choice j uses seed + j); lower the seed")
        self.stop_token_ids = TokenIds.checked(self.stop_token_ids or (), "stop_token_ids", MAX_STOP_TOKEN_IDS)
        _check(all(isinstance(s, str) and s and _is_text(s) for s in self.stop),
               "stop", f"stop must be non-empty strings of valid Unicode (no lone surrogates), got {list(self.stop)!r}")
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
               f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters, got "
               f"{len(self.stop)} (longest {max(map(len, self.stop), default=0)})")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}")
        n = self.prompt_logprobs
        _check(n is None or (_is_int(n) and 0 <= n <= MAX_LOGPROBS),
               "prompt_logprobs",
               f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.prompt_logprobs!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
               "min_tokens",
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                   name, f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it), "
                         f"got {value!r}")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < float("inf"),
               "repetition_penalty",
               f"repetition_penalty must be a finite number > 0 (1 disables it), got {self.repetition_penalty!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
               "min_p", f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        bias = self.logit_bias or {}
        _check(len(bias) <= MAX_LOGIT_BIAS_TOKENS, "logit_bias",
               f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
        bad_keys = [t for t in bias if not (_is_int(t) and t >= 0)]
        _check(not bad_keys, "logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {bad_keys[:5]!r}")
        bad_values = [v for v in bias.values() if not (_is_number(v) and abs(v) <= MAX_LOGIT_BIAS)]
        _check(not bad_values, "logit_bias", f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                             f"{MAX_LOGIT_BIAS:g}], got {bad_values[0] if bad_values else None!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = TokenIds.checked(self.allowed_token_ids, "allowed_token_ids",
                                                      MAX_ALLOWED_TOKEN_IDS, "or None, ")
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids",
                   "allowed_token_ids must be a non-empty list of token ids, or None (no restriction)")
        words = self.bad_words
        _check(all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS and _is_text(w) for w in words)
               and len(words) <= MAX_BAD_WORDS, "bad_words",
               f"bad_words must be at most {MAX_BAD_WORDS} strings of valid Unicode that are not blank, each at most "
               f"{MAX_STOP_CHARS} characters, got {list(words)!r:.200}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            value = getattr(self, name)
            _check(isinstance(value, (bool, np.bool_)), name, f"{name} must be true or false, got {value!r}")
            setattr(self, name, bool(value))  # numpy's as Python's
        _check(self.detokenize or not self.stop, "stop",
               "stop strings are matched on the text, so they need detokenize=True (or use stop_token_ids)")
        k = self.truncate_prompt_tokens
        _check(k is None or (_is_int(k) and (k >= 1 or k == -1)), "truncate_prompt_tokens",
               f"truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last k tokens), -1 (the "
               f"context's length) or None, got {k!r}")
        return self


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def valid_sampling_defaults(defaults: dict | None) -> dict:
    """A model's recommended sampling values (ModelConfig.sampling_defaults) that SamplingParams
    takes; one out of range (say top_p 0) is left out with a warning rather than failing every
    request that does not set it."""
    kept = {}
    for name, value in (defaults or {}).items():
        try:
            SamplingParams(**{name: value})
        except (RequestError, TypeError) as e:
            warnings.warn(f"the model's generation_config.json sets {name} {value!r}, which is not used: {e}",
                          stacklevel=2)
            continue
        kept[name] = value
    return kept


class TokenIds(tuple):
    """Token ids checked once, when made, without duplicates: a request's n choices share one, and
    every later validate() (the engine's, the scheduler's) takes it as it is; its range and its
    tensor are kept, so neither the vocabulary check nor a step goes through the ids again."""

    @classmethod
    def checked(cls, ids, param: str, limit: int, also: str = "") -> "TokenIds":
        if isinstance(ids, TokenIds):
            return ids
        _check(isinstance(ids, (list, tuple, set, frozenset, range)) and all(_is_int(t) and t >= 0 for t in ids),
               param,
               f"{param} must be a list of token ids (integers >= 0), {also}got {ids!r:.200}")
        made = cls(dict.fromkeys(ids))
        _check(len(made) <= limit, param, f"{param} takes at most {limit} distinct token ids, got {len(made)}")
        return made

    @functools.cached_property
    def largest(self) -> int:
        return max(self, default=-1)

    def tensor(self, device):
        """As a tensor on `device` (a torch.device), made once: a row's logits are restricted with
        it every step."""
        import torch  # SamplingParams is made where torch need not be loaded (the server's edge)

        cached = self.__dict__.get("_tensor")
        if cached is None or cached.device != device:
            cached = self.__dict__["_tensor"] = torch.tensor(self, dtype=torch.long, device=device)
        return cached


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    """A copy with another seed, set as is: made anew, a seed of -1 (from seed -2, n 3) would have
    become "no seed", so that choice was not reproducible."""
    child = copy.copy(params)
    child.seed = seed
    return child


def _token_id_key(key):
    """A logit_bias key as a token id: an int, or a string of digits (JSON's object keys)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return key  # validate() names it


def check_unicode(text: str, what: str, param: str) -> None:
    """RequestError naming `what` when `text` holds a lone surrogate (JSON's "\\ud800" decodes to one):
    it is no text, and the tokenizer's own TypeError said neither where nor why."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} holds a lone UTF-16 surrogate at character {e.start}, which is not text; send "
                           "valid Unicode", param) from None


def _is_text(s: str) -> bool:
    """Encodable as UTF-8: JSON's "\ud800" decodes to a lone surrogate, which the tokenizer cannot take."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rejects NaN


def _check(ok: bool, param: str, message: str) -> None:
    """Raise RequestError(message) naming `param`, which the server puts in OpenAI's error body."""
    if not ok:
        raise RequestError(message, param)
