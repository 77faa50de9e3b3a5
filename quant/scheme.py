"""Quantization schemes: what a recipe asks for, as small frozen dataclasses.

Owns `WeightScheme`, `ActivationScheme`, `KVCacheScheme`, the algorithm options (`GPTQOptions`,
`AWQOptions`) and `QuantScheme`, which ties them to an `ignore` list and an algorithm. It owns
no tensors and runs no algorithm.

Invariants:
- A scheme that exists is well formed: every field-level check runs in `__post_init__` and raises
  `RecipeError` saying what to change. Checks that need the model (`validate`) name the layers.
- Group sizes that do not divide `in_features` are legal: the last group of a row is shorter
  (SmolLM2 has in_features 576 with group 128 -> groups 128,128,128,128,64).
- `to_dict()` gives plain JSON types; `from_dict(to_dict(s)) == s`.

Grid conventions the algorithms share (see `quant/rtn.py`): integer codes `q`, fp32 `scale`, and
`w_hat = (q - zero) * scale`. Symmetric: q in [-2^(b-1), 2^(b-1)-1], zero 0,
scale = amax / ((qmax - qmin) / 2) (compressed-tensors' convention). Asymmetric: q in [0, 2^b - 1];
`zero_point="int"` rounds the zero to an integer and widens the range to include 0 (GPTQ / AWQ /
compressed-tensors layouts); `zero_point="float"` keeps an exact fp32 zero, i.e. w_hat = q*scale+min
(GGUF Q4_1 / tinygemm style).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from qkiln.errors import RecipeError

SCALE_DTYPES = ("float32", "float16", "bfloat16")


def _fail(message: str) -> None:
    raise RecipeError(message)


_SIMPLE_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "int | None": (int, type(None))}
_TYPE_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
               "int | None": "a whole number or null"}
# where each class sits in a recipe, so an error names the field as the file spells it (an
# lm_head's WeightScheme is relabelled by QuantScheme.from_dict)
_SECTIONS = {"WeightScheme": "weights", "ActivationScheme": "activations", "KVCacheScheme": "kv_cache",
             "GPTQOptions": "gptq", "AWQOptions": "awq", "QuantScheme": "scheme"}


def _pattern_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _check_field_types(obj) -> None:
    """Recipes come from YAML / JSON: refuse "true" for a bool or "0.01" for a float up front."""
    for f in dataclasses.fields(obj):
        allowed = _SIMPLE_TYPES.get(f.type)
        value = getattr(obj, f.name)
        if allowed is None:
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            name = type(obj).__name__
            _fail(f"{_SECTIONS.get(name, name)}.{f.name} must be {_TYPE_WORDS[f.type]}, got {value!r}")


@dataclass(frozen=True)
class WeightScheme:
    """Weight quantization. type "float" means FP8 e4m3 with per-channel (or per-group) scales."""

    num_bits: int = 4
    type: str = "int"
    symmetric: bool = True
    group_size: int | None = 128  # None: one group per output channel
    zero_point: str = "int"  # asymmetric only: "int" (interoperable layouts) or "float" (exact min)
    scale_dtype: str = "float32"  # scales are rounded *up* to this dtype before codes are chosen
    observer: str = "minmax"  # int only: "minmax" range, or "mse" (shrink the range to minimise error)

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.type not in ("int", "float"):
            _fail(f"weights.type must be 'int' or 'float' (fp8 e4m3), got {self.type!r}")
        if self.type == "int" and self.num_bits not in (4, 8):
            _fail(f"integer weights must have num_bits 4 or 8, got {self.num_bits}")
        if self.type == "float" and self.num_bits != 8:
            _fail(f"float weights are fp8 e4m3: set num_bits 8, got {self.num_bits}")
        if self.type == "float" and not self.symmetric:
            _fail("fp8 weights are symmetric (scale only): set symmetric true")
        if self.group_size is not None and self.group_size < 1:
            _fail(f"weights.group_size must be a positive integer or null (per channel), got {self.group_size!r}")
        if self.zero_point not in ("int", "float"):
            _fail(f"weights.zero_point must be 'int' or 'float', got {self.zero_point!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            _fail(f"weights.scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.observer not in ("minmax", "mse") or (self.type == "float" and self.observer != "minmax"):
            _fail(f"weights.observer must be 'minmax' or (integer weights only) 'mse', got {self.observer!r}")


@dataclass(frozen=True)
class ActivationScheme:
    """FP8 e4m3 activations: dynamic per-token scales, or one static per-tensor scale from calibration."""

    type: str = "float"
    num_bits: int = 8
    dynamic: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.type != "float" or self.num_bits != 8:
            _fail(f"activations support fp8 only (type 'float', num_bits 8), got {self.type} {self.num_bits}")


# Channels of an int4 KV group: what builds calibrate and README's accuracy table measured, and what a
# serve-time `--kv-dtype int4` (no KV scheme in the artifact) uses too
KV_INT4_GROUP_SIZE = 16


@dataclass(frozen=True)
class KVCacheScheme:
    """KV cache quantization (math and measured defaults in `quant/kv.py`).

    int4: asymmetric, per token and head, `group_size` channels along head_dim per group.
    fp8: e4m3 with a calibrated scale per KV head.
    key_smoothing: divide K by a static per-(head, channel) scale amax^alpha from calibration
    before quantizing (SmoothQuant-style; the per-channel key outliers of KIVI and KVQuant).
    key_offset: subtract a static per-(head, channel) calibration mean of K before quantizing and
    never add it back (it shifts every score of a query alike; softmax ignores that).
    """

    dtype: str = "int4"
    group_size: int = KV_INT4_GROUP_SIZE  # int4 only; must divide head_dim
    key_smoothing: bool = False
    key_smoothing_alpha: float = 0.5
    key_offset: bool = False
    # int4 per-token scale / min storage: the paged cache (plugins/kv_cache.py) holds them in fp16, so a
    # build refuses anything else (validate); older manifests that recorded float32 still load
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.dtype not in ("int4", "fp8"):
            _fail(f"kv_cache.dtype must be 'int4' or 'fp8', got {self.dtype!r}")
        if self.group_size < 2 or self.group_size % 2:
            _fail(f"kv_cache.group_size must be an even integer >= 2 (e.g. 64, 32, 16), got {self.group_size!r}")
        if not 0.0 <= self.key_smoothing_alpha <= 1.0:
            _fail(f"kv_cache.key_smoothing_alpha must be in [0, 1], got {self.key_smoothing_alpha}")
        if self.scale_dtype not in SCALE_DTYPES:
            _fail(f"kv_cache.scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        """As manifests record it: an fp8 cache has no groups, so int4's group fields are left out
        (from_dict fills their defaults back in, and older manifests that list them still load)."""
        d = dataclasses.asdict(self)
        if self.dtype != "int4":
            del d["group_size"], d["scale_dtype"]
        return d

    def check_head_dim(self, head_dim: int) -> None:
        if self.dtype == "int4" and head_dim % self.group_size:
            _fail(f"kv_cache.group_size {self.group_size} does not divide head_dim {head_dim}: pick a divisor")


@dataclass(frozen=True)
class GPTQOptions:
    """GPTQ (Frantar et al. 2022) knobs; defaults follow the paper's reference code, except act_order.

    Measured on SmolLM2-135M, W4 asymmetric g128, layer-by-layer calibration on 32 x 512 tokens of
    wikitext-2 valid, 6 x 512 tokens of wiki.test.raw: share of RTN's perplexity gap closed was
    2% without act_order, 35% with it (32% symmetric), 52% adding weights.observer "mse"
    (which alone makes RTN worse: +42.8% vs +35.9%). dampening_frac 0.1 was worse (26%).
    """

    dampening_frac: float = 0.01  # lambda = dampening_frac * mean(diag(H)), Sec. 4 "Cholesky Reformulation"
    block_size: int = 128  # lazy batch updates, Sec. 4 "Lazy Batch-Updates"
    act_order: bool = True  # columns by decreasing diag(H) (the reference code's "act-order")
    static_groups: bool = True  # group params from the original column order (needed with act_order)
    max_damp_retries: int = 3  # x10 dampening per Cholesky failure, then fall back to RTN
    # The reference code's --true-sequential: within a decoder layer, q/k/v, then o, then gate/up, then
    # down are each calibrated on inputs computed through the groups already quantized before them.
    # SmolLM2 W4 g128, default calibration, wiki.test 16384 tokens: RTN's gap closed 44% -> 47%.
    true_sequential: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)
        if not 0 < self.dampening_frac < math.inf:
            _fail(f"gptq.dampening_frac must be a finite number > 0, got {self.dampening_frac}")
        if self.block_size < 1:
            _fail(f"gptq.block_size must be a positive integer, got {self.block_size!r}")
        if self.act_order and not self.static_groups:
            _fail("gptq.act_order needs static_groups: true (dynamic groups would need a g_idx in every kernel)")
        if self.max_damp_retries < 0:
            _fail(f"gptq.max_damp_retries must be >= 0, got {self.max_damp_retries!r}")


@dataclass(frozen=True)
class AWQOptions:
    """AWQ (Lin et al. 2023) knobs: scale grid (Sec. 3.2) and weight-clipping grid.

    Measured on SmolLM2-135M, W4 asym g128, 32 x 512 wikitext-2 valid, 4096 wiki.test.raw tokens,
    share of RTN's perplexity gap closed: the paper's recipe (these defaults) 37%; fp_inputs 33%;
    scale_o_proj 35%; weights.observer "mse" on the clipped weights 7% (it clips twice);
    quantizer "gptq" with weights.observer "mse" (the w4a16-awq preset) 58%.
    """

    grid_size: int = 20  # alphas 0, 1/grid, ..., (grid-1)/grid
    duo_scaling: bool = True  # s = x_mean^a / w_mean^(1-a) (AutoAWQ) instead of x_mean^a
    clip: bool = True
    clip_grid_size: int = 20
    clip_max_shrink: float = 0.5
    # Score scales on the block's output (attention / MLP), AutoAWQ's module2inspect, on the first
    # `loss_samples` calibration sequences. Off by default: on SmolLM2 (W4 asym g128, 32 x 512
    # wikitext-2 valid, 4096 test tokens) it closed 34% of RTN's gap vs 37% for the linears' own
    # output over every token, at 3x the calibration time.
    module_loss: bool = False
    loss_samples: int = 8
    # Take each layer's statistics from the unquantized model's activations (AutoAWQ and
    # llm-compressor do) instead of from the already-quantized earlier layers.
    fp_inputs: bool = False
    # What quantizes the scaled (and clipped) weights: "rtn" (the paper) or "gptq" (the options in
    # QuantScheme.gptq, on the Hessian of the scaled inputs): AWQ then GPTQ, an explicit combination.
    quantizer: str = "rtn"
    # Also scale o_proj's input by folding 1/s into v_proj's rows (AutoAWQ's v->o pair; with GQA the
    # query heads reading one KV head share its scale), and clip o_proj.
    scale_o_proj: bool = False
    # Range observer inside the scale and clip searches (weights.observer still quantizes the result):
    # "minmax" keeps the searches ~20x cheaper than "mse" (which tries 21 ranges per candidate).
    search_observer: str = "minmax"

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.loss_samples < 1:
            _fail(f"awq.loss_samples must be a positive integer, got {self.loss_samples!r}")
        if self.grid_size < 1:
            _fail(f"awq.grid_size must be a positive integer, got {self.grid_size!r}")
        if self.search_observer not in ("minmax", "mse"):
            _fail(f"awq.search_observer must be 'minmax' or 'mse', got {self.search_observer!r}")
        if self.quantizer not in ("rtn", "gptq"):
            _fail(f"awq.quantizer must be 'rtn' or 'gptq', got {self.quantizer!r}")
        if self.clip_grid_size < 1:
            _fail(f"awq.clip_grid_size must be a positive integer, got {self.clip_grid_size!r}")
        if not 0.0 <= self.clip_max_shrink < 1.0:
            _fail(f"awq.clip_max_shrink must be in [0, 1), got {self.clip_max_shrink}")


_SUBSCHEMES = {"weights": WeightScheme, "activations": ActivationScheme, "kv_cache": KVCacheScheme,
               "lm_head": WeightScheme, "gptq": GPTQOptions, "awq": AWQOptions}


@dataclass(frozen=True)
class QuantScheme:
    """A whole recipe's quantization: what to quantize, how, and what to leave alone.

    `ignore` entries match a layer name exactly, as a dotted suffix ("lm_head" matches
    "model.lm_head"), or as a regular expression with the prefix "re:" (compressed-tensors style).
    Decoder layers may be counted from the end, Python style, so a recipe fits any depth:
    "re:model\\.layers\\.-1\\.mlp\\." matches every MLP linear of the last layer (the name is also
    tried with its layer index i rewritten as i - num_layers, when the caller gives num_layers).
    """

    weights: WeightScheme | None = None
    activations: ActivationScheme | None = None
    kv_cache: KVCacheScheme | None = None
    ignore: tuple[str, ...] = ("lm_head",)
    # The output projection's own scheme (integer, round-to-nearest), applied even when the head is
    # tied to the embeddings (a quantized copy; lookups stay exact) and whatever `ignore` says.
    # It is the largest single GEMV of a small model's decode step (SmolLM2: 28M of 135M weights).
    lm_head: WeightScheme | None = None
    algorithm: str = "rtn"
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    awq: AWQOptions = field(default_factory=AWQOptions)

    def __post_init__(self) -> None:
        _check_field_types(self)
        for key, sub_cls in _SUBSCHEMES.items():
            value = getattr(self, key)
            if not isinstance(value, sub_cls) and not (value is None and key not in ("gptq", "awq")):
                _fail(f"{key} must be a {sub_cls.__name__}{'' if key in ('gptq', 'awq') else ' or null'}, "
                      f"got {type(value).__name__} (use QuantScheme.from_dict for plain mappings)")
        if not isinstance(self.ignore, (list, tuple)) or not all(isinstance(p, str) for p in self.ignore):
            _fail(f"ignore must be a list of layer names or 're:' patterns, got {self.ignore!r}")
        object.__setattr__(self, "ignore", tuple(self.ignore))
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    _fail(f"ignore pattern {pattern!r} is not a valid regular expression: {exc}")
        if self.algorithm not in ("rtn", "gptq", "awq"):
            _fail(f"algorithm must be 'rtn', 'gptq' or 'awq', got {self.algorithm!r}")
        if self.algorithm == "awq" and (self.weights is None or self.weights.type != "int"):
            _fail("algorithm 'awq' quantizes integer weights: use algorithm 'rtn' or 'gptq' for fp8 "
                  "or add an integer weights scheme")
        if self.algorithm == "gptq" and self.weights is None:
            _fail("algorithm 'gptq' quantizes weights: add a weights scheme")
        if self.activations is not None and (self.weights is None or self.weights.type != "float"):
            _fail("activation quantization is implemented for FP8 W8A8 only: set weights.type 'float'")
        if self.weights is not None and self.weights.type == "float" and self.activations is None:
            _fail("fp8 weights run as FP8 W8A8: add activations (type float, num_bits 8, dynamic true), "
                  "or use integer weights (num_bits 8, type int: w8a16) for weight-only 8-bit")
        if self.lm_head is not None and self.lm_head.type != "int":
            _fail("lm_head supports integer weights (int8 per channel, int4 grouped): set lm_head.type 'int'")
        if self.weights is None and self.activations is None and self.kv_cache is None and self.lm_head is None:
            _fail("the scheme quantizes nothing: set weights, activations or kv_cache")

    def is_ignored(self, name: str, num_layers: int | None = None) -> bool:
        """Whether `name` stays in high precision; `num_layers` enables layer indices from the end."""
        names = [name]
        found = _LAYER_INDEX.search(name) if num_layers is not None else None
        if found:
            from_end = int(found.group(2)) - num_layers
            names.append(f"{name[:found.start()]}{found.group(1)}{from_end}.{name[found.end():]}")
        return any(_pattern_matches(pattern, candidate) for candidate in names for pattern in self.ignore)

    def targets(self, names) -> list[str]:
        """The layer names this scheme quantizes, in the given order."""
        names = list(names)
        num_layers = count_layers(names)
        return [name for name in names if not self.is_ignored(name, num_layers)]

    def validate(self, linear_shapes: dict[str, tuple[int, int]], head_dim: int | None = None) -> None:
        """Check the scheme against the model's linears ({name: (out_features, in_features)}).

        Raises RecipeError naming every offending layer, before any calibration starts.
        """
        if self.kv_cache is not None and head_dim is not None:
            self.kv_cache.check_head_dim(head_dim)
        if self.kv_cache is not None and self.kv_cache.dtype == "int4" and self.kv_cache.scale_dtype != "float16":
            _fail(f"kv_cache.scale_dtype {self.kv_cache.scale_dtype!r}: the paged KV cache stores int4 scales in "
                  "float16; set float16 (or leave it out)")
        if self.weights is None:
            return
        self._check_ignore(list(linear_shapes))
        static = self.activations is not None and not self.activations.dynamic
        if static and "lm_head" in self.targets(linear_shapes):
            # the served head would need an input_scale no calibration pass measures: the artifact
            # was written, verified, and then refused by every loader
            _fail("static activation scales are calibrated for the decoder layers' linears only, not lm_head: "
                  "keep lm_head in ignore (as the presets do) or use dynamic activations (activations.dynamic: true)")
        problems: dict[str, list[str]] = {}
        for name in self.targets(linear_shapes):
            out_features, in_features = linear_shapes[name]
            for problem in self._layer_problems(out_features, in_features):
                problems.setdefault(problem, []).append(name)
        if problems:
            lines = [f"{problem}: {', '.join(names)}" for problem, names in problems.items()]
            _fail("the scheme does not fit these layers (fix the scheme or add them to ignore):\n  "
                  + "\n  ".join(lines))

    def _check_ignore(self, names: list[str]) -> None:
        """An entry that names no linear is a typo that would quantize what it meant to keep (one that
        names the head, as "lm_head" in every preset or llm-compressor's "re:.*lm_head", is exempt: a
        tied head is no linear); ignoring everything is no recipe."""
        if not names:
            return
        single = {p: dataclasses.replace(self, ignore=(p,)) for p in self.ignore if not _pattern_matches(p, "lm_head")}
        unmatched = [p for p, one in single.items() if len(one.targets(names)) == len(names)]
        if unmatched:
            _fail(f"ignore entries {unmatched} match no linear of this model (e.g. {names[0]!r}); "
                  "fix or remove them")
        if not self.targets(names):
            _fail("the ignore list leaves no linear to quantize; narrow it")

    def _layer_problems(self, out_features: int, in_features: int) -> list[str]:
        w = self.weights
        found = []
        if out_features < 1 or in_features < 1:
            found.append("empty weight")
        if w.type == "int" and w.num_bits == 4 and in_features % 2:
            found.append("odd in_features cannot be packed two 4-bit codes per byte")
        if w.type == "float" and (in_features % 16 or out_features % 16):
            found.append("fp8 GEMMs need in_features and out_features divisible by 16")
        return found

    @property
    def needs_weight_calibration(self) -> bool:
        """Whether quantizing the linears reads calibration activations (GPTQ's Hessians, AWQ's
        scales, static activation scales); round-to-nearest weights and dynamic scales do not."""
        return self.algorithm != "rtn" or (self.activations is not None and not self.activations.dynamic)

    def to_dict(self) -> dict[str, Any]:
        kv_cache = None if self.kv_cache is None else self.kv_cache.to_dict()
        return dataclasses.asdict(self) | {"ignore": list(self.ignore), "kv_cache": kv_cache}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantScheme":
        if not isinstance(data, dict):
            _fail(f"a quantization scheme must be a mapping, got {type(data).__name__}")
        _check_keys(cls, data, "scheme")
        kwargs = dict(data)
        for key, sub_cls in _SUBSCHEMES.items():
            value = kwargs.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                _fail(f"{key} must be a mapping, got {type(value).__name__}")
            _check_keys(sub_cls, value, key)
            try:
                kwargs[key] = sub_cls(**value)
            except RecipeError as e:
                if key != "lm_head":
                    raise
                raise RecipeError(str(e).replace("weights.", "lm_head.").replace("integer weights", "an integer "
                                                                                  "lm_head")) from None
        algorithm = kwargs.get("algorithm", "rtn")
        for key in ("gptq", "awq"):  # a manifest lists both at their defaults, which read back as they are
            if data.get(key) is not None and kwargs[key] != _SUBSCHEMES[key]() and algorithm != key:
                _fail(f"{key} options are given but algorithm is {algorithm!r}, so they would not apply: set "
                      f"algorithm: {key}, or remove the {key} section")
        return cls(**kwargs)


_LAYER_INDEX = re.compile(r"((?:^|\.)layers\.)(\d+)\.")  # group 1: "...layers.", group 2: the index


def count_layers(names) -> int | None:
    """Number of decoder layers named in `names` ("...layers.{i}..."), None if none is."""
    indices = [int(m.group(2)) for m in map(_LAYER_INDEX.search, names) if m]
    return max(indices) + 1 if indices else None


def _check_keys(cls, data: dict, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(data) - known))
    if unknown:
        _fail(f"unknown {where} field(s) {unknown}; known fields: {sorted(known)}")
