"""Import a quantized Hugging Face checkpoint as a qkiln artifact: compressed-tensors, GPTQ
(AutoGPTQ / GPTQModel `qweight/qzeros/scales/g_idx`) and AWQ (AutoAWQ GEMM).

Owns `read_checkpoint` (directory -> QuantizedModel: finds the format, reads the weights, checks
that they fit the architecture) and `import_checkpoint` (-> a verified artifact through
`artifact_tensors.to_tensors` and `write_artifact`). The layouts themselves are decoded in
`checkpoint_layouts.py`. Pure torch: needs no compressed-tensors, AutoGPTQ or AutoAWQ installed.

Invariants: every imported linear dequantizes to the source's (q - zero) * scale, computed in
fp32 from the stored integers and scales, bit for bit (a reader that multiplies in fp16 rounds
that product). Non-quantized tensors take the artifact's storage dtypes (bf16, norms fp32), as
in a build. The format comes from `quantization_config.quant_method` in config.json, or from
AutoGPTQ's quantize_config.json / AutoAWQ's quant_config.json beside it; nothing is guessed from
tensor names. An imported artifact records the source's quantization_config in
`recipe.imported_from`; its `recipe.scheme` is nominal (the first fp8, else first, layer's), and
`quantization.linears` is what the runtime builds from, as for a build.
"""

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from qkiln.errors import SourceModelError
from qkiln.quant import Fp8Weight, QuantizedWeight
from qkiln.quant.scheme import ActivationScheme, KVCacheScheme, QuantScheme, WeightScheme
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.model import CausalLM
from qkiln.runtime.source import file_sha256, load_weight_files, read_generation_config, weight_files
from qkiln.runtime.tokenizer import Tokenizer

from .artifact import Manifest, toolchain_versions
from .artifact_tensors import to_tensors
from .artifact_writer import output_path, source_date_epoch, write_artifact
from .checkpoint_layouts import decode_awq, decode_compressed_tensors, decode_gptq, decode_kv
from .quantized_model import QuantizedModel

FORMATS = ("compressed-tensors", "gptq", "awq")


@dataclass
class ImportedCheckpoint:
    format: str  # one of FORMATS
    quantization_config: dict  # as the checkpoint states it
    qm: QuantizedModel
    sha256: str  # of the weight files, in name order


def import_checkpoint(path, out, *, target: str = "cpu", overwrite: bool = False) -> Path:
    """Read the quantized checkpoint at `path` and write it as a verified artifact at `out`."""
    src = Path(path)
    ckpt = read_checkpoint(src)
    if target == "cpu":
        _check_cpu_groups(ckpt.qm.weights)
    tensors, quantization = to_tensors(ckpt.qm)
    config = ckpt.qm.config
    with torch.device("meta"):
        num_params = sum(p.numel() for p in CausalLM(config).parameters())
    kv = ckpt.qm.scheme.kv_cache
    manifest = Manifest(
        name=output_path(out).name,
        architecture=config.to_dict(),
        target={"device": target, "min_compute_capability": "8.0" if target == "cuda" else None},
        recipe={"name": f"import:{ckpt.format}", "scheme": ckpt.qm.scheme.to_dict(), "target": target,
                "imported_from": {"format": ckpt.format, "quantization_config": ckpt.quantization_config},
                "fallbacks": {}},
        quantization=quantization, kv_cache=None if kv is None else kv.to_dict(), calibration=None,
        source={"name": src.name, "kind": ckpt.format, "sha256": ckpt.sha256} | _export_provenance(src),
        toolchain=toolchain_versions(),
        accuracy={"skipped": "imported checkpoint: run `qkiln eval` on the artifact"},
        num_parameters=num_params, source_bytes_bf16=2 * num_params, created=source_date_epoch())
    return write_artifact(out, manifest, tensors, _tokenizer_files(src), {}, overwrite=overwrite)


def _export_provenance(src: Path) -> dict:
    """A checkpoint `qkiln export` wrote names the artifact, recipe and source model it came from
    (its note); kept, so the round trip does not lose where the weights were made."""
    from .export_compressed_tensors import read_export_note

    note = read_export_note(src)
    if note is None:
        return {}
    return {"exported_from": {k: note.get(k) for k in ("artifact", "recipe", "source_sha256")}}


def _check_cpu_groups(weights: dict) -> None:
    """What the CPU's int4 kernels cannot serve is refused now, not when the artifact is loaded."""
    from qkiln.plugins.packed_weights import CPU_GROUP_SIZES, cpu_serves_int4_groups

    odd = sorted(n for n, w in weights.items() if isinstance(w, QuantizedWeight) and w.num_bits == 4
                 and not cpu_serves_int4_groups(w.group_size))
    if odd:
        raise SourceModelError(f"target cpu serves int4 groups of a multiple of {CPU_GROUP_SIZES[-1]} channels; "
                               f"{odd[0]} (and {len(odd) - 1} more) has group_size {weights[odd[0]].group_size}: "
                               "import with --target cuda, or re-quantize with groups of 32, 64 or 128")


def _tokenizer_files(src: Path) -> dict[str, bytes]:
    tokenizer = Tokenizer.from_dir(src)  # the artifact stores the normalised pair, as a build does
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(Path(tmp))
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


def read_checkpoint(path) -> ImportedCheckpoint:
    src = Path(path)
    hf = _read_json(src / "config.json")
    config = ModelConfig.from_hf(hf, read_generation_config(src))
    fmt, qc = _quantization_config(src, hf)
    files = weight_files(src)
    tensors = load_weight_files(files)
    with torch.device("meta"):
        model = CausalLM(config)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    act_dynamic, act_scales, kv_scheme, kv = None, {}, None, {}
    try:
        if fmt == "gptq":
            weights = decode_gptq(tensors, shapes, qc)
        elif fmt == "awq":
            weights = decode_awq(tensors, shapes, qc)
        else:
            weights, act_dynamic, act_scales = decode_compressed_tensors(tensors, shapes, qc)
            kv_scheme, kv = decode_kv(tensors, qc.get("kv_cache_scheme"), config)
    except (AttributeError, TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        # a field of the wrong type or value (group_size 0, config_groups a list, ...)
        raise SourceModelError(f"{src}: its {fmt} quantization_config does not describe these weights "
                               f"({type(e).__name__}: {e}); fix the config or re-save the checkpoint") from e
    if not weights and kv_scheme is None:  # a KV cache scheme alone is a quantized model (qkiln exports those)
        raise SourceModelError(f"{src}: no quantized linear found for {fmt}; is this the right checkpoint?")
    fp_tensors = _remaining_tensors(src, tensors, model, weights, config)
    _check_finite(src, weights, fp_tensors)
    scheme = _scheme(weights, act_dynamic, kv_scheme, fmt, shapes)
    head = _exact_int8_head(fp_tensors.get("lm_head.weight"))
    if head is not None:  # an int8 head qkiln's export wrote as its values: kept int8, bit for bit
        weights["lm_head"] = head
        del fp_tensors["lm_head.weight"]
        scheme = dataclasses.replace(scheme, lm_head=WeightScheme(num_bits=8, symmetric=True, group_size=None,
                                                                  scale_dtype="float32"),
                                     ignore=tuple(n for n in scheme.ignore if n != "lm_head"))
    qm = QuantizedModel(config, scheme, fp_tensors, weights, act_scales, kv)
    return ImportedCheckpoint(fmt, qc, qm, file_sha256(files))


def _exact_int8_head(weight: torch.Tensor | None) -> QuantizedWeight | None:
    """An fp32 head whose every row is int8 codes times one fp32 scale, exactly: what qkiln's export
    writes for an int8 head (compressed-tensors gets it dense, export_compressed_tensors._load).
    Finds the codes and scales again (a row's largest |code| is 127 or 128, so its scale is amax /
    127 or / 128, give or take an ulp of rounding), so export -> import keeps the head int8 and bit
    for bit; None for any other head."""
    if weight is None or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    amax = weight.abs().amax(dim=1, keepdim=True)  # [out, 1]
    if not bool((amax > 0).all()):
        return None
    candidates = []
    for largest_code in (127, 128):
        up = down = amax / largest_code
        candidates.append(up)
        for _ in range(2):  # code x scale was rounded once: an ulp or two either side
            up, down = torch.nextafter(up, up * 2), torch.nextafter(down, torch.zeros_like(down))
            candidates += [up, down]
    scales, found = torch.zeros_like(amax), torch.zeros_like(amax, dtype=torch.bool)
    for scale in candidates:
        codes = torch.round(weight / scale)
        exact = ((codes * scale == weight) & (codes >= -128) & (codes <= 127)).all(dim=1, keepdim=True) & ~found
        scales, found = torch.where(exact, scale, scales), found | exact
    if not bool(found.all()):
        return None
    head = QuantizedWeight(torch.round(weight / scales).to(torch.int8), scales, None, None, 8)
    return head if torch.equal(head.dequantize(), weight) else None


def _check_finite(src: Path, weights: dict, fp_tensors: dict) -> None:
    """NaN / inf anywhere, or a negative scale, would import, verify, then generate garbage."""
    for name, weight in weights.items():
        for field, value in vars(weight).items():  # scales, zeros; an fp8 weight's values
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                continue
            values = value.float()
            if not torch.isfinite(values).all() or ("scale" in field and (values < 0).any()):
                raise SourceModelError(f"{src}: {name}.{field} holds NaN, infinite or negative scale values; "
                                       "the checkpoint is damaged")
    for name, value in fp_tensors.items():
        if value.is_floating_point() and not torch.isfinite(value.float()).all():
            raise SourceModelError(f"{src}: {name} holds NaN or infinite values; the checkpoint is damaged")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise SourceModelError(f"{path.parent} has no {path.name}; is this a Hugging Face model directory?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SourceModelError(f"{path} is not valid JSON ({e}); re-download it") from None


def _quantization_config(src: Path, hf: dict) -> tuple[str, dict]:
    """(format, its config) from config.json, else AutoGPTQ's quantize_config.json / AutoAWQ's quant_config.json."""
    qc = hf.get("quantization_config")
    if qc is None:
        for name, fmt in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            if (src / name).is_file():
                return fmt, _read_json(src / name)
        raise SourceModelError(f"{src}: config.json has no quantization_config; an unquantized model is "
                               "built with `qkiln build`, not imported")
    if not isinstance(qc, dict):
        raise SourceModelError(f"{src}: config.json's quantization_config is a {type(qc).__name__}, not an object; "
                               "re-save the checkpoint")
    fmt = qc.get("quant_method")
    if fmt not in FORMATS:
        raise SourceModelError(f"{src}: quant_method {fmt!r} cannot be imported; supported: {', '.join(FORMATS)}")
    if fmt == "compressed-tensors" and (qc.get("transform_config") or qc.get("sparsity_config")):
        raise SourceModelError(f"{src}: the checkpoint uses compressed-tensors transforms or sparsity, whose "
                               "weights are not plain (q - zero) * scale; import a checkpoint without them")
    return fmt, qc


def _remaining_tensors(src: Path, tensors: dict, model: CausalLM, weights: dict, config: ModelConfig) -> dict:
    """The high-precision tensors, checked against what the model needs (no more, no less)."""
    needed = {k: v for k, v in model.state_dict().items() if k.removesuffix(".weight") not in weights}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    unexpected, missing = sorted(set(tensors) - set(needed)), sorted(set(needed) - set(tensors))
    if unexpected or missing:
        raise SourceModelError(f"{src}: tensors do not fit a {config.architecture} model with these quantized layers: "
                               f"unexpected {unexpected[:4]}, missing {missing[:4]}; the checkpoint, its "
                               "config.json and its quantization_config disagree")
    wrong = [f"{k} {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in needed.items()
             if tensors[k].shape != v.shape]
    if wrong:
        raise SourceModelError(f"{src}: tensors of the wrong shape for its config.json: {', '.join(wrong[:4])}")
    return tensors


def _scheme(weights: dict, act_dynamic: bool | None, kv: KVCacheScheme | None, fmt: str, shapes: dict) -> QuantScheme:
    """A nominal recipe for the manifest; `quantization.linears` is what the runtime builds from."""
    if not weights:  # the KV cache only: every linear stays as stored
        return QuantScheme(kv_cache=kv)
    # mixed checkpoints (int4 MLP + fp8 attention) are named by their fp8 part: activations need it
    fp8 = [w for _, w in sorted(weights.items()) if isinstance(w, Fp8Weight)]
    first = fp8[0] if fp8 else weights[sorted(weights)[0]]
    if isinstance(first, Fp8Weight):
        ws = WeightScheme(num_bits=8, type="float", symmetric=True, group_size=None)
    else:
        ws = WeightScheme(num_bits=first.num_bits, symmetric=first.zeros is None, group_size=first.group_size,
                          scale_dtype="float32")
    acts = None if act_dynamic is None else ActivationScheme(dynamic=act_dynamic)
    return QuantScheme(weights=ws, activations=acts, kv_cache=kv, ignore=tuple(n for n in shapes if n not in weights),
                       algorithm={"gptq": "gptq", "awq": "awq"}.get(fmt, "rtn"))
