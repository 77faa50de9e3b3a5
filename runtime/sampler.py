"""`Sampler`: next-token choice from a step's logits, one row per sampling sequence.

Owns greedy, temperature, the random draw, per-request seeds and the optional logprobs; the
logits' adjustments and filters (logit bias, bans, penalties, min-p, top-k, top-p; Holtzman et
al. 2019 for top-p) are logits_processing.py's. Must not know about sequences or stop conditions.

Per step, in vLLM's order: logit bias and bans, then penalties (on the logits, greedy rows too),
then for random rows temperature, min-p, top-k / top-p and the draw.

The draw inverts each row's CDF: the first token whose cumulative probability reaches u x total,
for one u ~ U(0, 1] per row. A seeded row takes its u from its own generator, so it consumes one
number per step whatever else is in the batch: same seed, same tokens, regardless of batch
composition. (The exponential race vLLM uses on GPUs drew vocab_size exponentials per row: 15 ms
a step for 16 rows of 49,152 on a 2-core CPU, against ~0.5 ms for the cumulative sum.)

Logprobs are `log_softmax` of the raw logits (before temperature, filters and min_tokens' ban),
as OpenAI and vLLM report them.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qkiln.plugins import ops

from .logits_processing import adjust_logits, apply_min_p, apply_top_k_top_p
from .sampling_params import SamplingParams

_FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_seqs] int64
    # Logprob of each chosen token; None unless some row asked for logprobs.
    logprobs: torch.Tensor | None = None  # [num_seqs] fp32
    # Top-n by logprob for n = the largest `logprobs` asked; a row uses its own first n columns.
    top_logprobs: torch.Tensor | None = None  # [num_seqs, max_n] fp32
    top_token_ids: torch.Tensor | None = None  # [num_seqs, max_n] int64
    # Each chosen token's rank among the vocabulary (1: the most likely), with `logprobs`.
    ranks: torch.Tensor | None = None  # [num_seqs] int64


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator the engine keeps for a seeded request across its steps.

    It must live on the logits' device (a CUDA generator for CUDA logits).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        """generator: what rows without a generator of their own draw from (None: torch's global one)."""
        self.generator = generator

    @staticmethod
    def is_plain_argmax(params: Sequence[SamplingParams],
                        banned_token_ids: Sequence[Sequence[int]] | None = None) -> bool:
        """Whether `sample` returns ops.argmax of the logits as they are and nothing else (every row
        greedy, no banned tokens, no logprobs): a caller holding that argmax may skip it."""
        return all(p.is_greedy and p.logprobs is None and not p.adjusts_logits for p in params) and \
            not (banned_token_ids is not None and any(banned_token_ids))

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               banned_token_ids: Sequence[Sequence[int]] | None = None,
               token_history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> SamplerOutput:
        """Pick one token per row. `generators[i]` (or None) serves row i when it samples randomly.
        `token_history[i]`: row i's (prompt token ids, or their distinct ids, output token ids), which
        its penalties count; needed when some row has penalties."""
        num_seqs, vocab_size = logits.shape
        assert len(params) == num_seqs, (len(params), num_seqs)
        raw = logits  # logprobs are of these: before bias, bans and penalties, as vLLM's raw_logprobs
        logits = adjust_logits(logits, params, banned_token_ids, token_history)
        if all(p.is_greedy for p in params):
            # The common serving case: one vectorized op on the model's logits as they are
            # (widening bf16 to fp32 keeps order and ties, so the argmax needs no fp32 copy).
            token_ids = ops.argmax(logits)
        else:
            token_ids = self._sample_random(logits, params, generators)
        return self._with_logprobs(raw, params, token_ids)

    def _sample_random(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
        """logits: [num_seqs, vocab] (not written to) -> [num_seqs] int64. Full-row temporaries are
        made once and then worked in place: each fresh 3 MB one cost ~0.6 ms in page faults."""
        device = logits.device
        # Greedy rows get temperature 1 here only to avoid dividing by 0; argmax overrides them below.
        # A temperature past fp32's largest (it validates: finite) would be inf here, and a banned
        # token's -inf / inf NaN, which made every such row draw the last token: it is that largest.
        # fp32 draws and temperatures whatever torch's default dtype (a bf16 default had rounded u:
        # a 0.005-probability token came out at 0.0086)
        temperature = torch.tensor([1.0 if p.is_greedy else min(p.temperature, _FP32_MAX) for p in params],
                                   dtype=torch.float32, device=device).unsqueeze(1)  # [num_seqs, 1]
        scaled = logits / temperature  # fp32 (bf16 / fp32 promotes): a new tensor, ours to change
        scaled = apply_top_k_top_p(apply_min_p(scaled, params), params)
        # The running sum of unnormalized probabilities: the draw scales u by the total, so no
        # softmax. In fp32 each token's share is off by up to one rounding of the running sum
        # (2^-24 of it): a token far below that (a 2e-9 tail token behind one of ~1) gets no share
        # or one ulp's, but the tail's total stays right (torch's CPU cumsum adds in double;
        # probe s47). Exact per-token tails would need a float64 row: not done.
        cdf = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)  # [num_seqs, vocab]
        # u in (0, 1]: no 0-probability head. A row with its own generator (a request's seed) draws
        # from it alone, and greedy rows draw nothing: the shared generator (the engine's seed, else
        # torch's global one, which the caller's code uses too) serves only the other rows.
        own = [None if generators is None or p.is_greedy else generators[i] for i, p in enumerate(params)]
        shared = [i for i, p in enumerate(params) if own[i] is None and not p.is_greedy]
        u = torch.ones(len(params), 1, dtype=torch.float32, device=device)
        if shared:
            u[shared] = 1.0 - torch.rand(len(shared), 1, dtype=torch.float32, device=device, generator=self.generator)
        for i, generator in enumerate(own):
            if generator is not None:
                u[i] = 1.0 - torch.rand(1, dtype=torch.float32, device=device, generator=generator)
        # the first token whose running sum reaches u x total (a 0-probability token adds nothing,
        # so it is never the first to reach it)
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        if not any(p.is_greedy for p in params):
            return sampled
        is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
        return torch.where(is_greedy, ops.argmax(logits), sampled)

    def _with_logprobs(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       token_ids: torch.Tensor) -> SamplerOutput:
        max_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_n is None:
            return SamplerOutput(token_ids)
        scores = score_tokens(logits, token_ids, max_n)
        return SamplerOutput(token_ids, scores.logprobs, scores.top_logprobs, scores.top_token_ids, scores.ranks)


class TokenScores(NamedTuple):
    logprobs: torch.Tensor  # [rows] fp32: each token's
    ranks: torch.Tensor  # [rows] int64: each token's rank in the vocabulary, 1 the most likely (vLLM's)
    top_logprobs: torch.Tensor | None  # [rows, num_top] fp32, None for num_top 0
    top_token_ids: torch.Tensor | None  # [rows, num_top] int64


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenScores:
    """logits [rows, vocab], token_ids [rows] -> their logprobs and ranks, and with num_top > 0
    the top num_top logprobs and ids. The token's value and the top values come from one
    log_softmax, so a token that is the argmax equals the top-1 exactly (what loglikelihood
    evaluations compare to call a continuation greedy)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab_size]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [rows]
    ranks = (logprobs >= chosen.unsqueeze(1)).sum(1)  # vLLM's: tied tokens share the worse rank
    if num_top == 0:
        return TokenScores(chosen, ranks, None, None)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [rows, num_top]
    return TokenScores(chosen, ranks, top_values, top_ids)
