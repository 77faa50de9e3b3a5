"""Accuracy evaluation on a pinned protocol: perplexity, bits per byte, KL and top-1 vs a reference.

Protocol (recorded verbatim in every report so numbers are comparable):
  text = the file's bytes as UTF-8, unchanged; ids = tokenize(text) without special tokens;
  keep the first `max_tokens`; cut into consecutive windows of `seq_len` (the last may be
  shorter); score every token of a window but its first. A tokenizer whose policy adds BOS
  gets BOS prepended to each window instead, and then every window token is scored.
Bits per byte divide the scored tokens' total NLL (in bits) by those tokens' UTF-8 bytes
(`Tokenizer.token_bytes`: a byte-fallback token is its one byte, a SentencePiece piece has its
space). KL is KL(reference || model) in nats per scored token, averaged; top-1 agreement is the
fraction of scored tokens where both argmaxes agree. Scoring is fp32 and deterministic.
"""

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from qkiln.calib_data import read_eval_text
from qkiln.errors import CalibrationDataError, QkilnError, RecipeError, SourceModelError

# ids [B, T] -> logits [B, T, V] (fp32); or an object whose hidden_states(ids) [B, T, H] and
# logits(hidden) [..., V] split that (model_ref.LoadedModel); or one whose score_targets(ids) gives
# the logprobs of ids[:, 1:] [B, T - 1] (served_eval.ServedScorer: perplexity and bits per byte, no KL)
Scorer = Callable[[torch.Tensor], torch.Tensor]
# Memory: a batch holds at most MAX_BATCH_TOKENS window tokens (the default 4 windows of 512 up to
# 16; a window of 8192 alone), and logits are scored SCORE_ROWS positions of one window at a time.
# Whole [B, T, V] logits were the peak: an 8192-token window of SmolLM2 is 1.6 GB a copy, and the
# build's default batch of 4 x 512 held six 400 MB copies (model, reference, their log-softmaxes,
# KL terms): +2.7 GB over the build's other phases. A scorer that offers hidden states never
# holds more than a slice's logits.
MAX_BATCH_TOKENS = 8192
SCORE_ROWS = 512


@dataclass
class EvalProtocol:
    data: str  # the file's name (a JSONL file's: NAME#FIELD); data_sha256 names its text wherever it was read from
    seq_len: int
    max_tokens: int
    add_bos: bool
    data_sha256: str = ""  # of the text's UTF-8 bytes

    def to_dict(self) -> dict:
        return {
            "data": self.data, "data_sha256": self.data_sha256, "seq_len": self.seq_len, "max_tokens": self.max_tokens,
            "bos_per_window": self.add_bos, "special_tokens": False, "stride": self.seq_len,
            "scored": "all window tokens" if self.add_bos else "all window tokens but the first",
        }


def make_windows(ids: list[int], seq_len: int, bos_id: int | None) -> list[list[int]]:
    windows = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    if bos_id is not None:
        windows = [[bos_id] + w for w in windows]
    return [w for w in windows if len(w) > 1]


def leading_tokens(tokenizer, text: str, n: int) -> list[int]:
    """tokenize(text)[:n], tokenizing only as much text as those tokens can span (a 20 MB file
    took 4 GB to score 1024 tokens). A token spells at most `max_token_chars` characters, so a
    prefix that long holds n tokens; the tokens near its cut may differ from the whole text's, so
    the prefix is accepted only when one twice as long begins with the same n tokens."""
    budget = (n + 64) * max(getattr(tokenizer, "max_token_chars", 0), 1)
    if 2 * budget < len(text):
        first = tokenizer.encode(text[:budget], add_special_tokens=False)[:n]
        if len(first) == n and tokenizer.encode(text[:2 * budget], add_special_tokens=False)[:n] == first:
            return first
    return tokenizer.encode(text, add_special_tokens=False)[:n]


def token_byte_lengths(tokenizer, ids: list[int]) -> dict[int, int]:
    """UTF-8 bytes each token stands for in the text. (Counting a piece's characters made a
    byte-fallback `<0xC3>` six bytes, and decoding a lone `▁word` lost its space.)"""
    return {i: len(tokenizer.token_bytes(i)) for i in set(ids)}


def check_window(option: str, seq_len: int, add_bos: bool, context: int, whose: str = "the model's",
                 error: type[QkilnError] = QkilnError) -> None:
    """A window of seq_len tokens, plus the BOS a tokenizer that adds one puts before it, must fit
    the context; the message names the option to lower and how far (an option to change: usage)."""
    window = seq_len + int(add_bos)
    if window > context:
        raise error(f"{option} {seq_len} (a window of {window} tokens) exceeds {whose} context of {context} "
                    f"tokens: lower it to at most {context - int(add_bos)}")


def check_reference(model_tokenizer, reference_tokenizer, vocab_sizes: tuple[int, int], reference_context: int,
                    seq_len: int) -> None:
    """A reference is scored on the model's token ids: it must read them as the same text."""
    if reference_tokenizer.backend.get_vocab(True) != model_tokenizer.backend.get_vocab(True) \
            or vocab_sizes[0] != vocab_sizes[1]:
        raise SourceModelError("the reference's tokenizer or vocabulary differs from the model's, so it would "
                               "score other text (a KL of nonsense); compare models that share a tokenizer")
    check_window("--seq-len", seq_len, model_tokenizer.add_bos, reference_context, whose="the reference's")


def evaluate(
    model: Scorer, tokenizer, data_path: str, seq_len: int, max_tokens: int,
    reference: Scorer | None = None, batch_size: int = 4, progress: bool = True,
) -> dict:
    return evaluate_many({"model": model}, tokenizer, data_path, seq_len, max_tokens, reference, batch_size,
                         progress)["model"]


def evaluation_tokens(tokenizer, data_path: str, seq_len: int, max_tokens: int) -> tuple[str, str, list[int]]:
    """(text, its name, its first max_tokens tokens), refusing data that is unreadable or shorter
    than one window: a build checks this before calibrating, not minutes later."""
    if seq_len < 2 or max_tokens < 2:
        raise QkilnError("--seq-len and --eval-tokens must be at least 2")
    text, data_name = read_eval_text(data_path)
    ids = leading_tokens(tokenizer, text, max_tokens)
    if len(ids) < min(seq_len, max_tokens):
        raise CalibrationDataError(f"{data_path} yields {len(ids)} tokens, fewer than one window of "
                                   f"{min(seq_len, max_tokens)}: give more text or a shorter window (qkiln "
                                   "eval's --seq-len; qkiln build's --eval-seq-len or evaluation.seq_len)")
    return text, data_name, ids


def evaluate_many(
    models: dict[str, Scorer], tokenizer, data_path: str, seq_len: int, max_tokens: int,
    reference: Scorer | None = None, batch_size: int = 4, progress: bool = True,
) -> dict[str, dict]:
    """Score several models on the same windows; the reference runs once per batch for all."""
    text, data_name, ids = evaluation_tokens(tokenizer, data_path, seq_len, max_tokens)
    if batch_size < 1:
        raise QkilnError(f"--batch-size must be at least 1, got {batch_size}")
    batch_size = min(batch_size, max(1, MAX_BATCH_TOKENS // seq_len))  # long windows: fewer at a time
    protocol = EvalProtocol(data_name, seq_len, max_tokens, tokenizer.add_bos,
                            hashlib.sha256(text.encode("utf-8")).hexdigest())
    windows = make_windows(ids, seq_len, tokenizer.bos_token_id if tokenizer.add_bos else None)
    byte_len = token_byte_lengths(tokenizer, ids)
    totals = {name: dict(nll=0.0, tokens=0, bytes=0, kl=0.0, agree=0, ref_nll=0.0) for name in models}
    # equal-length windows batch together; the shorter last one runs alone
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    batches = [[w for w in b if len(w) == len(b[0])] for b in batches] + [
        [w] for b in batches for w in b if len(w) != len(b[0])
    ]
    for batch in tqdm(batches, desc="eval", unit="batch", disable=not progress):
        ids_t = torch.tensor(batch)
        _score_batch(ids_t, models, reference, byte_len, totals)
        for name in models:
            _check_finite(totals[name], name, data_name)
    # the windows batched together move the last digits: the batch size that ran is recorded
    return {name: _report(t, len(windows), protocol, reference is not None) | {"batch_size": batch_size}
            for name, t in totals.items()}


def _check_finite(totals: dict, name: str, data_name: str) -> None:
    """NaN or Inf log-probabilities are a broken model, not a score: say so now, rather than write a
    NaN report (which is not JSON) after the whole run."""
    if not math.isfinite(totals["ref_nll"]):
        raise SourceModelError(f"the reference's log-probabilities on {data_name} are not finite (NaN or Inf): "
                               "its computation overflows; compare against another reference")
    if not (math.isfinite(totals["nll"]) and math.isfinite(totals["kl"])):
        raise RecipeError(f"{name}: its log-probabilities on {data_name} are not finite (NaN or Inf), so it has no "
                          "perplexity: its computation overflows. For a quantized model the recipe does not fit "
                          "the model (its values pass what a quantized format holds); rebuild it with "
                          "another recipe")


def _report(totals: dict, num_windows: int, protocol: EvalProtocol, has_reference: bool) -> dict:
    n = totals["tokens"]
    report = {
        "perplexity": math.exp(totals["nll"] / n),
        "bits_per_byte": totals["nll"] / math.log(2) / totals["bytes"],
        "num_tokens": n,
        "num_bytes": totals["bytes"],  # of the scored tokens: bits_per_byte = nll_nats / ln 2 / num_bytes
        "nll_nats": totals["nll"],
        "num_windows": num_windows,
        "protocol": protocol.to_dict(),
    }
    if has_reference:
        report["kl_divergence"] = totals["kl"] / n  # nats per scored token, KL(reference || model)
        report["top1_agreement"] = totals["agree"] / n  # a fraction
        report["reference_perplexity"] = math.exp(totals["ref_nll"] / n)
        # as the build's accuracy report has it, so an eval job compares one key with the manifest's
        report["perplexity_change"] = report["perplexity"] / report["reference_perplexity"] - 1
    return report


class _PredictingLogits:
    """A scorer's logits at the positions that predict ids[:, 1:], a slice [rows, V] of one window
    at a time (fp32): through its head per slice when it offers hidden states, else cut from its
    whole logits."""

    def __init__(self, scorer: Scorer, ids: torch.Tensor):
        split = hasattr(scorer, "hidden_states")
        self._values = scorer.hidden_states(ids) if split else scorer(ids)
        self._head = scorer.logits if split else None

    def __getitem__(self, index: tuple[int, slice]) -> torch.Tensor:
        part = self._values[index]
        return (part if self._head is None else self._head(part)).float()


@torch.no_grad()
def _score_batch(ids: torch.Tensor, models: dict[str, Scorer], reference: Scorer | None, byte_len: dict,
                 totals: dict[str, dict]) -> None:
    """Add one batch of windows to each model's totals; the reference's slice is computed once for all."""
    targets = ids[:, 1:]
    num_bytes = sum(byte_len.get(t, 0) for t in targets.flatten().tolist())
    logits = {}
    for name, model in models.items():
        totals[name]["tokens"] += targets.numel()
        totals[name]["bytes"] += num_bytes
        if hasattr(model, "score_targets"):  # the targets' logprobs only (served_eval.py): no KL
            assert reference is None, "a scorer of target logprobs has no distributions to compare"
            totals[name]["nll"] += -model.score_targets(ids).sum().item()
        else:
            logits[name] = _PredictingLogits(model, ids)
    if not logits:
        return
    ref_logits = None if reference is None else _PredictingLogits(reference, ids)
    for window in range(targets.shape[0]):
        for start in range(0, targets.shape[1], SCORE_ROWS):
            rows = (window, slice(start, min(start + SCORE_ROWS, targets.shape[1])))
            chosen = targets[rows].unsqueeze(-1)
            ref_logp = None if ref_logits is None else F.log_softmax(ref_logits[rows], dim=-1)
            for name, model_logits in logits.items():
                _score_rows(F.log_softmax(model_logits[rows], dim=-1), ref_logp, chosen, totals[name])


def _score_rows(logp: torch.Tensor, ref_logp: torch.Tensor | None, chosen: torch.Tensor, totals: dict) -> None:
    totals["nll"] += -logp.gather(-1, chosen).sum().item()
    if ref_logp is not None:
        totals["kl"] += F.kl_div(logp, ref_logp, log_target=True, reduction="sum").item()
        totals["agree"] += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        totals["ref_nll"] += -ref_logp.gather(-1, chosen).sum().item()
