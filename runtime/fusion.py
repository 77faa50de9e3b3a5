"""Horizontal fusion of the projections that read the same input, for serving.

q/k/v read the same normed hidden state, and so do gate/up: serving runs each set as ONE
linear (`qkv_proj`, `gate_up_proj`), which halves the per-layer kernel launches and lets a
decode GEMV stream one larger weight. Calibration and evaluation keep Hugging Face's separate
names (compile/ never sees fused names); fusion happens only when a model is loaded to serve.

Fusing concatenates the members' tensors along the output dimension (dim 0 of every tensor
whose first dim is the member's out_features: weights, packed int4 codes, group scales and
zero points, biases). A set is fused only when every member has the same format and the
tensors that are not per-output-channel (e.g. a static per-tensor activation scale) are equal;
otherwise its members stay separate, which the model supports per layer.
"""

import torch

FUSED_SETS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fusion_candidates(num_layers: int):
    """(fused name, member names) for every layer."""
    for i in range(num_layers):
        for fused, members in FUSED_SETS.items():
            yield f"model.layers.{i}.{fused}", tuple(f"model.layers.{i}.{m}" for m in members)


def _member_tensors(tensors: dict, member: str) -> dict[str, torch.Tensor]:
    prefix = member + "."
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix):]}


def _concat(parts: list[dict[str, torch.Tensor]], out_sizes: list[int]) -> dict[str, torch.Tensor] | None:
    """Concatenate per-output tensors; None when the members' tensors can't be fused."""
    if any(p.keys() != parts[0].keys() for p in parts):
        return None
    fused = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, out_sizes)):
            fused[key] = torch.cat(values)
        elif all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values):
            fused[key] = values[0]
        else:
            return None
    return fused


def fuse_tensors(tensors: dict, linears: dict, num_layers: int, out_sizes: dict[str, list[int]]):
    """Add fused entries to `tensors` (and `linears`, for quantized sets); returns the fused names.

    tensors: flat name -> tensor (HF names); linears: quantized linear name -> manifest entry;
    out_sizes: fused set suffix (e.g. "self_attn.qkv_proj") -> members' out_features.
    The members' own entries are removed for every set that was fused.
    """
    fused_names = set()
    for fused, members in fusion_candidates(num_layers):
        entries = [linears.get(m) for m in members]
        if any(e is not None for e in entries):
            first = dict(entries[0] or {}, out_features=None)
            if any(e is None or dict(e, out_features=None) != first for e in entries):
                continue  # mixed formats (a per-layer fallback): keep this set unfused
        sizes = out_sizes[fused.split(".", 3)[3]]
        parts = [_member_tensors(tensors, m) for m in members]
        merged = _concat(parts, sizes) if parts[0] else None
        if merged is None:
            continue
        for m, part in zip(members, parts):
            for key in part:
                del tensors[f"{m}.{key}"]
        tensors.update({f"{fused}.{k}": v for k, v in merged.items()})
        if entries[0] is not None:
            linears[fused] = dict(entries[0], out_features=sum(sizes))
            for m in members:
                del linears[m]
        fused_names.add(fused)
    return fused_names


def projection_out_sizes(config) -> dict[str, list[int]]:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [config.intermediate_size] * 2}
