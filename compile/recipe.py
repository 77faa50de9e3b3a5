"""Recipes: what a build does, from a YAML/TOML file or a named preset, validated up front.

A recipe = a `QuantScheme` (quant/) + calibration data spec + evaluation protocol + target.
Presets: w4a16-rtn, w4a16-gptq, w4a16-awq (INT4 group 128), w8a16 (INT8 per channel),
fp8-w8a8 (FP8 per-channel weights by GPTQ, dynamic per-token activations, the last decoder
layer's MLP kept in bf16), fp8-w8a8-rtn (the same without calibration: RTN weights, every layer),
fp8-w8a8-static (RTN weights, static per-tensor activations), each
combinable with "+kv-int4" / "+kv-fp8" (e.g. `w4a16-gptq+kv-int4`), or kv-int4 / kv-fp8 alone.
Nothing here touches a model: `Recipe.validate(model_config, linear_shapes)` runs before any
calibration so a bad recipe fails in milliseconds with the offending layers named.
"""

import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qkiln.errors import RecipeError
from qkiln.quant.scheme import (ActivationScheme, AWQOptions, GPTQOptions, KVCacheScheme, QuantScheme,
                                WeightScheme)

# Shipped in calib_data/bundled/ (licenses there), so builds need no download. On SmolLM2-135M, GPTQ
# W4 g128 (before true-sequential) on 128 x 512 tokens of it closed 44% of RTN's gap on wiki.test.raw
# (16384 tokens) vs 46% for a Wikipedia-only excerpt of the same size and 29% for self:128 (the
# previous default), and closed the most of it on text that is not Wikipedia (Persuasion 48% vs 11%
# and 16%, TinyStories 34% vs 16% and 28%): it generalizes (bench/results/quant_quality_calibration.json).
DEFAULT_CALIBRATION_SOURCE = "mix:bundled:wikitext2-valid+bundled:pride-and-prejudice"
TARGETS = ("cpu", "cuda")

# Embeddings are gathers, not GEMMs; SmolLM2 ties lm_head to them, and the measurements
# show the tied head is the most sensitive matrix: the algorithm leaves both alone (the weight-only
# presets then store an int8 per-channel copy of the head, _HEAD_INT8 below).
DEFAULT_IGNORE = ("lm_head",)

_INT4 = WeightScheme(num_bits=4, type="int", symmetric=False, group_size=128)
_FP8 = WeightScheme(num_bits=8, type="float", symmetric=True, group_size=None)  # per-channel: any fp8 GEMM takes it
_LAST_MLP = r"re:model\.layers\.-1\.mlp\."  # decoder layers count from the end (quant/scheme.py)
# Weight-only presets also keep an int8 per-channel copy of the output projection (tied or not):
# at batch 1 on CPU the bf16 SmolLM2 head (49152 x 576) took 5.5 ms of a ~15 ms decode step.
_HEAD_INT8 = WeightScheme(num_bits=8, type="int", symmetric=True, group_size=None)
_WEIGHT_PRESETS: dict[str, dict[str, Any]] = {
    "w4a16-rtn": dict(weights=_INT4, algorithm="rtn", lm_head=_HEAD_INT8),
    # GPTQ with act-order and an MSE-searched per-group range closed more of RTN's gap on SmolLM2
    # than with min/max (README's accuracy table); the MSE range makes plain RTN worse, so only GPTQ
    # uses it.
    "w4a16-gptq": dict(weights=dataclasses.replace(_INT4, observer="mse"), algorithm="gptq", lm_head=_HEAD_INT8),
    # AWQ's scales (Lin et al. 2023, Sec. 3.2), then GPTQ (act-order, MSE range) on the scaled weights
    # instead of RTN, an explicit combination (awq.quantizer "gptq"; plain AWQ: quantizer "rtn", minmax
    # observer). No AWQ weight clipping here: the MSE observer already searches each group's range, and
    # a clip first rewrites the weights GPTQ reconstructs, so the range is shrunk twice and the clip error
    # is never compensated (llm-compressor's AWQ has no clip either and leaves ranges to the quantizer).
    # SmolLM2, 32 x 512 of the default mix, wiki.test 16384 tokens: RTN's gap closed 53% without the
    # clip vs 43% with it (g64: 63%); held-out Persuasion 58% vs 60% (quant_quality_main.json).
    "w4a16-awq": dict(weights=dataclasses.replace(_INT4, observer="mse"), algorithm="awq",
                      awq=AWQOptions(quantizer="gptq", clip=False), lm_head=_HEAD_INT8),
    "w8a16": dict(weights=WeightScheme(num_bits=8, type="int", symmetric=True, group_size=None), algorithm="rtn",
                  lm_head=_HEAD_INT8),
    # FP8 W8A8 on SmolLM2 (wiki.test.raw, first 16384 tokens, 512-token windows; calibration 32 x 512
    # wikitext-2 valid): RTN +3.35%. The e4m3 grid's relative rounding, not outliers, is the cost
    # (4096 tokens: weights alone +2.1%, activations alone +1.0%, down_proj inputs +0.04%; 1x128
    # activation groups or per-group weight scales gain <0.3%). GPTQ on the fp8 grid: +2.12%; plus
    # the last layer's MLP in bf16 (it alone costs +1.25% with RTN; 1/30 of the MLP weights): +1.60%.
    # Not true-sequential: on the fp8 grid it changed nothing measurable (+1.46% with it, +1.48%
    # without; 2 threads) while each group's pass re-quantizes the activations (564 s vs 371 s).
    "fp8-w8a8": dict(weights=_FP8, activations=ActivationScheme(dynamic=True), algorithm="gptq",
                     gptq=GPTQOptions(true_sequential=False), ignore=DEFAULT_IGNORE + (_LAST_MLP,)),
    # Data-free (no calibration): llm-compressor's FP8_DYNAMIC recipe, for a build in seconds.
    "fp8-w8a8-rtn": dict(weights=_FP8, activations=ActivationScheme(dynamic=True), algorithm="rtn"),
    "fp8-w8a8-static": dict(weights=_FP8,
                            activations=ActivationScheme(dynamic=False), algorithm="rtn"),
}
# int4 KV scales are stored in fp16 by the paged cache: simulate exactly that
_KV_PRESETS = {"kv-int4": KVCacheScheme(dtype="int4", scale_dtype="float16"), "kv-fp8": KVCacheScheme(dtype="fp8", key_offset=True)}


@dataclass(frozen=True)
class CalibrationSpec:
    source: str = DEFAULT_CALIBRATION_SOURCE
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self):
        _check_types("calibration", self, {"source": str, "num_samples": int, "seq_len": int, "seed": int})
        if self.seed < 0:  # Python's random.Random(-7) is random.Random(7): two seeds, one sample
            raise RecipeError(f"calibration.seed must be an integer >= 0, got {self.seed}")
        if self.num_samples < 1 or self.seq_len < 2:
            raise RecipeError(f"calibration needs num_samples >= 1 and seq_len >= 2 (--num-samples, the recipe's "
                              f"calibration.seq_len), got num_samples {self.num_samples}, seq_len {self.seq_len}")


@dataclass(frozen=True)
class EvalSpec:
    data: str | None = None  # None: skip the accuracy report
    seq_len: int = 512
    max_tokens: int = 4096

    def __post_init__(self):
        _check_types("evaluation", self, {"data": (str, type(None)), "seq_len": int, "max_tokens": int})
        if self.seq_len < 2 or self.max_tokens < 2:
            raise RecipeError(f"evaluation needs seq_len >= 2 and max_tokens >= 2 (--eval-seq-len or "
                              f"evaluation.seq_len, --eval-tokens or evaluation.max_tokens), got seq_len "
                              f"{self.seq_len}, max_tokens {self.max_tokens}")


def _check_types(section: str, spec, types: dict) -> None:
    """Recipe files are YAML/TOML: a quoted number or a list where a name belongs is refused here,
    not met as a traceback (or a different seed) later."""
    for key, allowed in types.items():
        value = getattr(spec, key)
        if not isinstance(value, allowed) or isinstance(value, bool):
            want = " or ".join(t.__name__ for t in (allowed if isinstance(allowed, tuple) else (allowed,)))
            raise RecipeError(f"{section}.{key} must be {want.replace('NoneType', 'null')}, "
                              f"got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class Recipe:
    name: str
    scheme: QuantScheme
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    evaluation: EvalSpec = field(default_factory=EvalSpec)
    target: str = "cpu"

    def __post_init__(self):
        if self.target not in TARGETS:
            raise RecipeError(f"target must be one of {TARGETS}, got {self.target!r}")

    def validate(self, linear_shapes: dict[str, tuple[int, int]], head_dim: int) -> None:
        # imports torch: not at recipe load
        from qkiln.plugins.packed_weights import CPU_GROUP_SIZES, cpu_serves_int4_groups

        self.scheme.validate(linear_shapes, head_dim)
        # the head's scheme too: an int8 head with groups had calibrated every layer, then failed
        for section, w in (("weights", self.scheme.weights), ("lm_head", self.scheme.lm_head)):
            if w is not None and w.type == "int" and w.num_bits == 8 and (not w.symmetric or w.group_size is not None):
                # an artifact stores int8 codes with one scale a row, which is what the w8a16 kernels read
                raise RecipeError(f"{section}: 8-bit integer weights are symmetric with one scale per output channel: "
                                  f"set {section}.symmetric true and {section}.group_size null (or use 4 bits for "
                                  "group-wise or asymmetric weights)")
            if self.target == "cpu" and w is not None and w.type == "int" and w.num_bits == 4 \
                    and not cpu_serves_int4_groups(w.group_size):
                # the native int4 kernels take groups of whole 32-channel blocks (plugins/packed_weights.py)
                raise RecipeError(f"{section}: target cpu serves int4 groups of a multiple of {CPU_GROUP_SIZES[-1]} "
                                  f"channels (e.g. {', '.join(map(str, CPU_GROUP_SIZES))}) or one group per row "
                                  f"(group_size null), got {w.group_size}")

    @property
    def needs_calibration(self) -> bool:
        return self.scheme.needs_weight_calibration or self.scheme.kv_cache is not None

    def with_overrides(self, *, calibration: dict[str, Any] | None = None, evaluation: dict[str, Any] | None = None,
                       **changes) -> "Recipe":
        """A copy with top-level fields replaced and the named `calibration` / `evaluation` fields merged
        into their sections (a `--num-samples` changes one field, not the whole section); each section
        checks its new values as a recipe file's would be."""
        if calibration:
            changes["calibration"] = dataclasses.replace(self.calibration, **calibration)
        if evaluation:
            changes["evaluation"] = dataclasses.replace(self.evaluation, **evaluation)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """As the manifest records it: data files by name (their sha256 is in the calibration and
        accuracy records), so a build's manifest does not depend on the directory it ran in."""
        from qkiln.calib_data import portable_spec  # imports torch: not at recipe load

        evaluation = dataclasses.asdict(self.evaluation)
        if self.evaluation.data is not None:
            evaluation["data"] = portable_spec(self.evaluation.data)
        calibration = dataclasses.asdict(self.calibration) | {"source": portable_spec(self.calibration.source)}
        return {"name": self.name, "scheme": self.scheme.to_dict(), "target": self.target,
                "calibration": calibration, "evaluation": evaluation}

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "custom") -> "Recipe":
        if d is None:  # an empty YAML file
            raise RecipeError(f"recipe {name} is empty; give a preset: name or a scheme: section")
        if not isinstance(d, dict):
            raise RecipeError(f"a recipe must be a mapping, got {type(d).__name__}")
        # fallbacks: what a build did (a manifest's recipe section lists them beside the recipe it
        # applied), not an input, so that section reads back as the recipe that made it
        unknown = set(d) - {"name", "scheme", "quantization", "calibration", "evaluation", "target", "preset",
                            "fallbacks"}
        if unknown:
            raise RecipeError(f"unknown recipe keys {sorted(map(str, unknown))}; a recipe takes name, preset or "
                              "scheme, calibration, evaluation and target")
        if "scheme" in d and "quantization" in d:  # `quantization` is `scheme`'s other name
            raise RecipeError("a recipe takes a `scheme:` section or a `quantization:` one (the same section "
                              "under another name), not both; merge them into `scheme:`")
        if not isinstance(d.get("name", name), str):
            raise RecipeError(f"name must be a string, got {d['name']!r}")
        if "preset" in d and not isinstance(d["preset"], str):
            raise RecipeError(f"preset must be a name such as w4a16-gptq, got {d['preset']!r}")
        base = preset(d["preset"]) if "preset" in d else None
        scheme_dict = d.get("scheme", d.get("quantization"))
        if scheme_dict is None and base is None:
            raise RecipeError("a recipe needs a `scheme:` section or a `preset:` name")
        if scheme_dict is not None and base is not None:
            raise RecipeError("a recipe takes a `preset:` name or a `scheme:` section, not both "
                              "(a scheme replaces the preset's whole scheme); keep one")
        scheme = QuantScheme.from_dict(scheme_dict) if scheme_dict is not None else base.scheme
        calibration = _spec(CalibrationSpec, "calibration", d.get("calibration", {}))
        evaluation = _spec(EvalSpec, "evaluation", d.get("evaluation", {}))
        return cls(d.get("name", name), scheme, calibration, evaluation, d.get("target", "cpu"))


def _spec(cls, section: str, d):
    known = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, dict):
        raise RecipeError(f"{section} must be a mapping with keys {known}, got {type(d).__name__}")
    unknown = sorted(map(str, set(d) - set(known)))
    if unknown:
        raise RecipeError(f"unknown {section} keys {unknown}; known: {known}")
    return cls(**d)


def preset(name: str) -> Recipe:
    """`w4a16-gptq`, `fp8-w8a8+kv-fp8`, `kv-int4`, ... -> Recipe."""
    parts = name.split("+")
    kwargs: dict[str, Any] = {"ignore": DEFAULT_IGNORE}
    for part in parts:
        if part in _WEIGHT_PRESETS and "weights" not in kwargs:
            kwargs.update(_WEIGHT_PRESETS[part])
        elif part in _KV_PRESETS and "kv_cache" not in kwargs:
            kwargs["kv_cache"] = _KV_PRESETS[part]
        else:
            raise RecipeError(f"unknown preset {name!r}: combine one of {sorted(_WEIGHT_PRESETS)} "
                              f"with +kv-int4 or +kv-fp8 (or use kv-int4 / kv-fp8 alone)")
    return Recipe(name, QuantScheme(**kwargs))


RECIPE_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def load_recipe(spec: str) -> Recipe:
    """A preset name or a .yaml/.yml/.toml/.json file."""
    path = Path(spec)
    suffix = path.suffix.lower()  # r.YML is YAML too
    if suffix not in RECIPE_SUFFIXES:
        if "/" not in spec:
            try:
                return preset(spec)
            except RecipeError:
                if not path.exists():
                    raise
        # a file, or a path: "unknown preset" would mislead
        raise RecipeError(f"recipe {spec}: a recipe file's name ends in {', '.join(RECIPE_SUFFIXES)}, which says "
                          "its format (rename it), or give a preset name")
    if not path.exists():
        raise RecipeError(f"recipe file {spec} does not exist")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors write one) is not content
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"recipe file {spec} cannot be read as UTF-8 text ({e}); give a YAML, TOML or JSON file") from None
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_object)
        else:
            data = yaml.load(text, Loader=_RecipeLoader)
    except _RecipeTextError as e:
        raise RecipeError(f"{spec}: {e}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        mark = getattr(e, "problem_mark", None)  # PyYAML's message runs to 4 lines with a caret
        what = f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None \
            else " ".join(str(e).split())
        raise RecipeError(f"{spec} is not valid {suffix[1:].upper().replace('YML', 'YAML')}: {what}") from None
    return Recipe.from_dict(data, name=path.stem)


class _RecipeTextError(ValueError):
    pass


def _json_object(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:  # json keeps the last one: a whole section could vanish unsaid
            raise _RecipeTextError(f"the key {key!r} appears twice in one object; keep one")
    return dict(pairs)


class _RecipeLoader(yaml.SafeLoader):
    """YAML as a recipe author means it: a key twice is refused (PyYAML keeps the last, so a second
    `scheme:` silently dropped the first), numbers YAML 1.1 reads in another base (0200 is 128,
    0x40 is 64) or sexagesimal (1:30 is 90) are refused, and 1e-2 is the float YAML 1.2 reads (1.1
    reads it as a string)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: what follows may override it
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):  # a list as a key: PyYAML's own error says it
                continue
            if key in seen:
                raise _RecipeTextError(f"the key {key!r} appears twice in one mapping (lines "
                                       f"{seen[key] + 1} and {key_node.start_mark.line + 1}); keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        if not _DECIMAL_INT.fullmatch(node.value):
            value = super().construct_yaml_int(node)
            raise _RecipeTextError(f"{node.value} (line {node.start_mark.line + 1}) is read by YAML as {value}; "
                                   "write whole numbers in decimal without leading zeros")
        return super().construct_yaml_int(node)


_DECIMAL_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _RecipeLoader.construct_yaml_int)
_RecipeLoader.add_constructor("tag:yaml.org,2002:map", _RecipeLoader.construct_mapping)
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"),
                                    list("-+0123456789"))
