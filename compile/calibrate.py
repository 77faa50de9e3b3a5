"""Sequential, layer-by-layer calibration and quantization (the algorithms live in quant/).

    hidden = embed(calibration tokens)                  # [num_samples, seq_len, hidden]
    for each decoder layer (one resident at a time):
        1. run it on `hidden`, hooks capture what the scheme needs: GPTQ Hessians, AWQ inputs,
           static FP8 input amax
        2. weights: AWQ scale search + fold + clip, then RTN (or GPTQ on x / s: awq.quantizer);
           or GPTQ from the Hessians; or RTN/FP8
        3. simulate the quantized layer (dequantized weights, fake-quant activations)
           and run it on `hidden`: its outputs are the next layer's inputs
    GPTQ (true-sequential, the default) does 1-2 per group of linears in forward order (q/k/v, o,
    gate/up, down), so each group's Hessian comes from inputs computed through the quantized groups
    before it; each capture pass stops as soon as the group saw its inputs. Static activation scales
    (RTN weights) are observed the same way, on the inputs the served GEMMs will read.
KV-cache scales are calibrated afterwards (kv_calibrate.py) on the weight-quantized model, so
changing only the KV scheme reuses every cached layer (layer_cache.py).
Deterministic: fixed order, no sampling, CPU fp32 math. Progress shows one step per layer.
Owns hooks and layer order; must not implement quantization math itself.
"""

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from qkiln.quant import Fp8Weight, QuantizedWeight, awq, fake_quantize_activation, fp8, gptq
from qkiln.quant.rtn import quantize_rtn
from qkiln.runtime.attention import DenseAttention
from qkiln.runtime.model import CausalLM

from .layer_cache import LayerCache
from .quantized_model import QuantizedModel
from .simulate import install_layer_simulation, simulate_lm_head

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# AWQ groups of linears that read one input, and what produced that input (Lin et al. 2023, Sec. 3.2).
_AWQ_GROUPS = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    (("mlp.down_proj",), "mlp.up_proj"),
)
_AWQ_V_O = (("self_attn.o_proj",), "self_attn.v_proj")  # AWQOptions.scale_o_proj: after q/k/v
_AWQ_NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # their errors are amplified by q.k (AutoAWQ)
# GPTQ's true-sequential order (the reference code's --true-sequential): each group reads what the
# groups before it compute, in the order a forward pass runs them.
_SEQUENTIAL_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                      ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


class _GroupCaptured(Exception):
    """Raised by a capture hook once every linear of the group saw its input: the rest of the
    layer's forward pass is not needed for this group."""


def linear_shapes(model: CausalLM) -> dict[str, tuple[int, int]]:
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def quantize_model(model: CausalLM, scheme, input_ids: torch.Tensor | None, batch_size: int = 8,
                   progress: bool = True, cache: LayerCache | None = None,
                   cache_key: Callable[[int], str] | None = None) -> QuantizedModel:
    """Quantize `model` (fp32, modified in place into its simulated form) with `scheme`.

    `scheme.kv_cache` is ignored here (see kv_calibrate.py). With a `cache`, layers whose key
    is present are loaded instead of calibrated; the rest are calibrated and stored.
    """
    qm = QuantizedModel(model.config, scheme, fp_tensors={})
    layers = model.model.layers
    hidden = positions = None
    if input_ids is not None:
        with torch.no_grad():
            hidden = model.model.embed_tokens(input_ids)  # [num_samples, seq_len, hidden]
        positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
    keys = [cache_key(i) if cache is not None and cache_key else None for i in range(len(layers))]
    cached = [cache.get(k) if k else None for k in keys]
    # inputs are only needed up to the last layer that must be calibrated
    last_needed = max((i for i, c in enumerate(cached) if c is None), default=-1)
    # AWQ's fp_inputs: the next layer reads the unquantized layer's outputs (AutoAWQ's protocol)
    fp_stream = scheme.algorithm == "awq" and scheme.awq.fp_inputs
    for i, layer in enumerate(tqdm(layers, desc="quantize", unit="layer", disable=not progress)):
        start = time.perf_counter()
        prefix = f"model.layers.{i}."
        _own_float32_copy(layer)
        fp_out = None
        simulated = False  # a group-by-group calibration installs the simulation as it goes
        if cached[i] is not None:
            if fp_stream and hidden is not None and i < last_needed:
                fp_out = _run_layer(layer, hidden, positions, model.rope, DenseAttention(), batch_size)
            _restore_layer(layer, prefix, *cached[i], qm)
        elif _group_by_group(scheme) and hidden is not None:
            for names in _SEQUENTIAL_GROUPS:
                stats = _capture(layer, hidden, positions, model.rope, scheme, batch_size, names)
                _quantize_layer(i, layer, model.config, scheme, stats, qm, names)
                install_layer_simulation(layer, i, qm, names)  # the next group reads these outputs
            simulated = True
            if keys[i]:
                cache.put(keys[i], *_layer_entry(layer, prefix, qm))
        else:
            stats = _capture(layer, hidden, positions, model.rope, scheme, batch_size) if hidden is not None else {}
            fp_out = stats.get("out")
            _quantize_layer(i, layer, model.config, scheme, stats, qm)
            if keys[i]:
                cache.put(keys[i], *_layer_entry(layer, prefix, qm))
        if not simulated:
            install_layer_simulation(layer, i, qm)
        if hidden is not None and i < last_needed:
            hidden = fp_out if fp_stream else _run_layer(layer, hidden, positions, model.rope, DenseAttention(),
                                                         batch_size)
        qm.timings[prefix.rstrip(".")] = {"seconds": time.perf_counter() - start, "cached": cached[i] is not None}
    if scheme.lm_head is not None:
        _quantize_lm_head(model, scheme.lm_head, qm)
    elif model.lm_head is not None and not scheme.is_ignored("lm_head") and scheme.weights is not None:
        _quantize_plain(model.lm_head, "lm_head", scheme, qm)
        simulate_lm_head(model, qm)
    # not copies: the layers' tensors are their own (_own_float32_copy), the embeddings' and the
    # head's are the source's, and nothing writes into a tensor in place from here on
    qm.fp_tensors = {k: v.detach() for k, v in model.state_dict().items() if k.removesuffix(".weight") not in qm.weights}
    return qm


def _own_float32_copy(layer: nn.Module) -> None:
    """The decoder layer computes on an fp32 copy of its tensors from here on. A copy even of fp32
    ones: calibration writes into them (a cached layer's restore copies its AWQ-folded norms in
    place), and they were the source's own, from which the unquantized reference is built (it
    scored with folded norms and unscaled linears: a cached AWQ rebuild reported another KL).
    One layer at a time: the layers not reached yet stay as stored (compile/upcast.py)."""
    for param in layer.parameters():
        param.data = param.data.to(torch.float32, copy=True)


def _group_by_group(scheme) -> bool:
    """Whether each group of linears is calibrated on what the quantized groups before it compute:
    GPTQ's true-sequential Hessians, and static activation scales, which must cover what the served
    GEMM reads (observed on the unquantized layer, o_proj's or down_proj's inputs went 1.6-4.5%
    past their scale on tiny models and were clipped)."""
    static = scheme.activations is not None and not scheme.activations.dynamic
    return (scheme.algorithm == "gptq" and scheme.gptq.true_sequential) or (static and scheme.algorithm == "rtn")


def _layer_entry(layer, prefix: str, qm: QuantizedModel) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's results as flat tensors + a JSON report (the cache entry)."""
    tensors = {f"fp|{prefix}{k}": v for k, v in layer.state_dict().items()
               if not any(f"{prefix}{k}".removesuffix(".weight") == n for n in qm.weights)}
    report = {}
    for name, w in qm.weights.items():
        if not name.startswith(prefix):
            continue
        if isinstance(w, Fp8Weight):
            tensors |= {f"fp8|{name}|weight": w.weight, f"fp8|{name}|scales": w.scales}
        else:
            tensors |= {f"int|{name}|qweight": w.qweight, f"int|{name}|scales": w.scales}
            if w.zeros is not None:
                tensors[f"int|{name}|zeros"] = w.zeros
        report[name] = qm.report.get(name, {}) | {"group_size": w.group_size,
                                                  "num_bits": getattr(w, "num_bits", 8)}
        if name in qm.act_scales:
            tensors[f"act|{name}"] = qm.act_scales[name]
    return tensors, report


def _restore_layer(layer, prefix: str, tensors: dict, report: dict, qm: QuantizedModel) -> None:
    fp = {k.split("|", 1)[1].removeprefix(prefix): v for k, v in tensors.items() if k.startswith("fp|")}
    layer.load_state_dict(fp, strict=False)
    for name, info in report.items():
        gs = info.pop("group_size")
        bits = info.pop("num_bits")
        if f"fp8|{name}|weight" in tensors:
            qm.weights[name] = Fp8Weight(tensors[f"fp8|{name}|weight"], tensors[f"fp8|{name}|scales"], gs)
        else:
            qm.weights[name] = QuantizedWeight(tensors[f"int|{name}|qweight"], tensors[f"int|{name}|scales"],
                                               tensors.get(f"int|{name}|zeros"), gs, bits)
        if f"act|{name}" in tensors:
            qm.act_scales[name] = tensors[f"act|{name}"]
        qm.report[name] = info


def _forward_batch(layer, hidden, positions, rope, backend, start: int, batch_size: int):
    """The layer on calibration samples [start, start + batch_size)."""
    rows = slice(start, start + batch_size)
    return layer(hidden[rows], rope.cos_sin(positions[rows], hidden.dtype), backend)


@torch.no_grad()
def _run_layer(layer, hidden, positions, rope, backend, batch_size):
    return torch.cat([_forward_batch(layer, hidden, positions, rope, backend, s, batch_size)
                      for s in range(0, hidden.shape[0], batch_size)])


@torch.no_grad()
def _capture(layer, hidden, positions, rope, scheme, batch_size, names: tuple[str, ...] = _LINEARS) -> dict:
    """One pass of the layer; returns Hessians / inputs / amax keyed by linear (only `names`).

    Linears that read the same tensor (q/k/v, gate/up) share one set of statistics: it is
    accumulated once (the Hessian of a 576-wide input costs as much as a 576 x 576 GEMM per token).
    With a subset of the linears, each batch's pass stops once all of them saw their input, and
    there is no "out" (the layer's output is computed after its simulation is installed).
    """
    needs_h = scheme.algorithm == "gptq"
    needs_x = scheme.algorithm == "awq"
    needs_amax = scheme.activations is not None and not scheme.activations.dynamic
    quantize_input = scheme.activations is not None and scheme.activations.dynamic
    stats: dict = {"H": {}, "n": {}, "x": {}, "amax": {}}

    def accumulate(name, x):
        if needs_h:
            # GPTQ for dynamic W8A8: minimise the output error on what the GEMM will multiply
            x_h = fake_quantize_activation(x, scheme.activations) if quantize_input else x
            H = stats["H"].get(name)
            if H is None:
                H = gptq.make_empty_hessian(x.shape[-1])
            stats["H"][name], stats["n"][name] = gptq.accumulate_hessian(H, x_h, stats["n"].get(name, 0))
        if needs_x:
            stats["x"].setdefault(name, []).append(x.clone())  # [batch, seq, in]
        if needs_amax:
            stats["amax"][name] = fp8.update_amax(stats["amax"].get(name), x)

    modules = {name: layer.get_submodule(name) for name in names}
    stop_early = set(names) != set(_LINEARS)
    batch_inputs: dict[str, torch.Tensor] = {}  # this batch's input of each linear that ran
    twins: dict[str, str] = {}  # linear -> the linear whose input it reads (seen on the first batch)
    hooks = []
    for name, module in modules.items():
        def hook(mod, args, name=name):
            x = args[0]
            twin = next((n for n, seen in batch_inputs.items() if seen is x), None)
            if twins.setdefault(name, twin) != twin:
                raise RuntimeError(f"calibration: {name} shares its input with {twin} on one batch only")
            batch_inputs[name] = x
            if twin is None:
                accumulate(name, x)
            if stop_early and len(batch_inputs) == len(modules):
                raise _GroupCaptured
        hooks.append(module.register_forward_pre_hook(hook))

    outs = []
    try:
        for s in range(0, hidden.shape[0], batch_size):
            batch_inputs.clear()
            try:
                outs.append(_forward_batch(layer, hidden, positions, rope, DenseAttention(), s, batch_size))
            except _GroupCaptured:
                pass
            if len(batch_inputs) != len(modules):
                raise RuntimeError(f"calibration: the layer never called {sorted(set(modules) - set(batch_inputs))}")
    finally:
        for h in hooks:
            h.remove()
    batch_inputs.clear()
    stats["x"] = {k: torch.cat(v) for k, v in stats["x"].items()}  # [num_samples, seq, in]
    for name, twin in twins.items():
        for kind in ("H", "n", "x", "amax"):
            if twin is not None and twin in stats[kind]:
                stats[kind][name] = stats[kind][twin]  # the same tensor: read-only from here on
    if not stop_early:
        stats["out"] = torch.cat(outs)
    stats["positions"], stats["rope"] = positions, rope  # AWQ's module-level loss reruns attention
    return stats


def _quantize_layer(i, layer, config, scheme, stats, qm: QuantizedModel, names: tuple[str, ...] = _LINEARS) -> None:
    prefix = f"model.layers.{i}."
    if scheme.weights is None:
        return
    awq_scales = _apply_awq(layer, prefix, scheme, stats, config.num_hidden_layers) if scheme.algorithm == "awq" else {}
    awq_gptq = scheme.algorithm == "awq" and scheme.awq.quantizer == "gptq"
    for name in names:
        full = prefix + name
        if scheme.is_ignored(full, config.num_hidden_layers):
            continue
        module = layer.get_submodule(name)
        if scheme.algorithm == "gptq" or awq_gptq:
            # AWQ then GPTQ: the scaled weights read x / s, so the Hessian is that of x / s
            H = stats["H"][name] if not awq_gptq else awq.gram(stats["x"][name] / awq_scales.get(name, 1.0))
            qw, info = gptq.quantize_weight(module.weight.data, H, scheme.weights, scheme.gptq)
            qm.weights[full] = qw
            qm.report[full] = {"algorithm": scheme.algorithm, "loss": info.loss, "fallback": info.fallback,
                               "dampening_frac": info.dampening_frac, "dead_columns": info.num_dead_columns}
            if info.fallback_reason:
                qm.report[full]["fallback_reason"] = info.fallback_reason
            if awq_gptq:
                qm.report[full]["quantizer"] = "gptq"
        else:
            _quantize_plain(module, full, scheme, qm)
        if name in stats.get("amax", {}):
            qm.act_scales[full] = fp8.static_scale(stats["amax"][name])


def _quantize_lm_head(model: CausalLM, head_scheme, qm: QuantizedModel) -> None:
    """RTN of the output projection; a tied head becomes its own (quantized) module, so the
    embedding lookups keep the exact weights while the logits use the quantized copy."""
    head = model.lm_head.weight.data if model.lm_head is not None else model.model.embed_tokens.weight.data
    qm.weights["lm_head"] = quantize_rtn(head, head_scheme)  # as stored: it upcasts a block of rows at a time
    qm.report["lm_head"] = {"algorithm": "rtn"}
    simulate_lm_head(model, qm)


def _quantize_plain(module: nn.Linear, full: str, scheme, qm: QuantizedModel) -> None:
    W = module.weight.data  # the head's as stored (the layers' are fp32 copies by now): both quantizers upcast
    if scheme.weights.type == "float":
        qm.weights[full] = fp8.quantize_weight_scheme(W, scheme.weights)
    else:
        qm.weights[full] = quantize_rtn(W, scheme.weights)
    qm.report.setdefault(full, {"algorithm": scheme.algorithm if scheme.algorithm == "awq" else "rtn"})


def _apply_awq(layer, prefix, scheme, stats, num_layers: int) -> dict[str, torch.Tensor]:
    """Scale search per input-sharing group, fold 1/s into the producer, then clip search.

    Returns {linear name: s} for every scaled linear (its input is now x / s).
    """
    opts = scheme.awq
    scales = {}
    search_scheme = dataclasses.replace(scheme.weights, observer=opts.search_observer)
    groups = _AWQ_GROUPS[:1] + (_AWQ_V_O,) + _AWQ_GROUPS[1:] if opts.scale_o_proj else _AWQ_GROUPS
    for names, producer_name in groups:
        if any(scheme.is_ignored(prefix + n, num_layers) for n in names):
            continue
        x = stats["x"][names[0]]  # [num_samples, seq, in]
        linears = [layer.get_submodule(n) for n in names]
        forward_fn = _awq_module_forward(layer, names, stats) if opts.module_loss else None
        x_search = x[: opts.loss_samples] if forward_fn is not None else x
        attn = layer.self_attn
        shared = (awq.gqa_shared_index(attn.num_heads, attn.num_kv_heads, attn.head_dim)
                  if producer_name == "self_attn.v_proj" else None)
        result = awq.search_scales(x_search, [m.weight.data for m in linears], search_scheme,
                                   grid_size=opts.grid_size, duo_scaling=opts.duo_scaling, forward_fn=forward_fn,
                                   shared=shared)
        s = result.scales
        producer = layer.get_submodule(producer_name)
        if isinstance(producer, nn.Linear):
            s_rows = s if result.shared_scales is None else result.shared_scales  # v_proj's rows
            # the bias is divided too: v_proj's (Qwen2) feeds o_proj as much as its weight does
            bias = producer.bias.data if producer.bias is not None else None
            producer.weight.data, bias = awq.fold_scales_into_linear(producer.weight.data, s_rows, bias)
            if bias is not None:
                producer.bias.data = bias
        else:
            producer.weight.data = awq.fold_scales_into_norm(producer.weight.data, s)
        for m, W in zip(linears, awq.scale_weights([m.weight.data for m in linears], s)):
            m.weight.data = W
        scales.update(dict.fromkeys(names, s))
        if opts.clip:
            xs = x / s
            for n, m in zip(names, linears):
                if n in _AWQ_NO_CLIP:
                    continue
                clip = awq.search_clip(xs, m.weight.data, search_scheme, grid_size=opts.clip_grid_size,
                                       max_shrink=opts.clip_max_shrink)
                m.weight.data = awq.apply_clip(m.weight.data, clip.max_val, scheme.weights.group_size, clip.min_val)
    return scales


def _awq_module_forward(layer, names, stats):
    """AutoAWQ's `module2inspect`: score q/k/v scales on the attention block's output and gate/up on
    the MLP's, with the other linears in full precision; a lone linear (down_proj) scores itself."""
    if len(names) == 1:
        return None
    block_name = names[0].split(".")[0]  # "self_attn" or "mlp"
    block = layer.get_submodule(block_name)
    linears = [layer.get_submodule(n) for n in names]

    @torch.no_grad()
    def forward(x, weights):
        saved = [m.weight.data for m in linears]
        for m, w in zip(linears, weights):
            m.weight.data = w
        try:
            if block_name == "self_attn":
                cos_sin = stats["rope"].cos_sin(stats["positions"][: x.shape[0]], x.dtype)
                return block(x, cos_sin, DenseAttention())
            return block(x)
        finally:
            for m, w in zip(linears, saved):
                m.weight.data = w

    return forward
