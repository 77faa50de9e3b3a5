"""CPU quantized-GEMM microbenchmark: qkiln's native kernels against torch's, on SmolLM2 shapes.

    run_cpu_kernels(json_path=None, num_threads=2, repeats=15, rows=(1, 16), num_layers=30,
                    step_rows=1)

Two measurements, both on random weights in the shapes of SmolLM2-135M (hidden 576, MLP 1536,
fused qkv 960, fused gate_up 3072, tied lm_head 49152 x 576), group 128 asymmetric int4:
- per shape and row count, one weight that stays in cache: median time per call of the native
  int4 kernel (exact; `native_a8`: the same layout with int8 activations, csrc/cpu_gemv_int4_a8.cpp,
  opt-in), torch's tinygemm (`_weight_int4pack_mm_for_cpu`), a bf16 matmul on the
  dequantized weight (`bf16`: the runtime's many-row path, qkiln's bf16 panels where that kernel
  built; `bf16_onednn`: the same weight oneDNN-packed), and for int8 the native kernel and
  `_weight_int8pack_mm`;
- a decode step's linears with `num_layers` distinct layers (weights stream from DRAM, as in a
  real step): the sum of qkv, o, gate_up, down per layer plus the lm_head, at `step_rows` rows
  (1: batch-1 decode; 64: an offline step, where `bf16` against `bf16_onednn` is the panels' gain).
Kernels are interleaved within each repeat, so a noisy neighbour hits them alike. Progress to
stderr, a table to stdout, the report (report.py format) to `json_path`.
"""

import time

import torch

from qkiln.plugins import cpu_native
from qkiln.plugins.cpu_linear import dense_linear
from qkiln.plugins.packed_weights import (onednn_bf16_available, onednn_pack, pack_dense,
                                         prepare_w4a16, prepare_w8a16)
from qkiln.plugins.reference import dequantize_grouped

from .report import fmt, log, make_report, print_table, summarize, write_report
from .throughput import set_threads

HIDDEN = 576
SHAPES = {"o_proj": (576, 576), "k_or_v": (192, 576), "qkv": (960, 576), "gate_up": (3072, 576),
          "up_or_gate": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYER_SHAPES = ("qkv", "o_proj", "gate_up", "down")
GROUP_SIZE = 128
BURST_S = 0.002  # each timed sample runs the kernel for about this long


def _int4_weights(out_features: int, in_features: int):
    """Random asymmetric int4 canonical weights packed four ways: native, tinygemm, the runtime's
    dequantized bf16 copy (pack_dense) and the same copy oneDNN-packed (None without oneDNN bf16)."""
    num_groups = -(-in_features // GROUP_SIZE)
    qweight = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    scales = torch.rand(out_features, num_groups) * 0.02 + 0.005
    zeros = torch.rand(out_features, num_groups) * 15
    native = prepare_w4a16(qweight, scales, zeros, GROUP_SIZE, "cpu")
    tinygemm = prepare_w4a16(qweight, scales, zeros, GROUP_SIZE, "cpu", use_native=False)
    plain = dequantize_grouped(qweight, scales, zeros, GROUP_SIZE).to(torch.bfloat16)
    onednn = onednn_pack(plain) if onednn_bf16_available() else None
    return native, tinygemm, pack_dense(plain), onednn


def _int4_calls(native, tinygemm, dense, onednn, x):
    """name -> zero-argument call; x is bf16 [rows, in]."""
    calls = {"tinygemm": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                 x, tinygemm.packed, tinygemm.group_size, tinygemm.scales),
             "bf16": lambda: dense_linear(x, dense, out_features=native.out_features)}
    if onednn is not None:
        calls["bf16_onednn"] = lambda: dense_linear(x, onednn)
    if cpu_native.is_native_w4a16(native.scales):
        calls["native"] = lambda: cpu_native.w4a16_gemm(
            x, native.packed, native.scales, native.zeros, None, GROUP_SIZE, native.out_features)
        calls["native_a8"] = lambda: cpu_native.w4a8_gemv(
            x, native.packed, native.scales, native.zeros, None, GROUP_SIZE, native.out_features)
    return calls


def _int8_calls(out_features: int, in_features: int, x):
    qweight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features) * 0.01
    torch_w = prepare_w8a16(qweight, scales, "cpu", use_native=False)
    calls = {"int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, torch_w.weight,
                                                                    torch_w.scales)}
    native = prepare_w8a16(qweight, scales, "cpu")
    if native.scales.dtype == torch.float32:
        calls["native_int8"] = lambda: cpu_native.w8a16_gemm(x, native.weight, native.scales, None)
    return calls


def _time_interleaved(calls: dict, repeats: int) -> dict:
    """name -> summarize(seconds per call) over `repeats` bursts, kernels interleaved."""
    counts = {}
    for name, call in calls.items():  # warm up and size each burst to about BURST_S
        call()
        start = time.perf_counter()
        call()
        counts[name] = max(1, int(BURST_S / max(time.perf_counter() - start, 1e-7)))
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(counts[name]):
                call()
            samples[name].append((time.perf_counter() - start) / counts[name])
    return {name: summarize(values) for name, values in samples.items()}


def _per_shape(rows: tuple[int, ...], repeats: int) -> dict:
    results = {}
    for shape_name, (out_features, in_features) in SHAPES.items():
        weights = _int4_weights(out_features, in_features)
        for num_rows in rows:
            x = torch.randn(num_rows, in_features).to(torch.bfloat16)  # [rows, in]
            calls = _int4_calls(*weights, x) | _int8_calls(out_features, in_features, x)
            key = f"{shape_name} {out_features}x{in_features} M={num_rows}"
            results[key] = _time_interleaved(calls, repeats)
            log(f"{key}: " + ", ".join(f"{n} {1e6 * s['median']:.1f} us"
                                       for n, s in results[key].items()))
    return results


def _decode_step(num_layers: int, repeats: int, rows: int) -> dict:
    """`rows` rows through num_layers distinct layers' linears + the lm_head, per kernel."""
    layers = [[_int4_weights(*SHAPES[name]) for name in LAYER_SHAPES] for _ in range(num_layers)]
    layers.append([_int4_weights(*SHAPES["lm_head"])])
    xs = {in_features: torch.randn(rows, in_features).to(torch.bfloat16)
          for in_features in (HIDDEN, SHAPES["down"][1])}
    step_calls = [_int4_calls(*weights, xs[weights[0].in_features])
                  for layer in layers for weights in layer]

    def whole_step(name):
        return lambda: [calls[name]() for calls in step_calls]

    names = step_calls[0].keys()
    timed = _time_interleaved({name: whole_step(name) for name in names}, repeats)
    log("decode step linears: " + ", ".join(f"{n} {1e3 * s['median']:.2f} ms"
                                            for n, s in timed.items()))
    return timed


def run_cpu_kernels(json_path=None, num_threads: int | None = 2, repeats: int = 15,
                    rows: tuple[int, ...] = (1, 16), num_layers: int = 30, step_rows: int = 1) -> dict:
    """Measure, print the tables, write the report to json_path (if given); returns the report."""
    threads = set_threads(num_threads)
    if cpu_native.native_extension() is None:
        log("native extension unavailable: only torch's kernels are measured")
    per_shape = _per_shape(tuple(rows), repeats)
    step = _decode_step(num_layers, max(3, repeats // 3), step_rows)
    kernels = ["native", "native_a8", "tinygemm", "bf16", "bf16_onednn", "native_int8", "int8pack"]
    table = [[key, *(fmt(stats.get(k), 1, 1e6) for k in kernels)]
             for key, stats in per_shape.items()]
    print_table(f"CPU GEMM time per call (us), {threads} threads, int4 group {GROUP_SIZE}",
                ["shape", *kernels], table)
    print_table(f"decode step linears, {num_layers} layers + lm_head, {step_rows} rows (ms)",
                ["kernel", "time"], [[k, fmt(s, 2, 1e3)] for k, s in step.items()])
    config = {"num_threads": threads, "repeats": repeats, "rows": list(rows),
              "group_size": GROUP_SIZE, "num_layers": num_layers, "step_rows": step_rows,
              "native_isa": getattr(cpu_native.native_extension(), "int4_kernel_isa",
                                    lambda: None)()}
    report = make_report("cpu_kernels", config, {"per_shape": per_shape, "decode_step": step})
    write_report(json_path, report)
    return report
