"""QuantizedModel <-> the artifact's tensors and `manifest.quantization` entries.

Canonical storage (portable; the runtime packs for its own kernels at load time):
    int4  {name}.qweight uint8 [out, ceil(in/2)] two codes per byte, low nibble first;
          codes 0..15 (symmetric codes are stored +8), {name}.scales fp32 [out, groups],
          {name}.zeros fp32 [out, groups] (asymmetric only)
    int8  {name}.qweight int8 [out, in], {name}.scales fp32 [out, 1]
    fp8   {name}.weight float8_e4m3fn [out, in], {name}.weight_scale fp32 [out, groups],
          {name}.input_scale fp32 [] (static activations only)
    KV    model.layers.{i}.self_attn.{k_scale, v_scale} fp32 [kv_heads] (fp8),
          model.layers.{i}.self_attn.k_channel_scale fp32 [kv_heads, head_dim] (key smoothing),
          model.layers.{i}.self_attn.k_offset fp32 [kv_heads, head_dim] (key offset)
Everything else is a high-precision tensor under its HF name, stored in bf16 (fp32 norms).
"""

import torch

from qkiln.errors import ArtifactError
from qkiln.quant import Fp8Weight, KVCalibration, QuantizedWeight, QuantScheme
from qkiln.runtime.config import ModelConfig

from .quantized_model import QuantizedModel


def to_tensors(qm: QuantizedModel) -> tuple[dict[str, torch.Tensor], dict]:
    """-> (tensors, manifest.quantization)."""
    tensors = {k: stored_precision(k, v) for k, v in qm.fp_tensors.items()}
    linears = {}
    for name, w in sorted(qm.weights.items()):
        out_features, in_features = w.shape
        entry = {"in_features": in_features, "out_features": out_features, "group_size": w.group_size,
                 **{k: v for k, v in qm.report.get(name, {}).items() if k in ("algorithm", "fallback")}}
        if isinstance(w, Fp8Weight):
            entry |= {"format": "fp8", "scheme": "fp8-w8a8", "symmetric": True,
                      "activations": "dynamic" if qm.scheme.activations.dynamic else "static"}
            tensors[name + ".weight"] = w.weight.contiguous()
            tensors[name + ".weight_scale"] = w.scales.float().contiguous()
            if name in qm.act_scales:
                tensors[name + ".input_scale"] = qm.act_scales[name].float().reshape(())
        elif w.num_bits == 4:
            symmetric = w.zeros is None
            entry |= {"format": "int4", "scheme": "w4a16", "symmetric": symmetric}
            tensors[name + ".qweight"] = w.packed_int4.contiguous()
            tensors[name + ".scales"] = w.scales.float().contiguous()
            if not symmetric:
                tensors[name + ".zeros"] = w.zeros.float().contiguous()
        else:
            if w.zeros is not None or w.num_groups != 1:
                raise ArtifactError(f"{name}: int8 weights are stored symmetric with one scale per row; this one "
                                    "has zero points or groups: re-quantize it symmetric per channel")
            entry |= {"format": "int8", "scheme": "w8a16", "symmetric": True}
            tensors[name + ".qweight"] = w.qweight.to(torch.int8).contiguous()
            tensors[name + ".scales"] = w.scales.float().reshape(out_features, 1).contiguous()
        linears[name] = entry
    for i, (k_cal, v_cal) in sorted(qm.kv.items()):
        prefix = f"model.layers.{i}.self_attn."
        for key, value in (("k_scale", k_cal.scale), ("v_scale", v_cal.scale), ("k_channel_scale", k_cal.channel_scale),
                           ("k_offset", k_cal.offset)):
            if value is not None:
                tensors[prefix + key] = value.float().contiguous()
    return tensors, {"linears": linears}


def stored_precision(name: str, t: torch.Tensor) -> torch.Tensor:
    """A high-precision tensor as the artifact stores it."""
    # norms are tiny and sensitive (AWQ folds scales into them): keep fp32; the rest bf16
    return t.float().contiguous() if "norm" in name or t.dim() == 1 else t.to(torch.bfloat16).contiguous()


def from_tensors(config: ModelConfig, scheme: QuantScheme, tensors: dict[str, torch.Tensor],
                 quantization: dict) -> QuantizedModel:
    """Inverse of `to_tensors` (used to evaluate an artifact in simulation)."""
    linears = quantization.get("linears", {})
    weights: dict = {}
    act_scales = {}
    for name, e in linears.items():
        if e["format"] == "fp8":
            weights[name] = Fp8Weight(tensors[name + ".weight"], tensors[name + ".weight_scale"], e["group_size"])
            if name + ".input_scale" in tensors:
                act_scales[name] = tensors[name + ".input_scale"]
        elif e["format"] == "int4":
            weights[name] = QuantizedWeight.from_packed_int4(tensors[name + ".qweight"], e["in_features"],
                                                             tensors[name + ".scales"], tensors.get(name + ".zeros"),
                                                             e["group_size"])
        else:
            weights[name] = QuantizedWeight(tensors[name + ".qweight"], tensors[name + ".scales"], None, None, 8)
    kv = {}
    if scheme.kv_cache is not None:
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            kv[i] = (KVCalibration(tensors.get(p + "k_scale"), tensors.get(p + "k_channel_scale"),
                                   tensors.get(p + "k_offset")),
                     KVCalibration(tensors.get(p + "v_scale"), None))
    skip = tuple(f"{n}.{s}" for n in linears for s in ("qweight", "scales", "zeros", "weight", "weight_scale", "input_scale"))
    fp = {k: v.float() for k, v in tensors.items() if k not in skip and not k.endswith(("_scale", "self_attn.k_offset"))}
    return QuantizedModel(config, scheme, fp, weights, act_scales, kv)
