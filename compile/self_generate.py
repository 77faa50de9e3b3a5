"""Data-free calibration text: samples the source model generates itself (LLM-QAT, Liu et al.
2023, Sec. 2.1: a random first token, then sampling). Generated with qkiln's own engine and
cached on disk by (source sha256, count, length, seed), so rebuilds don't regenerate."""

import hashlib
import json
import random
from pathlib import Path

import torch

from qkiln.runtime.engine import EngineConfig, LLMEngine
from qkiln.runtime.sampling_params import SamplingParams
from qkiln.runtime.source import SourceModel

from .layer_cache import default_cache_dir, write_cache_file


def make_self_generator(source: SourceModel, seq_len: int, progress: bool = True, warn=None):
    """warn: says that the samples cannot be cached (default: print to stderr)."""
    def generate(num_samples: int, seed: int) -> list[str]:
        key = hashlib.sha256(json.dumps([source.sha256, num_samples, seq_len, seed, 1]).encode()).hexdigest()
        path = default_cache_dir().parent / "selfgen" / f"{key}.json"
        texts = _read_cached(path, num_samples)
        if texts is None:
            texts = _generate(source, num_samples, seq_len, seed, progress)
            # atomically: a build killed while writing had left a torn file that failed every later build
            write_cache_file(path, lambda tmp: tmp.write_text(json.dumps(texts), encoding="utf-8"), warn)
        return texts

    return generate


def _read_cached(path: Path, num_samples: int) -> list[str] | None:
    """The cached samples, or None where there are none whole (a torn or edited file: regenerated)."""
    try:
        texts = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(texts, list) and len(texts) == num_samples and all(isinstance(t, str) for t in texts):
        return texts
    return None


def _generate(source: SourceModel, num_samples: int, seq_len: int, seed: int, progress: bool) -> list[str]:
    from tqdm import tqdm

    model = source.build_model(torch.bfloat16)
    tok = source.tokenizer
    special = {i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None}
    rng = random.Random(seed)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_dtype="bf16",
                                                enable_prefix_caching=False))
    ids = []
    for i in range(num_samples):
        first = rng.randrange(source.config.vocab_size)
        while first in special:
            first = rng.randrange(source.config.vocab_size)
        params = SamplingParams(max_tokens=seq_len, temperature=1.0, top_p=0.95, seed=seed * 100003 + i,
                                ignore_eos=False)
        ids.append(engine.add_request([first], params))
    texts: dict[str, str] = {}
    with tqdm(total=num_samples * seq_len, desc="self-generate", unit="tok", disable=not progress) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                bar.update(1)
                if out.finished:  # a sample that ended at EOS: the tokens it will not take count as done
                    bar.update(seq_len - len(out.token_ids))
                    texts[out.request_id] = tok.decode([out.prompt_token_ids[0]] + out.token_ids)
    return [texts[i] for i in ids]
