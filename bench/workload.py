"""Benchmark workloads: the prompts (as token ids) and output lengths every benchmark runs.

Owns how a workload is made from a length spec, so qkiln and every baseline see the *same*
token ids: fixed lengths (`128`), a uniform integer range (`64:256`), or a JSONL of real prompts
(one object per line with "prompt" text or "prompt_token_ids", optional "output_len"); plus an
optional shared prefix of random tokens put before every prompt (prefix-caching runs; the
prompt is then prefix + body, as vLLM's random dataset does).

Random prompts draw ids uniformly from the tokenizer's vocabulary minus its special/added tokens,
so no prompt contains BOS/EOS or chat markers; outputs get exact lengths because every
benchmark asks for them with `ignore_eos`. Everything is seeded: same arguments, same ids.
Must not import transformers or run a model.
"""

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from qkiln.errors import QkilnError


class BenchConfigError(QkilnError):
    """A benchmark option is malformed (length spec, SLO, JSONL file, sizes)."""


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    description: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def lengths_label(self) -> str:
        """"in 128 / out 128" for tables; a shared prefix is counted in: "in 512+128"."""
        d = self.description
        prefix = f"{d['shared_prefix_len']}+" if d.get("shared_prefix_len") else ""
        return f"in {prefix}{d.get('input_len')} / out {d.get('output_len')}"


def parse_length(spec: str | int, what: str) -> tuple[int, int]:
    """`128` -> (128, 128); `64:256` -> (64, 256), a uniform integer range (both ends included)."""
    text = str(spec).strip()
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 1 or hi < lo:
        raise BenchConfigError(f"{what} must be a positive length like 128 or a range like 64:256, got {spec!r}")
    return lo, hi


def check_at_least(minimum: int, **options) -> None:
    """Refuse an option below `minimum`, naming it as the command line spells it."""
    for name, value in options.items():
        if value is None or value < minimum:
            raise BenchConfigError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def sampleable_token_ids(tokenizer, model_vocab_size: int | None = None) -> list[int]:
    """Token ids a random prompt may use: the vocabulary without special/added tokens."""
    added = set(tokenizer.backend.get_added_tokens_decoder())
    size = tokenizer.vocab_size if model_vocab_size is None else min(tokenizer.vocab_size, model_vocab_size)
    ids = [i for i in range(size) if i not in added]
    if not ids:
        raise BenchConfigError("the tokenizer has no ordinary (non-special) tokens to build prompts from")
    return ids


def make_workload(tokenizer, num_requests: int, input_len: str | int = 128, output_len: str | int = 128, *,
                  prompts_jsonl: str | Path | None = None, shared_prefix_len: int = 0, seed: int = 0,
                  model_vocab_size: int | None = None) -> Workload:
    """`num_requests` prompts and output lengths, reproducible from `seed`."""
    if num_requests < 1:
        raise BenchConfigError(f"num_requests must be >= 1, got {num_requests}")
    if shared_prefix_len < 0:
        raise BenchConfigError(f"shared_prefix_len must be >= 0, got {shared_prefix_len}")
    rng = random.Random(seed)
    vocab = sampleable_token_ids(tokenizer, model_vocab_size)
    prefix = [rng.choice(vocab) for _ in range(shared_prefix_len)]
    out_lo, out_hi = parse_length(output_len, "output_len")
    if prompts_jsonl is not None:
        bodies, fixed_outs = _jsonl_prompts(Path(prompts_jsonl), tokenizer, num_requests, rng)
        in_desc = f"jsonl:{prompts_jsonl}"
    else:
        in_lo, in_hi = parse_length(input_len, "input_len")
        bodies = [[rng.choice(vocab) for _ in range(rng.randint(in_lo, in_hi))] for _ in range(num_requests)]
        fixed_outs = [None] * num_requests
        in_desc = str(input_len)
    outs = [n if n is not None else rng.randint(out_lo, out_hi) for n in fixed_outs]
    # a record's own output length overrides --output-len: say what ran
    out_desc = str(output_len) if all(n is None for n in fixed_outs) else f"{min(outs)}:{max(outs)} (from the file)"
    description = {"num_requests": num_requests, "input_len": in_desc, "output_len": out_desc,
                   "shared_prefix_len": shared_prefix_len, "seed": seed}
    return Workload([prefix + b for b in bodies], outs, description)


def _jsonl_prompts(path: Path, tokenizer, num_requests: int, rng: random.Random):
    """Sample `num_requests` records (shuffled; cycled when the file has fewer) -> (ids, output lens)."""
    if not path.is_file():
        raise BenchConfigError(f"prompt file {path} does not exist; give a JSONL with one {{\"prompt\": ...}} per line")
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchConfigError(f"{path}:{lineno} is not JSON ({e}); one object per line") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt_token_ids"), list):
            ids = [int(t) for t in rec["prompt_token_ids"]]
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            ids = tokenizer.encode(rec["prompt"])
        else:
            raise BenchConfigError(f"{path}:{lineno} needs a \"prompt\" string or \"prompt_token_ids\" list")
        out = rec.get("output_len", rec.get("max_tokens"))
        if ids:
            records.append((ids, int(out) if out is not None else None))
    if not records:
        raise BenchConfigError(f"{path} holds no non-empty prompts")
    order = list(range(len(records)))
    rng.shuffle(order)
    picked = [records[order[i % len(order)]] for i in range(num_requests)]
    return [p for p, _ in picked], [o for _, o in picked]


def load_tokenizer(model: str):
    """The served model's tokenizer without loading its weights where the layout allows (an
    artifact archive is unpacked and verified for it, as every command takes one)."""
    from qkiln.compile.artifact import is_artifact_dir
    from qkiln.compile.artifact_cli import unpacked
    from qkiln.runtime.source import load_source, resolve_source
    from qkiln.runtime.tokenizer import Tokenizer

    with unpacked(model) as unpacked_path:
        if is_artifact_dir(Path(unpacked_path)):
            return Tokenizer.from_dir(Path(unpacked_path) / "tokenizer")
    path = resolve_source(model)
    return Tokenizer.from_dir(path) if path.is_dir() else load_source(path).tokenizer
