"""Content-addressed build cache: one entry per quantized decoder layer.

Key = sha256 over (source weights sha256, weight/activation scheme + algorithm options + ignore
list, calibration token sha256, layer index, cache format). Sequential calibration makes layer
i depend on layers < i, and those are fixed by the same inputs, so the key is complete. The KV
scheme, target and evaluation are *not* in the key: changing them reuses every layer.
Entries are safetensors files written atomically (temp file + rename); a corrupt entry is a
miss, never an error.
"""

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("QKILN_CACHE_DIR", Path.home() / ".cache" / "qkiln")) / "layers"


def layer_key(source_sha256: str, scheme_dict: dict, token_sha256: str | None, layer_id: int) -> str:
    payload = json.dumps({"source": source_sha256, "scheme": scheme_dict, "tokens": token_sha256,
                          "layer": layer_id, "format": CACHE_FORMAT}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


class LayerCache:
    def __init__(self, directory: Path | None):
        self.directory = directory
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.safetensors"
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                meta = json.loads(f.metadata()["report"])
            tensors = load_file(str(path))
        except Exception:  # missing or corrupt: recompute
            self.num_misses += 1
            return None
        self.num_hits += 1
        return tensors, meta

    def put(self, key: str, tensors: dict[str, torch.Tensor], report: dict) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"report": json.dumps(report, sort_keys=True)})
        os.replace(tmp, self.directory / f"{key}.safetensors")
