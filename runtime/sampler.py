"""`Sampler`: next-token choice from a step's logits, one row per sampling sequence.

Owns greedy, temperature, top-k, top-p (nucleus; Holtzman et al. 2019, "The Curious Case of
Neural Text Degeneration", sec. 3.1), per-request seeds, banned tokens (min_tokens) and the
optional logprobs. Must not know about sequences or stop conditions.

Random rows use the exponential-race form of categorical sampling: argmax(p_i / q_i) with
q_i ~ Exp(1) picks i with probability p_i (as vLLM does), so one batched draw serves every row,
and a seeded row refills its own q from its own generator. A seeded request therefore consumes
exactly `vocab_size` exponentials per step whatever else is in the batch: same seed, same
tokens, regardless of batch composition.

Logprobs are `log_softmax` of the raw logits (before temperature, filters and min_tokens' ban),
as OpenAI and vLLM report them.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qkiln.plugins import ops
from qkiln.runtime.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_seqs] int64
    # Logprob of each chosen token; None unless some row asked for logprobs.
    logprobs: torch.Tensor | None = None  # [num_seqs] fp32
    # Top-n by logprob for n = the largest `logprobs` asked; a row uses its own first n columns.
    top_logprobs: torch.Tensor | None = None  # [num_seqs, max_n] fp32
    top_token_ids: torch.Tensor | None = None  # [num_seqs, max_n] int64


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator the engine keeps for a seeded request across its steps.

    It must live on the logits' device (a CUDA generator for CUDA logits).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    @staticmethod
    def is_plain_argmax(params: Sequence[SamplingParams],
                        banned_token_ids: Sequence[Sequence[int]] | None = None) -> bool:
        """Whether `sample` returns ops.argmax of the logits as they are and nothing else (every row
        greedy, no banned tokens, no logprobs): a caller holding that argmax may skip it."""
        return all(p.is_greedy and p.logprobs is None for p in params) and \
            not (banned_token_ids is not None and any(banned_token_ids))

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               banned_token_ids: Sequence[Sequence[int]] | None = None) -> SamplerOutput:
        """Pick one token per row. `generators[i]` (or None) serves row i when it samples randomly."""
        num_seqs, vocab_size = logits.shape
        assert len(params) == num_seqs, (len(params), num_seqs)
        raw = logits  # logprobs are of these: before the ban, as vLLM's raw_logprobs
        if banned_token_ids is not None and any(banned_token_ids):
            logits = _ban(logits, banned_token_ids)
        if all(p.is_greedy for p in params):
            # The common serving case: one vectorized op on the model's logits as they are
            # (widening bf16 to fp32 keeps order and ties, so the argmax needs no fp32 copy).
            token_ids = ops.argmax(logits)
        else:
            token_ids = self._sample_random(logits.float(), params, generators)
        return self._with_logprobs(raw, params, token_ids)

    def _sample_random(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
        device = logits.device
        is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
        # Greedy rows get temperature 1 here only to avoid dividing by 0; argmax overrides them below.
        temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                                   device=device).unsqueeze(1)  # [num_seqs, 1]
        scaled = logits / temperature
        scaled = _apply_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)  # [num_seqs, vocab_size]
        q = torch.empty_like(probs).exponential_()  # [num_seqs, vocab_size]
        for i, p in enumerate(params):
            generator = generators[i] if generators is not None else None
            if generator is not None and not p.is_greedy:
                q[i].exponential_(generator=generator)
        sampled = ops.argmax(probs / q)
        return torch.where(is_greedy, ops.argmax(logits), sampled)

    def _with_logprobs(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       token_ids: torch.Tensor) -> SamplerOutput:
        max_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_n is None:
            return SamplerOutput(token_ids)
        return SamplerOutput(token_ids, *score_tokens(logits, token_ids, max_n))


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """logits [rows, vocab], token_ids [rows] -> (each token's logprob [rows] fp32, and with num_top
    > 0 the top num_top logprobs [rows, num_top] and their ids, else None, None). The token's value
    and the top values come from one log_softmax, so a token that is the argmax equals the top-1
    exactly (what loglikelihood evaluations compare to call a continuation greedy)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab_size]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [rows]
    if num_top == 0:
        return chosen, None, None
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [rows, num_top]
    return chosen, top_values, top_ids


def _ban(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    logits = logits.clone()
    for i, banned in enumerate(banned_token_ids):
        if banned:
            logits[i, list(banned)] = float("-inf")
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p sets with -inf (one sort for the batch).

    Ascending sort, per row:   [ low ........................ high ]
        top-k drops columns  <  vocab - k
        top-p drops the prefix whose cumulative probability <= 1 - p (the highest one always stays)
    Ties with the k-th value survive top-k, as in vLLM.
    """
    vocab_size = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    has_top_k = any(k < vocab_size for k in top_k)
    has_top_p = any(p < 1.0 for p in top_p)
    if not (has_top_k or has_top_p):
        return logits
    device = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # [num_seqs, vocab_size], ascending
    if has_top_k:
        k = torch.tensor(top_k, device=device)
        kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [num_seqs, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    if has_top_p:
        p = torch.tensor(top_p, device=device).unsqueeze(1)  # [num_seqs, 1]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = (cumulative <= 1.0 - p) & (p < 1.0)  # p == 1 rows keep everything despite rounding
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
