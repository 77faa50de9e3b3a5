"""`Sampler`: next-token choice from a step's logits, one row per sampling sequence.

Owns greedy, temperature, top-k, top-p (nucleus; Holtzman et al. 2019, "The Curious Case of
Neural Text Degeneration", sec. 3.1), min-p, logit bias, repetition / frequency / presence
penalties, per-request seeds, banned tokens (min_tokens) and the optional logprobs. Must not know
about sequences or stop conditions: the caller passes the token ids the penalties count.

Per step, in vLLM's order: logit bias and bans, then penalties (on the logits, greedy rows too),
then for random rows temperature, min-p, top-k / top-p and the draw.

Random rows use the exponential-race form of categorical sampling: argmax(p_i / q_i) with
q_i ~ Exp(1) picks i with probability p_i (as vLLM does), so one batched draw serves every row,
and a seeded row refills its own q from its own generator. A seeded request therefore consumes
exactly `vocab_size` exponentials per step whatever else is in the batch: same seed, same
tokens, regardless of batch composition.

Logprobs are `log_softmax` of the raw logits (before temperature, filters and min_tokens' ban),
as OpenAI and vLLM report them.
"""

import itertools
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
        return all(p.is_greedy and p.logprobs is None and not p.adjusts_logits for p in params) and \
            not (banned_token_ids is not None and any(banned_token_ids))

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               banned_token_ids: Sequence[Sequence[int]] | None = None,
               token_history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> SamplerOutput:
        """Pick one token per row. `generators[i]` (or None) serves row i when it samples randomly.
        `token_history[i]`: row i's (prompt token ids, output token ids), which its penalties count;
        needed when some row has penalties."""
        num_seqs, vocab_size = logits.shape
        assert len(params) == num_seqs, (len(params), num_seqs)
        raw = logits  # logprobs are of these: before bias, bans and penalties, as vLLM's raw_logprobs
        logits = _adjust(logits, params, banned_token_ids, token_history)
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
        if any(p.min_p > 0.0 for p in params):
            scaled = _apply_min_p(scaled, params)
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


def _adjust(logits: torch.Tensor, params: Sequence[SamplingParams], banned_token_ids, token_history) -> torch.Tensor:
    """The logits after each row's bias, bans and penalties: an fp32 copy, or `logits` itself when
    no row has any."""
    has_ban = banned_token_ids is not None and any(banned_token_ids)
    if not (has_ban or any(p.adjusts_logits for p in params)):
        return logits
    logits = logits.to(torch.float32, copy=True)
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if has_ban and banned_token_ids[i]:
            logits[i, list(banned_token_ids[i])] = float("-inf")
    if any(p.has_penalties for p in params):
        assert token_history is not None and len(token_history) == len(params), "penalties need token_history"
        _apply_penalties(logits, params, token_history)
    return logits


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], token_history) -> None:
    """In place, on the rows with penalties (one [rows, vocab] count of their tokens):
        repetition: a token seen in the prompt or output has its logit divided by the penalty when
                    positive, multiplied when not (CTRL; HF's and vLLM's rule)
        frequency, presence: logit -= frequency x output count + presence x (output count > 0)."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    device, vocab_size = logits.device, logits.shape[1]

    def column(name):
        return torch.tensor([getattr(params[i], name) for i in rows], device=device).unsqueeze(1)  # [rows, 1]

    index = torch.tensor(rows, device=device)
    picked = logits[index]  # [rows, vocab]
    output_counts = _token_counts([token_history[i][1] for i in rows], vocab_size, device)
    if any(params[i].repetition_penalty != 1.0 for i in rows):
        prompts = [token_history[i][0] if params[i].repetition_penalty != 1.0 else () for i in rows]
        seen = (output_counts > 0) | (_token_counts(prompts, vocab_size, device) > 0)
        penalty = column("repetition_penalty")
        picked = torch.where(seen, torch.where(picked > 0, picked / penalty, picked * penalty), picked)
    picked = picked - column("frequency_penalty") * output_counts - column("presence_penalty") * (output_counts > 0)
    logits[index] = picked


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """[len(token_lists), vocab_size] how often each token occurs in each list (one bincount)."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
    rows = torch.arange(len(token_lists), device=device).repeat_interleave(lengths)
    counts = torch.bincount(rows * vocab_size + ids, minlength=len(token_lists) * vocab_size)
    return counts.view(len(token_lists), vocab_size).to(torch.float32)


def _apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's top probability (Nguyen et al. 2024,
    "Min P Sampling"); the top token always stays, since min_p <= 1."""
    min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)  # [num_seqs, 1]
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))


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
