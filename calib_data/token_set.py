"""Seeded, fixed-length token batches for calibration, with a content hash for provenance.

`TokenSet.input_ids` is num_samples rows of seq_len token ids (plain ints: this package needs no
torch; the build makes its tensor). Sampling is deterministic in
(documents, tokenizer, num_samples, seq_len, seed); `sha256` covers the token ids exactly
(little-endian int64 bytes, row-major), so two builds that calibrated on the same tokens
record the same hash. Provenance also carries `text_sha256`, the source text's own hash
(`TextSource.sha256`), which names the data whatever path or tokenizer read it.
"""

import hashlib
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from qkiln.errors import CalibrationDataError

from .sources import TextSource, portable_spec


@dataclass(frozen=True)
class TokenSet:
    input_ids: tuple[tuple[int, ...], ...]  # [num_samples][seq_len]
    provenance: dict = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return token_sha256(self.input_ids)


def token_sha256(rows: Sequence[Sequence[int]]) -> str:
    """sha256 of the ids as little-endian int64, row after row (a tensor's bytes: `.tolist()` it)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(struct.pack(f"<{len(row)}q", *row))
    return digest.hexdigest()


def sample_token_set(source: TextSource, tokenizer, num_samples: int, seq_len: int, seed: int = 0) -> TokenSet:
    """Tokenize the documents as one stream and cut `num_samples` windows at seeded offsets, each
    after a BOS when the tokenizer adds one.

    Windows never straddle the stream's end. When the stream is shorter than
    num_samples * seq_len, windows overlap (still seeded); shorter than one window is an error.
    """
    if num_samples <= 0 or seq_len <= 1:
        raise CalibrationDataError(f"need num_samples > 0 and seq_len > 1, got {num_samples} and {seq_len}")
    stream: list[int] = []
    for doc in source.documents:
        stream.extend(tokenizer.encode(doc, add_special_tokens=False))
        if tokenizer.eos_token_id is not None and len(source.documents) > 1:
            stream.append(tokenizer.eos_token_id)  # document boundary, as pretraining packs them
    if len(stream) < seq_len:
        raise CalibrationDataError(
            f"{source.spec} has {len(stream)} tokens, fewer than one window of {seq_len}; use more text"
        )
    # A tokenizer that adds BOS puts one before every served prompt: each window starts with it too,
    # so calibration sees the activations of that position (llm-compressor's samples start so).
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos", False) else []
    span = seq_len - len(bos)
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(stream) - span + 1) for _ in range(num_samples)]
    ids = tuple(tuple(bos + stream[s : s + span]) for s in starts)
    provenance = {
        "source": portable_spec(source.spec),
        "num_samples": num_samples,
        "seq_len": seq_len,
        "seed": seed,
        "num_source_tokens": len(stream),
        "text_sha256": source.sha256,
        "token_sha256": token_sha256(ids),
    }
    return TokenSet(ids, provenance)
