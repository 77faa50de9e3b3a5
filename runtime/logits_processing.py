"""What a step does to the logits before a token is drawn: each request's logit bias, allowed
tokens, bans (min_tokens' stop tokens, bad words) and penalties (`adjust_logits`), and the min-p,
top-k and top-p filters (`apply_min_p`, `apply_top_k_top_p`), vectorized over the batch.

Owns the formulas (SamplingParams documents them); the sampler decides which run and draws.
Must not know about sequences: the caller passes the token ids the penalties count.

The filters avoid sorting whole rows: a sort of 16 x 49,152 logits took 30 ms on a 2-core CPU
(a decode step of SmolLM2 W4A16 takes ~40). Top-k's threshold and top-p's nucleus come from
each row's `topk` candidates; for a row whose nucleus is wider than them, from a histogram of its
probability mass by logit, sorting only the tokens of the bin where the mass reaches p.
"""

from collections.abc import Sequence

import torch

from .sampling_params import SamplingParams

# Candidates per row in which top-p looks for its nucleus first (a topk of 256 of 49,152 costs
# ~1 ms for 16 rows; most nuclei of p <= 0.95 fit in far fewer tokens).
TOP_P_CANDIDATES = 256
# Bins of the histogram a wider nucleus is found with (see _wide_nucleus_threshold).
HISTOGRAM_BINS = 2048


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], banned_token_ids=None,
                  token_history=None) -> torch.Tensor:
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
        if p.allowed_token_ids is not None:  # before the bans: a banned allowed token stays banned
            ids = p.allowed_token_ids.tensor(logits.device)
            kept = logits[i, ids]
            logits[i] = float("-inf")
            logits[i, ids] = kept
        if has_ban and banned_token_ids[i]:
            ids = list(banned_token_ids[i])
            kept = logits[i, ids]
            logits[i, ids] = float("-inf")
            if not torch.isfinite(logits[i]).any():  # allowed_token_ids held only banned tokens: the ban yields
                logits[i, ids] = kept
    if any(p.has_penalties for p in params):
        assert token_history is not None and len(token_history) == len(params), "penalties need token_history"
        _apply_penalties(logits, params, token_history)
    return logits


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], token_history) -> None:
    """In place, on the rows with penalties, touching only the tokens each row has seen:
        repetition: a token seen in the prompt or output has its logit divided by the penalty when
                    positive, multiplied when not (CTRL; HF's and vLLM's rule)
        frequency, presence: logit -= frequency x output count + presence x (output count > 0).
    Each row's tokens are found as unique (row, token) keys of the flat logits, so a step costs
    what its histories hold, not rows x vocabulary (full-row passes cost 10-40 ms a step)."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    flat = logits.view(-1)
    vocab_size = logits.shape[1]
    repeating = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeating:
        seen = _unique_keys([token_history[i][0] for i in repeating] + [token_history[i][1] for i in repeating],
                            repeating * 2, vocab_size, logits.device)[0]
        penalty = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[seen // vocab_size]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
    if counted:
        keys, counts = _unique_keys([token_history[i][1] for i in counted], counted, vocab_size, logits.device)
        row = keys // vocab_size
        frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[row]
        presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)[row]
        flat[keys] = flat[keys] - frequency * counts - presence


def _unique_keys(token_lists: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int,
                 device) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct row * vocab_size + token keys of the lists (list j belongs to row rows[j]; a list
    or a 1-D tensor) and how often each occurs."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
    ids = torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in token_lists]).to(device)
    row = torch.tensor(rows, dtype=torch.int64, device=device).repeat_interleave(lengths)
    keys, counts = torch.unique(row * vocab_size + ids, return_counts=True)
    return keys, counts.to(torch.float32)


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's top probability (Nguyen et al. 2024,
    "Min P Sampling"); the top token always stays, since min_p <= 1."""
    if not any(p.min_p > 0.0 for p in params):
        return logits
    min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)  # [num_seqs, 1]
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and then top-p set with -inf.

    Each row keeps the tokens at or above one threshold: its k-th largest logit (top-k; ties with
    it stay, as in vLLM), raised to the smallest logit of its nucleus (top-p: the most likely
    tokens, in order, while the mass before each is below p, measured on the top-k-renormalized
    distribution). Both come from the row's largest `max(k, TOP_P_CANDIDATES)` logits; a top-p row
    whose candidates hold less than p of its mass has its nucleus found from a histogram.
    """
    vocab_size = logits.shape[-1]
    top_k, top_p, has_top_k, has_top_p = _top_k_top_p(params, vocab_size)
    if not (has_top_k or has_top_p):
        return logits
    device = logits.device
    if device.type != "cpu":  # a GPU sorts fast, and finding the wide rows would sync with the host
        return top_k_top_p_by_sort(logits, params)
    num_candidates = min(vocab_size, max([k for k in top_k if k < vocab_size] +
                                         [TOP_P_CANDIDATES if has_top_p else 1]))
    values = logits.topk(num_candidates, dim=-1).values  # [num_seqs, C], descending
    k = torch.tensor(top_k, device=device).unsqueeze(1)  # [num_seqs, 1]
    in_top_k = k < vocab_size
    kth = values.gather(1, (k.clamp(max=num_candidates) - 1))  # [num_seqs, 1]
    threshold = torch.where(in_top_k, kth, torch.full_like(kth, float("-inf")))
    if has_top_p:
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        candidates = values.masked_fill(values < threshold, float("-inf"))
        # the normalizer of the top-k set, over the whole row: tokens tied with the k-th logit
        # stay, and may lie beyond the candidates
        in_top_k_set = logits.masked_fill(logits < threshold, float("-inf"))
        normalizer = in_top_k_set.logsumexp(dim=-1, keepdim=True)
        probs = (candidates - normalizer).exp()
        mass = probs.cumsum(dim=-1)
        num_kept = ((mass - probs) < p).sum(dim=-1, keepdim=True)  # >= 1: the top token's mass before is 0
        nucleus_min = values.gather(1, num_kept - 1)
        applies = p < 1.0
        unresolved = applies & (mass[:, -1:] < p)  # the nucleus reaches past the candidates
        threshold = torch.where(applies & ~unresolved, torch.maximum(threshold, nucleus_min), threshold)
        rows = unresolved.squeeze(1).nonzero().squeeze(1)
        if rows.numel():  # the top-k set's nucleus, from a histogram (top-k's threshold is below it)
            threshold[rows] = _wide_nucleus_threshold(in_top_k_set[rows], p[rows])
    return logits.masked_fill(logits < threshold, float("-inf"))


def _wide_nucleus_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, vocab], [rows, 1] -> [rows, 1] the smallest logit of each row's nucleus, for nuclei
    wider than the candidates, without sorting rows (a radix-select step): the probability mass
    goes into HISTOGRAM_BINS bins of equal logit width from the top, the bin where the cumulative
    mass reaches p is found, and only that bin's tokens are sorted."""
    finite = torch.isfinite(logits)
    top = logits.amax(dim=-1, keepdim=True)
    low = logits.masked_fill(~finite, float("inf")).amin(dim=-1, keepdim=True)
    width = (top - low).clamp_min(1e-6)
    # bin 0 holds the largest logits; -inf ones (no probability) go to the last bin
    bins = ((top - logits.masked_fill(~finite, 0.0)) / width * (HISTOGRAM_BINS - 1)).long()
    bins = bins.clamp_(0, HISTOGRAM_BINS - 1).masked_fill_(~finite, HISTOGRAM_BINS - 1)
    probs = logits.softmax(dim=-1)
    cumulative = torch.zeros(logits.shape[0], HISTOGRAM_BINS, device=logits.device).scatter_add_(1, bins, probs)
    cumulative = cumulative.cumsum_(dim=-1)
    # p of the mass as summed here (0.9996 at 49,152 even tokens in fp32): against p itself, a p
    # near 1 was never reached and an empty last bin was searched
    top_p = top_p * cumulative[:, -1:]
    crossing = (cumulative < top_p).sum(dim=-1, keepdim=True).clamp_(max=HISTOGRAM_BINS - 1)  # [rows, 1]
    above = torch.where(crossing > 0, cumulative.gather(1, (crossing - 1).clamp(min=0)), 0.0)
    thresholds = []
    for r in range(logits.shape[0]):
        in_bin = (bins[r] == crossing[r]).nonzero().squeeze(1)
        values, order = logits[r, in_bin].sort(descending=True)
        p_sorted = probs[r, in_bin][order]
        num_kept = int(((above[r] + p_sorted.cumsum(0) - p_sorted) < top_p[r]).sum().clamp(min=1))
        thresholds.append(values[num_kept - 1])
    return torch.stack(thresholds).unsqueeze(1)


def top_k_top_p_by_sort(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`apply_top_k_top_p` by sorting whole rows: the reference, and the GPU's path.

    Ascending sort, per row:   [ low ........................ high ]
        top-k drops columns  <  vocab - k
        top-p drops the prefix whose cumulative probability <= 1 - p (the highest one always stays)
    The row then keeps every logit at or above its smallest kept one: ties with the k-th value
    survive top-k, as in vLLM, and ties with the nucleus's last survive top-p, as on the CPU path
    (a sort keeping some of them by position kept 10% of a flat row at top_p 0.1, the CPU 100%).
    """
    vocab_size = logits.shape[-1]
    top_k, top_p, has_top_k, has_top_p = _top_k_top_p(params, vocab_size)
    if not (has_top_k or has_top_p):
        return logits
    device = logits.device
    sorted_logits = logits.sort(dim=-1).values  # [num_seqs, vocab_size], ascending
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if has_top_k:
        k = torch.tensor(top_k, device=device)
        keep &= sorted_logits >= sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
    if has_top_p:
        p = torch.tensor(top_p, device=device).unsqueeze(1)  # [num_seqs, 1]
        cumulative = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        drop = (cumulative <= 1.0 - p) & (p < 1.0)  # p == 1 rows keep everything despite rounding
        drop[:, -1] = False
        keep &= ~drop
    threshold = sorted_logits.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_k_top_p(params: Sequence[SamplingParams], vocab_size: int) -> tuple[list[int], list[float], bool, bool]:
    """Each row's k (vocab_size when top-k is off) and p (1.0 when top-p is off), and whether any
    row has top-k, top-p."""
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    return top_k, top_p, any(k < vocab_size for k in top_k), any(p < 1.0 for p in top_p)
