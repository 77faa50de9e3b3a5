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
        raise SourceModelError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from e


def read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # a field the gguf package cannot decode is not one we use
            continue
    return meta


def load_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, dict[str, torch.Tensor]]:
    reader = _open(path)
    meta = read_metadata(reader)
    config = _config_from_metadata(meta, {t.name for t in reader.tensors})
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    return config, tokenizer, _tensors(reader, config)


def _config_from_metadata(meta: dict, tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; qkiln supports {', '.join(_ARCHS)}"
        )
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    num_heads = a("attention.head_count")
    hidden = a("embedding_length")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_ARCHS[arch],
        vocab_size=a("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=a("attention.head_count_kv", num_heads),
        head_dim=a("attention.key_length") or hidden // num_heads,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        max_position_embeddings=a("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
    )


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
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        try:
            name = _hf_name(t.name)
        except (KeyError, ValueError):
            raise UnsupportedArchitectureError(f"GGUF tensor {t.name!r} has no place in a {config.architecture} model")
        try:
            array = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise SourceModelError(f"GGUF tensor {t.name} could not be decoded ({e}); the file is corrupt") from e
        w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(tuple(reversed(t.shape.tolist())))
        if config.architecture in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif config.architecture in _PERMUTED_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        out[name] = w
    return out
