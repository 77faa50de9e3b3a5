"""Read a llama.cpp GGUF file into a `ModelConfig`, a `Tokenizer` and fp32 HF-named tensors.

Tensors are dequantized with the `gguf` package. llama.cpp's converter permutes the rows of
the Q and K projections of Llama-type models (interleaved RoPE); we undo that so the weights
match the Hugging Face "rotate half" layout our model and every other tool use.
"""

from pathlib import Path

import numpy as np
import torch

from qkiln.errors import SourceModelError, UnsupportedArchitectureError

from .config import ModelConfig
from .tokenizer import Tokenizer

_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama.cpp permutes Q/K rows only for these (its convert script's `permute`).
_PERMUTED_ARCHS = ("llama", "mistral")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on corruption
        if "GGMLQuantizationType" in str(e):  # a type from a newer llama.cpp, not damage
            raise SourceModelError(f"{path} holds a tensor type this `gguf` package does not know ({e}): upgrade "
                                   "gguf (pip install -U gguf) or convert the model to another type") from e
        if "version" in str(e) and "cannot handle" in str(e):  # a newer file format, not damage
            raise SourceModelError(f"{path} is a GGUF of a newer format than this `gguf` package reads ({e}): "
                                   "upgrade gguf (pip install -U gguf), or convert the model with the "
                                   "llama.cpp this gguf comes from") from e
        raise SourceModelError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from e


def read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # a field the gguf package cannot decode is not one we use
            continue
    return meta


# llama.cpp writes a Llama 3.1+ model's RoPE scaling as this tensor of per-frequency divisors
ROPE_FREQS = "rope_freqs.weight"


def load_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, dict[str, torch.Tensor]]:
    reader = _open(path)
    meta = read_metadata(reader)
    if int(meta.get("split.count") or 1) > 1:
        raise SourceModelError(f"{path} is shard {int(meta.get('split.no', 0)) + 1} of {meta['split.count']} of a split "
                               "GGUF; merge the shards first (llama-gguf-split --merge FIRST_SHARD OUT.gguf)")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    config = _config_from_metadata(meta, {t.name for t in reader.tensors},
                                   None if freqs is None else _dequantized(freqs).reshape(-1).tolist())
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    return config, tokenizer, _tensors(reader, config)


def _config_from_metadata(meta: dict, tensor_names: set[str], rope_freqs: list[float] | None = None) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; qkiln supports {', '.join(_ARCHS)}"
        )
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    # llama.cpp refuses a file without any of these; a missing epsilon defaulted to 1e-6 here
    missing = [f"{arch}.{k}" for k in ("embedding_length", "attention.head_count", "block_count",
                                        "feed_forward_length", "attention.layer_norm_rms_epsilon") if a(k) is None]
    if missing or "tokenizer.ggml.tokens" not in meta:
        raise SourceModelError(f"GGUF metadata lacks {', '.join(missing or ['tokenizer.ggml.tokens'])}: the file is "
                               "incomplete; convert the model again (llama.cpp's convert_hf_to_gguf.py)")
    num_heads = a("attention.head_count")
    hidden = a("embedding_length")
    head_dim = a("attention.key_length") or hidden // num_heads
    rotary = a("rope.dimension_count")
    if rotary is not None and rotary != head_dim:  # llama.cpp refuses it for llama; qkiln rotates whole heads
        raise UnsupportedArchitectureError(f"{arch}.rope.dimension_count is {rotary}, not the head size {head_dim}: "
                                           "qkiln applies RoPE to every channel of a head (no partial rotary)")
    return ModelConfig(
        architecture=_ARCHS[arch],
        vocab_size=a("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=a("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(a, rope_freqs, a("rope.freq_base", 10000.0), head_dim),
        max_position_embeddings=a("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_end_of_generation_ids(meta),
        sampling_defaults=_sampling_defaults(meta),
    )


# general.sampling.* (what convert_hf_to_gguf.py records of a model's recommended sampling, and
# llama.cpp starts from) -> SamplingParams' fields. penalty_repeat is left out: llama.cpp applies it
# over the last penalty_last_n tokens, not over the prompt and output as repetition_penalty does.
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}


def _sampling_defaults(meta: dict) -> dict | None:
    found = {field: meta[f"general.sampling.{key}"] for key, field in _SAMPLING_KEYS.items()
             if isinstance(meta.get(f"general.sampling.{key}"), (int, float))}
    return {k: int(v) if k == "top_k" else float(v) for k, v in found.items()} or None


# Tokens llama.cpp ends generation at by their text, whatever the file's ids say (llama-vocab.cpp)
_END_TOKEN_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                              "<EOT>", "<|end_of_text|>"))


def _end_of_generation_ids(meta: dict) -> tuple[int, ...]:
    """What llama.cpp stops at: EOS, EOT and EOM ids, and the end-of-turn tokens named by text (a
    Llama 3 Instruct file's <|eom_id|>, a Qwen one's <|endoftext|> beside its EOS <|im_end|>)."""
    ids = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    named = [i for i, text in enumerate(meta["tokenizer.ggml.tokens"]) if text in _END_TOKEN_TEXTS]
    return tuple(dict.fromkeys(int(i) for i in [*ids, *named] if i is not None))


def _rope_scaling(a, rope_freqs: list[float] | None, theta: float, head_dim: int) -> dict | None:
    """HF's rope_scaling from `{arch}.rope.scaling.*` (linear, yarn, ...: rope.py refuses what it does
    not compute) or from the rope_freqs tensor (Llama 3.1+): these were ignored, a scaled model then
    computed unscaled RoPE without a word."""
    if rope_freqs is not None:
        return _llama3_from_factors(rope_freqs, theta, head_dim) or {"rope_type": "freq_factors",
                                                                     "factors": rope_freqs}
    kind = a("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(a("rope.scaling.factor", 1.0))}
    if a("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
    return scaling


def _llama3_from_factors(factors: list[float], theta: float, head_dim: int) -> dict | None:
    """The HF `llama3` rope_scaling that llama.cpp's converter turned into these divisors, when one of
    the published parameter sets reproduces them (Llama 3.1: factor 8, 3.2: 32; low 1, high 4,
    original context 8192), so the config stays one transformers and exports understand."""
    from .rope import base_inverse_frequencies, llama3_frequencies

    inv_freq = base_inverse_frequencies(theta, head_dim)
    target = torch.tensor(factors, dtype=torch.float32)
    if target.shape != inv_freq.shape:
        raise SourceModelError(f"GGUF tensor {ROPE_FREQS} has {target.numel()} factors for a head of {head_dim} "
                               f"(expected {inv_freq.numel()}); the file is inconsistent: convert the model again")
    for original in (8192, 4096, 16384, 32768, 131072):
        scaling = {"rope_type": "llama3", "factor": float(target.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        if torch.allclose(inv_freq / llama3_frequencies(inv_freq, scaling), target, rtol=1e-4):
            return scaling
    return None


def _dequantized(t) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:  # a known type the gguf package cannot decode: not damage
        raise SourceModelError(f"GGUF tensor {t.name} is of type {t.tensor_type.name}, which the gguf package "
                               f"cannot dequantize ({e}); convert the model to another type") from e
    except Exception as e:
        raise SourceModelError(f"GGUF tensor {t.name} could not be decoded ({e}); the file is corrupt") from e


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp stored rows as [head, rotary_pair_index, 2]; HF wants [head, 2, rotary_pair_index].
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # in the config's rope_scaling
            continue
        try:
            name = _hf_name(t.name)
        except (KeyError, ValueError):
            raise UnsupportedArchitectureError(f"GGUF tensor {t.name!r} has no place in a {config.architecture} model")
        w = torch.from_numpy(np.array(_dequantized(t), dtype=np.float32, copy=True)).reshape(tuple(reversed(t.shape.tolist())))
        if config.architecture in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif config.architecture in _PERMUTED_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        out[name] = w
    return out
