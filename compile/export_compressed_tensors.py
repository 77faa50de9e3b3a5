"""Export an artifact as a compressed-tensors checkpoint: the Hugging Face layout vLLM and
transformers load (`config.json` with `quantization_config`, `model.safetensors`, tokenizer).

Owns `export_compressed_tensors`, `check_export` (decompress the export with compressed-tensors'
own compressors and compare with the artifact bit for bit) and `hf_config_dict` (ModelConfig ->
config.json). Packing and the config JSON come from the `compressed-tensors` library itself
(optional extra `interop`); this module maps the artifact's canonical tensors onto them.

Mapping (artifact -> compressed-tensors 0.20), every weight exact:
    int4 / int8   format "pack-quantized": weight_packed int32 [out, ceil(in*b/32)] (codes stored
                  as q + 2^(b-1), CT's signed convention), weight_scale fp32 [out, groups],
                  weight_zero_point int32 packed along out (asymmetric), weight_shape int64 [2]
                  ours: w = (q - zero) * scale, q in [0, 15]  ->  CT: (q_ct - zp_ct) * scale with
                  q_ct = q - 8, zp_ct = zero - 8: the same integers subtracted, the same fp32 product
    fp8           format "float-quantized": weight e4m3 [out, in], weight_scale fp32 [out, 1],
                  input_scale fp32 [1] (static activations) or dynamic per-token activations
    fp8 KV        kv_cache_scheme fp8, k_scale / v_scale per layer: strategy "tensor" ([1]) when
                  all heads share a scale, else "attn_head" ([kv_heads, 1, 1])
Scales stay fp32: CT dequantizes in the scale's dtype, so fp32 keeps the product bit-exact (a
consumer that casts scales to bf16 rounds them unless the recipe used scale_dtype bfloat16).

Partial last group: compressed-tensors 0.20 refuses a group size that does not divide
in_features (`_process_group` raises). The export therefore uses the largest group size that
divides every quantized layer's in_features and the artifact's group size (gcd), repeating each
scale; the weights are unchanged (SmolLM2: 576 with group 128 -> exported with group 64).
Refused, naming the layer: fractional zero points (`zero_point: float`), which CT cannot store;
int4 KV and key smoothing (no CT equivalent) unless `drop_kv`, which exports the weights only.
"""

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from qkiln.errors import ArtifactError, QkilnError
from qkiln.quant import Fp8Weight, KVCalibration, QuantScheme
from qkiln.quant.fp8 import FP8_MAX
from qkiln.quant.rtn import expand_groups
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.model import CausalLM

from .artifact import load_tensors, read_manifest
from .artifact_tensors import from_tensors
from .artifact_writer import check_replaceable, output_path, read_json_object, staged_directory
from .quantized_model import QuantizedModel

INSTALL_HINT = "install the interop extra: pip install 'qkiln[interop]' (compressed-tensors==0.20.0)"
_SAFETENSORS_METADATA = {"format": "pt"}
EXPORT_NOTE = "qkiln_export.json"  # beside the checkpoint's files; Hugging Face loaders ignore it


@dataclass
class ExportResult:
    path: Path
    num_linears: int
    group_size: int | None  # the group size written (None: per channel); may be finer than the artifact's
    kv_strategy: str | None  # "tensor" | "attn_head" | None


def _require_compressed_tensors():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise QkilnError(f"compressed-tensors is not installed: {INSTALL_HINT}") from None


def export_compressed_tensors(artifact, out_dir, *, drop_kv: bool = False, overwrite: bool = False,
                              verify: bool = True) -> ExportResult:
    """Write the artifact at `artifact` as a compressed-tensors checkpoint in `out_dir`.

    The directory appears complete or not at all; with `verify` the result is decompressed with
    compressed-tensors and compared bit for bit with the artifact (`check_export`).
    """
    _require_compressed_tensors()
    out = output_path(out_dir)
    recheck = lambda: check_replaceable(out, overwrite, "a checkpoint qkiln exported", _export_files)  # noqa: E731
    recheck()
    kv = read_manifest(artifact).kv_cache  # refused before the weights load (~20 s for SmolLM2)
    if kv and not drop_kv and kv.get("dtype") != "fp8":
        raise ArtifactError(_kv_refusal(f"an {kv['dtype']} KV cache"))
    qm, stored = _load(artifact)
    tensors, quant_config, info = _compressed_state(qm, drop_kv)
    # as the artifact stores them (bf16, norms fp32); a dequantized head as computed
    tensors.update({k: stored.get(k, qm.fp_tensors[k]) for k in qm.fp_tensors})
    with staged_directory(out, recheck) as tmp:
        config = qm.config
        if config.tie_word_embeddings and "lm_head.weight" in qm.fp_tensors:
            # the head was quantized as its own copy: an untied checkpoint carries it
            config = dataclasses.replace(config, tie_word_embeddings=False)
        _write_checkpoint(tmp, config, tensors, quant_config, Path(artifact) / "tokenizer")
        manifest = read_manifest(artifact)  # provenance, and what lets --force know its own export
        files = sorted(p.name for p in tmp.iterdir()) + [EXPORT_NOTE]  # what --force may replace later
        (tmp / EXPORT_NOTE).write_text(json.dumps({"producer": "qkiln", "artifact": manifest.name,
                                                   "recipe": manifest.recipe.get("name"),
                                                   "source_sha256": manifest.source.get("sha256"), "files": files},
                                                  indent=2, sort_keys=True) + "\n")
        if verify:
            check_export(artifact, tmp, qm)
    return ExportResult(out, len(qm.weights), *info)


# what an export's note without a file list (qkiln before it kept one) stands for
_EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", EXPORT_NOTE}


def read_export_note(directory: Path) -> dict | None:
    """The note `export_compressed_tensors` leaves beside a checkpoint (what it came from, the files
    written), or None when `directory` is not an export qkiln wrote."""
    note = read_json_object(directory / EXPORT_NOTE)
    return note if note.get("producer") == "qkiln" else None


def _export_files(directory: Path) -> set[str] | None:
    """The files an export qkiln wrote lists in its note, or None when `directory` is not one."""
    note = read_export_note(directory)
    if note is None:
        return None
    return set(note["files"]) if isinstance(note.get("files"), list) else _EXPORT_FILES


def load_artifact_quantized(artifact) -> QuantizedModel:
    """The artifact's QuantizedModel (verified), as `from_tensors` rebuilds it (fp tensors in fp32)."""
    return _load(artifact)[0]


def _load(artifact) -> tuple[QuantizedModel, dict[str, torch.Tensor]]:
    manifest = read_manifest(artifact)
    tensors = load_tensors(artifact, manifest)
    scheme = QuantScheme.from_dict(manifest.recipe["scheme"])
    config = ModelConfig.from_dict(manifest.architecture)
    qm = from_tensors(config, scheme, tensors, manifest.quantization)
    if scheme.lm_head is not None and "lm_head" in qm.weights:
        # An int8 head beside int4 layers makes a two-group config that transformers' loader cannot
        # dequantize; the head is written as its exact dequantized fp32 values instead (untied).
        qm.fp_tensors["lm_head.weight"] = qm.weights.pop("lm_head").dequantize().float()
    return qm, tensors


def _compressed_state(qm: QuantizedModel, drop_kv: bool):
    """-> (tensors to write, QuantizationConfig, (group size written, kv strategy))."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    group_size = _export_group_size(qm)
    tensors = {}
    groups: dict[str, tuple[dict, list[str]]] = {}  # scheme fields (as JSON) -> (fields, linears)
    for name, w in sorted(qm.weights.items()):
        args, extra = _scheme_args(qm, name, w, group_size)
        key = json.dumps(args, sort_keys=True)
        if key not in groups:
            groups[key] = (args, [])
        groups[key][1].append(name)
        tensors.update({f"{name}.{k}": v for k, v in _linear_tensors(name, w, group_size, pack_to_int32).items()})
        tensors.update({f"{name}.{k}": v for k, v in extra.items()})
    # one group covers every Linear (what llm-compressor writes); several name their layers
    config_groups = {f"group_{i}": QuantizationScheme(targets=["Linear"] if len(groups) == 1 else names, **args)
                     for i, (args, names) in enumerate(groups.values())}
    formats = {s.format for s in config_groups.values()}
    kv_scheme, kv_tensors, kv_strategy = _kv_cache(qm, drop_kv)
    tensors.update(kv_tensors)
    quant_config = QuantizationConfig(
        config_groups=config_groups, format=formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense"),
        quantization_status="compressed", ignore=_ignored_linears(qm), kv_cache_scheme=kv_scheme)
    return tensors, quant_config, (group_size, kv_strategy)


def _linear_names(config: ModelConfig) -> list[str]:
    with torch.device("meta"):
        model = CausalLM(config)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _ignored_linears(qm: QuantizedModel) -> list[str]:
    # a tied lm_head is no module of ours but is a Linear in transformers and vLLM: name it too
    names = set(_linear_names(qm.config)) | ({"lm_head"} if qm.config.tie_word_embeddings else set())
    return sorted(n for n in names if n not in qm.weights)


def _export_group_size(qm: QuantizedModel) -> int | None:
    """The one group size to write: the artifact's, refined to divide every layer's in_features."""
    size = 0  # gcd(0, n) == n
    for w in qm.weights.values():
        if w.group_size is not None:
            in_features = w.shape[1]
            size = math.gcd(size, math.gcd(w.group_size, in_features))
    return size or None


def _scheme_args(qm: QuantizedModel, name: str, w, group_size: int | None) -> tuple[dict, dict]:
    """compressed-tensors QuantizationScheme fields for one linear, and its extra tensors."""
    strategy = {"strategy": "channel"} if w.group_size is None else {"strategy": "group", "group_size": group_size}
    if isinstance(w, Fp8Weight):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **strategy}
        if name in qm.act_scales:
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
            return ({"weights": weights, "input_activations": acts, "format": "float-quantized"},
                    {"input_scale": qm.act_scales[name].float().reshape(1)})
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        return {"weights": weights, "input_activations": acts, "format": "float-quantized"}, {}
    weights = {"num_bits": w.num_bits, "type": "int", "symmetric": w.zeros is None, "dynamic": False, **strategy}
    return {"weights": weights, "format": "pack-quantized"}, {}


def _regroup(params: torch.Tensor, group_size: int | None, in_features: int, new_size: int | None) -> torch.Tensor:
    """[out, groups] per-group values -> [out, in/new_size]; exact because new_size divides both."""
    if new_size is None or new_size == group_size:
        return params.float().contiguous()
    return expand_groups(params.float(), group_size, in_features)[:, ::new_size].contiguous()


def _linear_tensors(name: str, w, group_size: int | None, pack_to_int32) -> dict[str, torch.Tensor]:
    group_size = None if w.group_size is None else group_size  # per-channel layers stay per channel
    if isinstance(w, Fp8Weight):
        in_features = w.weight.shape[1]
        return {"weight": w.weight.contiguous(), "weight_scale": _regroup(w.scales, w.group_size, in_features, group_size)}
    out_features, in_features = w.shape
    offset = 1 << (w.num_bits - 1)
    if w.zeros is None:
        codes = w.qweight  # int8: symmetric codes are already CT's signed codes
    else:
        zeros = w.zeros.float()
        if not torch.equal(zeros, zeros.round()) or zeros.min() < 0 or zeros.max() > 2 * offset - 1:
            raise ArtifactError(f"linear {name}: its zero points are fractional (recipe zero_point: float); "
                                "compressed-tensors stores integer zero points only. Rebuild with "
                                "weights.zero_point: int to export it")
        codes = (w.qweight.to(torch.int16) - offset).to(torch.int8)  # [out, in] in [-8, 7]
    out = {"weight_packed": pack_to_int32(codes, w.num_bits),
           "weight_scale": _regroup(w.scales, w.group_size, in_features, group_size),
           "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64)}
    if w.zeros is not None:
        zp = (_regroup(w.zeros, w.group_size, in_features, group_size) - offset).to(torch.int8)  # [out, groups]
        out["weight_zero_point"] = pack_to_int32(zp, w.num_bits, packed_dim=0)
    return out


def _kv_refusal(why: str) -> str:
    return (f"the artifact uses {why}, which compressed-tensors cannot express; rebuild with kv-fp8 and "
            "kv_cache.key_smoothing: false, or export the weights only (--drop-kv)")


def _kv_cache(qm: QuantizedModel, drop_kv: bool):
    """-> (kv_cache_scheme dict or None, tensors, strategy)."""
    kv = qm.scheme.kv_cache
    if kv is None or drop_kv:
        return None, {}, None
    smoothed = [i for i, (k, _) in sorted(qm.kv.items()) if k.channel_scale is not None]
    if kv.dtype != "fp8" or smoothed:
        why = (f"an {kv.dtype} KV cache" if kv.dtype != "fp8"
               else f"key smoothing (k_channel_scale, layer {smoothed[0]})")
        raise ArtifactError(_kv_refusal(why))
    scales = [s for k, v in qm.kv.values() for s in (_offset_free_scale(k), v.scale)]
    per_tensor = all(torch.equal(s, s[:1].expand_as(s)) for s in scales)
    tensors = {}
    for i, (k, v) in sorted(qm.kv.items()):
        for key, s in (("k_scale", _offset_free_scale(k)), ("v_scale", v.scale)):
            tensors[f"model.layers.{i}.self_attn.{key}"] = (s[:1] if per_tensor else s.reshape(-1, 1, 1)).float()
    strategy = "tensor" if per_tensor else "attn_head"
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    return scheme, tensors, strategy


def _offset_free_scale(k: KVCalibration) -> torch.Tensor:
    """A per-head k_scale for keys stored without our key offset (compressed-tensors has none).

    |k| <= |k - offset| + |offset|, so amax(k) / 448 <= scale + max|offset| / 448: a scale that
    covers the calibrated range of plain keys (coarser than ours; it never clips more).
    """
    if k.offset is None:
        return k.scale
    return k.scale + k.offset.abs().amax(dim=-1) / FP8_MAX


def hf_config_dict(config: ModelConfig) -> dict:
    """A Hugging Face config.json for `config`; `ModelConfig.from_hf` reads it back unchanged."""
    eos = list(config.eos_token_ids)
    if (config.rope_scaling or {}).get("rope_type") == "freq_factors":
        raise ArtifactError("this model's RoPE scaling came from a GGUF's rope_freqs tensor that no Hugging Face "
                            "rope_scaling reproduces, so a config.json cannot describe it; export from the "
                            "model's Hugging Face directory instead")
    return {  # our family names are the HF model_type names
        "architectures": [config.hf_architecture], "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window, "use_sliding_window": config.sliding_window is not None,
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "bfloat16",
    }


def hf_generation_config_dict(config: ModelConfig) -> dict | None:
    """A generation_config.json carrying the model's recommended sampling values (which vLLM and
    transformers read there), or None when it recommends none."""
    if not config.sampling_defaults:
        return None
    values = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in config.sampling_defaults.items()}
    eos = list(config.eos_token_ids)
    # transformers samples only with do_sample (vLLM reads the values alone): on when a sampling value
    # is recommended and the temperature is not 0 (greedy), off for max_new_tokens alone
    samples = bool(set(values) - {"max_new_tokens"}) and values.get("temperature", 1.0) != 0
    return {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "do_sample": samples, **values}


def _write_checkpoint(directory: Path, config: ModelConfig, tensors: dict, quant_config, tokenizer_dir: Path):
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file

    (directory / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2, sort_keys=True) + "\n")
    generation = hf_generation_config_dict(config)
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    ModelCompressor(quantization_config=quant_config).update_config(str(directory))  # CT writes its own block
    ordered = {k: tensors[k].detach().contiguous() for k in sorted(tensors)}
    save_file(ordered, str(directory / "model.safetensors"), metadata=dict(_SAFETENSORS_METADATA))
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copyfile(f, directory / f.name)


def check_export(artifact, export_dir, qm: QuantizedModel | None = None) -> int:
    """Decompress every quantized linear of `export_dir` with compressed-tensors' own compressors
    (the config parsed by its QuantizationConfig) and compare with the artifact's dequantized
    weights bit for bit. Returns the number of linears compared; raises ArtifactError naming the
    first layer that differs."""
    _require_compressed_tensors()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file

    qm = qm or load_artifact_quantized(artifact)
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    tensors = load_file(str(export_dir / "model.safetensors"))
    done = set()
    for scheme in qc.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(scheme.format or infer_module_format(torch.nn.Linear, scheme))
        param_names = compressor.compression_param_names(scheme)
        for name in _linear_names(qm.config):
            targeted = "Linear" in scheme.targets or any(match_name(name, t) for t in scheme.targets)
            if not targeted or any(match_name(name, i) for i in qc.ignore) or name in done:
                continue
            if name not in qm.weights:
                raise ArtifactError(f"{export_dir}: linear {name} is targeted by quantization_config but is not "
                                    "quantized in the artifact; please report this")
            state = {p: tensors[f"{name}.{p}"] for p in param_names if f"{name}.{p}" in tensors}
            got = compressor.decompress(state, scheme)["weight"]
            expected = qm.weights[name].dequantize()
            if got.dtype != torch.float32 or not torch.equal(got.view(torch.int32), expected.view(torch.int32)):
                raise ArtifactError(f"{export_dir}: linear {name} decompresses to other values than the artifact's "
                                    f"(max diff {(got.float() - expected).abs().max():.3g}); please report this")
            done.add(name)
    missing = sorted(set(qm.weights) - done)
    if missing:
        raise ArtifactError(f"{export_dir}: quantized linear {missing[0]} is not covered by quantization_config")
    return len(done)
