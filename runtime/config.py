"""`ModelConfig`: the architecture description the lean model is built from.

Read from a Hugging Face `config.json`, from GGUF metadata, or from an artifact's manifest.
It must not hold weights or anything device-specific. Unknown architectures are refused
here, at the edge, with `UnsupportedArchitectureError`.
"""

import math
import numbers
import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from qkiln.errors import ArtifactError, QkilnError, SourceModelError, UnsupportedArchitectureError

# HF `architectures[0]` -> our family name. Qwen2 adds q/k/v bias, Qwen3 adds q/k RMSNorm.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
HF_ARCHITECTURE_NAME = {family: hf for hf, family in SUPPORTED_ARCHITECTURES.items()}
# The MLP computes SwiGLU: SiLU(gate) * up
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# generation_config.json's sampling values a request takes as defaults (vLLM's rule), each with
# transformers' GenerationConfig default: a value equal to it is not a model's recommendation
GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                       "max_new_tokens": None}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # family: llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # the sampling values the model's generation_config.json recommends (GENERATION_DEFAULTS' keys,
    # max_new_tokens named max_tokens), which requests that leave them out take, as in vLLM
    sampling_defaults: dict[str, Any] | None = None

    def __post_init__(self):
        """Types and ranges, whatever the config was read from: a value past one had allocated
        gigabytes (RoPE tables of max_position_embeddings rows) or looped for minutes (10^9 layers)
        before any tensor disagreed, or failed with a ZeroDivisionError traceback (probe s48)."""
        if self.architecture not in HF_ARCHITECTURE_NAME:
            raise UnsupportedArchitectureError(f"architecture {self.architecture!r} is not supported; qkiln supports "
                                               f"{', '.join(HF_ARCHITECTURE_NAME)}")
        for name, most in _SIZE_LIMITS.items():
            value = getattr(self, name)
            if not _whole(value) or not 1 <= value <= most:
                raise SourceModelError(f"the model config's {name} is {value!r}, not a whole number from 1 to {most}; "
                                       "the config is corrupt or not a model qkiln serves")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise SourceModelError(f"the model config's {name} is {value!r}, not a positive number")
        if self.head_dim % 2:
            raise SourceModelError(f"the model config's head_dim is {self.head_dim}: RoPE rotates pairs of channels, "
                                   "so it must be even")
        ids = (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,)))
        if not all(_whole(i) and i >= 0 for i in ids):
            raise SourceModelError(f"the model config's bos / eos token ids {list(ids)!r} are not token ids")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SourceModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; the config is inconsistent"
            )

    @property
    def hf_architecture(self) -> str:
        return HF_ARCHITECTURE_NAME[self.architecture]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "the manifest") -> "ModelConfig":
        """An artifact manifest's `architecture`; anything wrong in it is an ArtifactError."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        try:
            kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids", ()))
            return cls(**kwargs)
        except (QkilnError, TypeError) as e:  # TypeError: a field missing, or eos_token_ids not a list
            raise ArtifactError(f"{where}'s architecture: {e}; the artifact is corrupt, rebuild it") from None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """generation_config: the checkpoint's generation_config.json, whose eos_token_id may name
        more stop tokens than config.json's (Llama 3 Instruct's <|eot_id|>), as transformers and
        vLLM read it."""
        archs = hf.get("architectures") or []
        if isinstance(archs, str):  # a list of one, written by hand: read as transformers would read the list
            archs = [archs]
        if archs:
            family = SUPPORTED_ARCHITECTURES.get(archs[0])
        else:  # transformers picks the class by model_type then
            family = hf.get("model_type") if hf.get("model_type") in HF_ARCHITECTURE_NAME else None
        if family is None:
            raise UnsupportedArchitectureError(
                f"architecture {archs or hf.get('model_type')!r} is not supported; qkiln supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (convert the model or open an issue)"
            )
        _check_computed_as_declared(hf, family)
        num_heads = hf["num_attention_heads"]
        eos_ids = tuple(dict.fromkeys(_ids(hf.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))))
        rope_scaling = hf.get("rope_scaling")
        # transformers 5 moves theta into `rope_parameters`, and reads it there first when a config
        # has both (a top-level one that differs had given other logits from the first token)
        params = hf.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise SourceModelError(f"config.json's rope_parameters is {type(params).__name__}, not an object; fix it")
        rope_theta = params.get("rope_theta", hf.get("rope_theta"))
        if rope_theta is None:
            rope_theta = 10000.0
        if rope_scaling is None and params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise SourceModelError(f"config.json's rope scaling is {type(rope_scaling).__name__}, not an object; fix it")
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        _check_rope_scaling(rope_scaling)
        window = _sliding_window(hf, family)
        context = hf.get("max_position_embeddings", 4096)
        if not isinstance(context, int) or isinstance(context, bool) or context < 1:
            raise SourceModelError(f"config.json's max_position_embeddings is {context!r}, not a whole number of "
                                   "tokens; fix it")
        if window is not None and window < context:
            # qkiln attends to the whole context; within the window the two are the same attention
            warnings.warn(f"this model attends through a sliding window of {window} tokens, which qkiln does not "
                          f"implement: its context is capped at {window} tokens (from {context})", stacklevel=2)
            context = window
        return cls(
            architecture=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=_positive(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=_positive(rope_theta, "rope_theta"),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sampling_defaults=_sampling_defaults(generation_config or {}),
        )


# Upper bounds well past any model qkiln serves (Llama 3.1 405B: hidden 16384, intermediate 53248,
# 126 layers; vocabularies up to 262k; Llama 4 Scout: 10M positions).
_SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
                "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
                "head_dim": 1024, "max_position_embeddings": 1 << 24}


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def artifact_config(root, manifest) -> ModelConfig:
    """An artifact's ModelConfig, its manifest's architecture checked against the weights' shard
    headers (no tensor read): what the loader and `qkiln verify` refuse before anything is
    allocated. The digest has no key, so hashes alone pass an edited, restamped manifest."""
    from qkiln.compile.artifact import MANIFEST_NAME, read_tensor_index  # no torch

    config = ModelConfig.from_dict(manifest.architecture, where=str(Path(root) / MANIFEST_NAME))
    check_against_tensors(config, {n: t.shape for n, t in read_tensor_index(root, manifest).items()}, str(root))
    return config


def check_against_tensors(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """An artifact's config against its stored tensors (names -> shapes, from the shard headers),
    before anything is allocated for it: its layer count and its embedding's shape."""
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER_TENSOR.match(name))}
    if layers != set(range(config.num_hidden_layers)):
        raise ArtifactError(f"{where}: the manifest says {config.num_hidden_layers} layers, the weights hold "
                            f"{len(layers)}; the artifact is corrupt, rebuild it")
    embedding = shapes.get("model.embed_tokens.weight")
    if embedding is not None and tuple(embedding) != (config.vocab_size, config.hidden_size):
        raise ArtifactError(f"{where}: the embedding is {list(embedding)}, the manifest says vocab_size "
                            f"{config.vocab_size} x hidden_size {config.hidden_size}; the artifact is corrupt, "
                            "rebuild it")


def _sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any] | None:
    """What vLLM reads of generation_config.json (GenerationConfig.to_diff_dict): the sampling values
    set to something other than transformers' defaults, numbers only. None when there are none."""
    found = {("max_tokens" if key == "max_new_tokens" else key): generation_config[key]
             for key, default in GENERATION_DEFAULTS.items()
             if isinstance(generation_config.get(key), (int, float)) and not isinstance(generation_config[key], bool)
             and generation_config[key] != default}
    return found or None


def _ids(value) -> tuple[int, ...]:
    """config.json's eos_token_id: one id, a list of them, or null."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


# what each rope scaling qkiln computes reads (runtime/rope.py)
_ROPE_SCALING_FIELDS = {"linear": ("factor",),
                        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _positive(value, name: str) -> float:
    """A config.json number (a float or an int): a null or a string had failed at load or at the
    first forward with a TypeError / ValueError traceback."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SourceModelError(f"config.json's {name} is {value!r}, not a positive number; fix it")
    return float(value)


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    for name in _ROPE_SCALING_FIELDS.get(kind, ()):
        if name not in scaling:  # transformers refuses it too
            raise SourceModelError(f"config.json's {kind} rope scaling lacks {name}; fix it")
        _positive(scaling[name], f"rope scaling {name}")


def _check_computed_as_declared(hf: dict[str, Any], family: str) -> None:
    """Refuse what the lean model would compute differently from the checkpoint's config (it
    would load and answer wrongly): another activation, biases qkiln's layers do not hold."""
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported: qkiln's MLP computes SiLU(gate) * up "
                                           "(SwiGLU), as Llama, Mistral and Qwen do")
    # Qwen2's attention has q/k/v biases (qkiln holds them); Llama's and Qwen3's attention_bias
    # puts one on o_proj too
    if hf.get("attention_bias") and family in ("llama", "mistral", "qwen3"):
        raise UnsupportedArchitectureError(f"attention_bias: a {family} model with attention_bias has an o_proj bias, "
                                           "which qkiln's attention does not hold (only q/k/v biases, as Qwen2's)")
    if hf.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias: qkiln's MLP holds no biases")


def _sliding_window(hf: dict[str, Any], family: str) -> int | None:
    """The window some layer attends through, as transformers reads the config: every Mistral
    layer; a Qwen layer when use_sliding_window and it is past max_window_layers (or layer_types
    says so). The context is then capped at it, within which every layer attends alike."""
    window = hf.get("sliding_window")
    if family == "mistral":
        return window if hf.get("use_sliding_window", True) else None
    if window is None or family not in ("qwen2", "qwen3") or not hf.get("use_sliding_window", False):
        return None
    layer_types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                            else "full_attention" for i in range(hf["num_hidden_layers"])]
    return window if "sliding_attention" in layer_types else None
