"""Quantized-checkpoint layouts -> qkiln's unpacked weights: GPTQ, AWQ GEMM, compressed-tensors.

Owns one decoder per layout (`decode_gptq`, `decode_awq`, `decode_compressed_tensors`,
`decode_kv`). Each pops the tensors it reads from the checkpoint's dict (what is left is the
high-precision rest) and returns `QuantizedWeight` / `Fp8Weight` holding the stored integers and
scales unchanged: dequantized, (q - zero) * scale in fp32 equals the source bit for bit.
Pure torch; no I/O. `import_checkpoint.py` reads the files and writes the artifact.

Layouts (b = bits, mid = 2^(b-1); packing order and direction as in `quant/pack.py`):
    GPTQ  qweight int32 [in*b/32, out] along in, sequential nibbles; qzeros int32
          [groups, out*b/32] along out; scales fp16 [groups, out]; g_idx int32 [in].
          checkpoint_format "gptq" (v1: AutoGPTQ, and GPTQModel's default on save) stores
          zero - 1, read as zero = (stored + 1) mod 2^b; "gptq_v2" stores the zero itself.
          AutoGPTQ's own packer wrote zero 0 as -1 without masking, spilling ones into the next
          nibbles: such files are corrupt for every reader, its kernels included. sym: zero == mid.
    AWQ   qweight int32 [in, out/8], qzeros int32 [groups, out/8], both along out in AutoAWQ's
          interleaved nibble order 0,2,4,6,1,3,5,7; scales fp16 [groups, out]; zero as stored.
          version "gemm" only; zero_point false means zero == 8 (as compressed-tensors'
          AutoAWQ converter reads it).
    compressed-tensors (quantization_status "compressed"): "pack-quantized" int4/int8, codes
          stored as q + mid densely along in (= sequential order for 4 and 8 bits), zero points
          packed along out; "float-quantized" fp8 weights with per-channel or per-tensor scales,
          activations fp8 dynamic per token or static per tensor; fp8 kv_cache_scheme per tensor
          or per attention head (a per-tensor scale becomes the same value for every KV head).
Refused, naming the layer, because the artifact or its kernels cannot hold them exactly:
act-order g_idx other than column // group_size (desc_act without static groups), int8 that
is asymmetric or grouped, fp8 with group/block weight scales, weight-only fp8, widths other than
4 and 8 bits, activation quantization on integer weights.
"""

import math
import re

import torch

from qkiln.errors import SourceModelError
from qkiln.quant import Fp8Weight, KVCalibration, QuantizedWeight
from qkiln.quant.pack import unpack_int32
from qkiln.quant.scheme import KVCacheScheme
from qkiln.runtime.config import ModelConfig


def _pop(tensors: dict, key: str, name: str) -> torch.Tensor:
    if key not in tensors:
        raise SourceModelError(f"linear {name}: tensor {key} is missing; the checkpoint is incomplete")
    return tensors.pop(key)


def _check_shape(name: str, what: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise SourceModelError(f"linear {name}: {what} has shape {tuple(t.shape)}, expected {tuple(expected)} "
                               "for this config.json; the checkpoint and its config disagree")


def _num_groups(in_features: int, group_size: int | None) -> int:
    return 1 if group_size is None else math.ceil(in_features / group_size)


def _check_g_idx(name: str, g_idx: torch.Tensor | None, in_features: int, group_size: int | None) -> None:
    """Only trivial g_idx is kept: the artifact and its kernels group consecutive columns."""
    if g_idx is None:
        return
    trivial = torch.arange(in_features) // (group_size or in_features)
    if g_idx.shape != trivial.shape or not torch.equal(g_idx.long(), trivial):
        raise SourceModelError(f"linear {name}: act-order g_idx (desc_act without static groups) puts columns in "
                               "groups out of order, which qkiln's int4 kernels cannot run; re-quantize with "
                               "desc_act false, or with static_groups true (GPTQModel) / actorder 'weight' (llm-compressor)")


def _int_weight(name: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int | None, bits: int) -> QuantizedWeight:
    """Unsigned codes [out, in], fp32 scales and integer zeros [out, groups] (None: zero == mid)."""
    mid = 1 << (bits - 1)
    if zeros is None or bool((zeros == mid).all()):  # symmetric: (q - mid) * scale, the same integers
        q = (codes.to(torch.int16) - mid).to(torch.int8)
        return QuantizedWeight(q, scales.float().contiguous(), None, group_size, bits)
    if bits == 8:
        raise SourceModelError(f"linear {name}: asymmetric int8 weights are not supported (qkiln's int8 is "
                               "symmetric per channel); re-quantize with sym true")
    return QuantizedWeight(codes.to(torch.uint8), scales.float().contiguous(), zeros.float().contiguous(),
                           group_size, bits)


def _check_bits(name: str, bits, group_size: int | None) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise SourceModelError(f"linear {name}: num_bits must be an integer, got {bits!r}; fix the quantization_config")
    if bits not in (4, 8):
        raise SourceModelError(f"linear {name}: {bits}-bit weights are not supported; qkiln serves 4- or 8-bit "
                               "integer weights: re-quantize the model with 4 or 8 bits, or build from the "
                               "unquantized model (qkiln build)")
    if bits == 8 and group_size is not None:
        raise SourceModelError(f"linear {name}: grouped int8 weights (group_size {group_size}) are not supported; "
                               "qkiln's int8 is per channel: re-quantize with group_size -1")


def _group_size(value, in_features: int) -> int | None:
    return None if value in (None, -1) or value >= in_features else int(value)


def decode_gptq(tensors: dict, shapes: dict, qc: dict) -> dict:
    bits, checkpoint_format = qc.get("bits", 4), qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise SourceModelError(f"GPTQ checkpoint_format {checkpoint_format!r} is a kernel-specific repacking; "
                               "import the plain 'gptq' or 'gptq_v2' checkpoint instead")
    weights = {}
    for name, (out_features, in_features) in sorted(shapes.items()):
        if f"{name}.qweight" not in tensors:
            continue
        group_size = _group_size(qc.get("group_size", 128), in_features)
        _check_bits(name, bits, group_size)
        per_word, groups = 32 // bits, _num_groups(in_features, group_size)
        qweight, qzeros = _pop(tensors, f"{name}.qweight", name), _pop(tensors, f"{name}.qzeros", name)
        scales = _pop(tensors, f"{name}.scales", name)
        _check_shape(name, "qweight", qweight, (in_features // per_word, out_features))
        _check_shape(name, "qzeros", qzeros, (groups, math.ceil(out_features / per_word)))
        _check_shape(name, "scales", scales, (groups, out_features))
        _check_g_idx(name, tensors.pop(f"{name}.g_idx", None), in_features, group_size)
        codes = unpack_int32(qweight, dim=0, num_bits=bits).t()  # [out, in]
        zeros = unpack_int32(qzeros, dim=1, num_bits=bits)[:, :out_features].to(torch.int16)  # [groups, out]
        if checkpoint_format == "gptq":
            zeros = (zeros + 1) & ((1 << bits) - 1)
        weights[name] = _int_weight(name, codes, scales.float().t(), zeros.t(), group_size, bits)
    return weights


def decode_awq(tensors: dict, shapes: dict, qc: dict) -> dict:
    bits = qc.get("bits", qc.get("w_bit", 4))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise SourceModelError(f"AWQ version {version!r} cannot be imported; only the GEMM layout is supported")
    weights = {}
    for name, (out_features, in_features) in sorted(shapes.items()):
        if f"{name}.qweight" not in tensors:
            continue
        group_size = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), in_features)
        if bits != 4:
            raise SourceModelError(f"linear {name}: AWQ GEMM stores 4-bit weights; got {bits} bits")
        groups = _num_groups(in_features, group_size)
        qweight, scales = _pop(tensors, f"{name}.qweight", name), _pop(tensors, f"{name}.scales", name)
        qzeros = tensors.pop(f"{name}.qzeros", None)
        _check_shape(name, "qweight", qweight, (in_features, out_features // 8))
        _check_shape(name, "scales", scales, (groups, out_features))
        codes = unpack_int32(qweight, dim=1, order="awq").t()  # [out, in]
        zeros = None
        if qc.get("zero_point", True) or qzeros is not None:
            if qzeros is None:
                raise SourceModelError(f"linear {name}: tensor {name}.qzeros is missing; the checkpoint is incomplete")
            _check_shape(name, "qzeros", qzeros, (groups, out_features // 8))
            zeros = unpack_int32(qzeros, dim=1, order="awq").t()  # [out, groups]
        weights[name] = _int_weight(name, codes, scales.float().t(), zeros, group_size, 4)
    return weights


def _ct_matches(name: str, pattern: str) -> bool:
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else name == pattern


def _ct_group(name: str, groups: list[dict]) -> dict | None:
    """The group that quantizes `name`, by compressed-tensors' precedence (match_targets): a target
    naming the layer exactly, then a regex, then the class ("Linear"), whatever their order."""
    for matches in (lambda t: t == name, lambda t: t.startswith("re:") and _ct_matches(name, t),
                    lambda t: t == "Linear"):
        found = next((g for g in groups if any(matches(t) for t in g["targets"])), None)
        if found is not None:
            return found
    return None


def _ct_strategy(args: dict) -> str:
    if args.get("strategy"):
        return args["strategy"]
    group_size = args.get("group_size")
    return "tensor" if group_size is None else ("channel" if group_size == -1 else "group")


def decode_compressed_tensors(tensors: dict, shapes: dict, qc: dict):
    """-> (weights, activations dynamic (None: no fp8), static input scales)."""
    if qc.get("quantization_status") != "compressed":
        raise SourceModelError(f"compressed-tensors quantization_status {qc.get('quantization_status')!r}: only "
                               "compressed checkpoints can be imported; save the model compressed")
    groups = list((qc.get("config_groups") or {}).values())
    if not all(isinstance(g, dict) and isinstance(g.get("targets"), list) for g in groups):
        raise SourceModelError("compressed-tensors config_groups must be expanded schemes with `targets` (preset "
                               "names are not read); re-save the checkpoint with compressed-tensors")
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(p, str) for p in ignore)):
        raise SourceModelError(f"compressed-tensors ignore must be a list of layer names, got {ignore!r}; "
                               "fix the quantization_config")
    weights, act_scales, dynamic = {}, {}, set()
    for name, (out_features, in_features) in sorted(shapes.items()):
        if any(_ct_matches(name, p) for p in ignore):
            continue
        scheme = _ct_group(name, groups)
        if scheme is None or scheme.get("weights") is None:
            continue
        args, acts = scheme["weights"], scheme.get("input_activations")
        fmt = scheme.get("format") or qc.get("format")
        if fmt == "pack-quantized" and args.get("type", "int") == "int" and acts is None:
            weights[name] = _ct_int(name, tensors, args, out_features, in_features)
        elif fmt == "float-quantized" and args.get("type") == "float" and acts is not None:
            weights[name], is_dynamic = _ct_fp8(name, tensors, args, acts, (out_features, in_features), act_scales)
            dynamic.add(is_dynamic)
        else:
            raise SourceModelError(f"linear {name}: compressed-tensors format {fmt!r} with weights "
                                   f"{args.get('type')}{args.get('num_bits')} and activations "
                                   f"{acts and (acts.get('type'), acts.get('num_bits'))} is not supported; "
                                   "qkiln imports pack-quantized int4/int8 weight-only and fp8 W8A8")
    if len(dynamic) > 1:
        raise SourceModelError("fp8 layers mix static and dynamic activation scales; qkiln needs one kind per model")
    return weights, (dynamic.pop() if dynamic else None), act_scales


def _ct_int(name: str, tensors: dict, args: dict, out_features: int, in_features: int) -> QuantizedWeight:
    bits, strategy = args.get("num_bits", 8), _ct_strategy(args)
    group_size = args["group_size"] if strategy == "group" else None
    _check_bits(name, bits, _group_size(group_size, in_features))
    packed, shape = _pop(tensors, f"{name}.weight_packed", name), _pop(tensors, f"{name}.weight_shape", name)
    if [int(x) for x in shape.reshape(-1)] != [out_features, in_features]:
        raise SourceModelError(f"linear {name}: weight_shape {shape.tolist()} disagrees with config.json "
                               f"({out_features}, {in_features})")
    _check_shape(name, "weight_packed", packed, (out_features, math.ceil(in_features * bits / 32)))
    codes = unpack_int32(packed, dim=1, num_bits=bits)[:, :in_features]  # [out, in] = CT code + mid
    scale = _pop(tensors, f"{name}.weight_scale", name).float()
    groups = _num_groups(in_features, group_size)
    if strategy == "tensor":  # one value for the whole tensor: the same value in every row
        _check_shape(name, "weight_scale", scale.reshape(-1), (1,))
        scale = scale.reshape(1, 1).expand(out_features, 1)
    _check_shape(name, "weight_scale", scale, (out_features, groups))
    _check_g_idx(name, tensors.pop(f"{name}.weight_g_idx", None), in_features, group_size)
    zeros = None
    if not args.get("symmetric", True):
        zp = _pop(tensors, f"{name}.weight_zero_point", name)
        if strategy == "tensor":  # CT packs zero points for group / channel only
            zeros = (zp.to(torch.int16).reshape(1, 1) + (1 << (bits - 1))).expand(out_features, 1)
        elif zp.dtype != torch.int32 and tuple(zp.shape) == (out_features, groups):
            # one int8 per zero point, unpacked: as compressed-tensors wrote them before it packed
            # them (its PR #296, 2025); unpacking those as int32 words read garbage
            zeros = zp.to(torch.int16) + (1 << (bits - 1))
            if bool(((zeros < 0) | (zeros >= 1 << bits)).any()):
                raise SourceModelError(f"linear {name}: weight_zero_point holds values outside the {bits}-bit "
                                       f"range [{-(1 << (bits - 1))}, {(1 << (bits - 1)) - 1}]")
        else:
            _check_shape(name, "weight_zero_point", zp, (math.ceil(out_features * bits / 32), groups))
            if zp.dtype != torch.int32:
                raise SourceModelError(f"linear {name}: weight_zero_point has dtype {zp.dtype}; compressed-tensors "
                                       f"packs zero points as int32 ({32 // bits} per word down the rows) or stores "
                                       f"them one per int8 as [{out_features}, {groups}]")
            zeros = unpack_int32(zp, dim=0, num_bits=bits)[:out_features]  # [out, groups] = CT zero + mid
    return _int_weight(name, codes, scale, zeros, _group_size(group_size, in_features), bits)


def _ct_fp8(name: str, tensors: dict, args: dict, acts: dict, shape: tuple, act_scales: dict):
    strategy, out_features = _ct_strategy(args), shape[0]
    weight, scale = _pop(tensors, f"{name}.weight", name), _pop(tensors, f"{name}.weight_scale", name).float()
    if args.get("num_bits") != 8 or weight.dtype != torch.float8_e4m3fn:
        raise SourceModelError(f"linear {name}: float weights must be fp8 e4m3, got {weight.dtype}")
    _check_shape(name, "weight", weight, shape)
    if strategy not in ("tensor", "channel"):
        raise SourceModelError(f"linear {name}: fp8 weights with {strategy} scales are not supported; qkiln's fp8 "
                               "GEMM takes per-channel or per-tensor weight scales")
    _check_shape(name, "weight_scale", scale.reshape(-1), (1 if strategy == "tensor" else out_features,))
    scale = scale.reshape(-1, 1).expand(out_features, 1).contiguous()  # per tensor: same value per channel
    is_dynamic = bool(acts.get("dynamic"))
    act_strategy = _ct_strategy(acts)
    if acts.get("type") != "float" or acts.get("num_bits") != 8 or \
            (is_dynamic and act_strategy != "token") or (not is_dynamic and act_strategy != "tensor"):
        raise SourceModelError(f"linear {name}: fp8 activations must be dynamic per token or static per tensor, "
                               f"got {acts}")
    if not is_dynamic:
        act_scales[name] = _pop(tensors, f"{name}.input_scale", name).float().reshape(())
    tensors.pop(f"{name}.input_zero_point", None)
    return Fp8Weight(weight, scale, None), is_dynamic


def decode_kv(tensors: dict, kv_args: dict | None, config: ModelConfig):
    """fp8 per-tensor or per-head static scales -> (KVCacheScheme, {layer: (K, V)}) with [kv_heads] scales."""
    if kv_args is None:
        return None, {}
    strategy = _ct_strategy(kv_args)
    if kv_args.get("type") != "float" or kv_args.get("num_bits") != 8 or kv_args.get("dynamic") \
            or strategy not in ("tensor", "attn_head"):
        raise SourceModelError(f"kv_cache_scheme {kv_args} is not supported; qkiln imports static fp8 KV scales "
                               "per tensor or per attention head")
    num_heads = config.num_key_value_heads
    kv = {}
    for i in range(config.num_hidden_layers):
        pair = []
        for key in ("k_scale", "v_scale"):
            where = f"model.layers.{i}.self_attn"
            if f"{where}.{key}" not in tensors:
                raise SourceModelError(f"{where}.{key} is missing; kv_cache_scheme needs K and V scales in every layer")
            s = tensors.pop(f"{where}.{key}").float().reshape(-1)
            if s.numel() not in (1, num_heads):
                raise SourceModelError(f"{where}.{key} has {s.numel()} values; expected 1 or {num_heads} (KV heads)")
            pair.append(KVCalibration(s.expand(num_heads).contiguous(), None))
        kv[i] = tuple(pair)
    return KVCacheScheme(dtype="fp8", key_smoothing=False), kv
