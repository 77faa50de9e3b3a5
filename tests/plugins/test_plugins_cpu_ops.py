"""qkiln's native CPU ops (csrc/cpu_attention.cpp, cpu_small_ops.cpp) against their plain-torch references.

Attention: the decode kernel computes in fp32 like cpu_attention.py's torch path, so against the
reference it must agree to plugins_testlib.TOLERANCE of the query dtype (fp32: 2e-5), on random
batches drawn fresh per run (lengths crossing block boundaries, GQA, unequal lengths) in float,
fp8 and int4 caches whose unused slots are poisoned (NaN; int4 code 15 with NaN scales), so
rel_error fails on any stray read. Cache writes: fp8 and int4 bytes (and int4's fp16 scales and
minimums) equal the torch quantizers' bit for bit, ties and saturation included.
Small ops: the kernels round where HF's eager code rounds, so SiLU-and-mul and RoPE are
bit-identical to the references in bf16/fp16. RMSNorm's fp32 sum of squares runs in another order
than torch's, which can move 1/rms by an fp32 ulp and so flip a rounding: norms may differ by two
ulps of the dtype (one ulp of the normalized value times the weight) on at most 1% of the values
(observed: <= 0.03%), and a 2-layer bf16 model by bf16 tolerance on >= 75% identical logits
(observed over 150 seeds: >= 97.7%, once 83.6%). fp32 RMSNorm differs by that order only, fp32 SiLU by torch's scalar exp on its
row tails: <= 1e-6 relative. Skips (saying why) when the extension cannot build.
"""

import math
import random

import pytest
import torch
from plugins_testlib import QUERY_DTYPE, TOLERANCE, PagedBatch, make_cache, rel_error

from qkiln.plugins import cache_write, cpu_native, ops, paged_attention
from qkiln.plugins.reference import reference_cache_write, reference_paged_attention
from qkiln.plugins.reference_small_ops import (reference_fused_add_rms_norm, reference_rms_norm,
                                               reference_rotary_embedding, reference_silu_and_mul)
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.model import CausalLM

HALF_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ext():
    module = cpu_native.native_ops()
    if module is None:
        pytest.skip("native CPU ops did not build (see the stderr line from cpu_native)")
    return module


def random_specs(num_seqs: int, block_size: int, prefill: bool):
    """Decode rows of random lengths (1 .. 5 blocks, some exactly on a block edge)."""
    lens = [random.choice([random.randint(1, 5 * block_size), block_size * random.randint(1, 4)])
            for _ in range(num_seqs)]
    specs = [(n, 1) for n in lens]
    if prefill:
        specs[len(specs) // 2] = (40, 40)
        specs.append((29, 7))
    return specs


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 4, 4), (32, 6, 2)])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32", "fp8", "int4"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_attention_matches_the_reference(ext, kv_dtype, head_dim, num_heads, num_kv_heads,
                                                block_size, prefill):
    cache = make_cache(kv_dtype, 80, num_kv_heads, head_dim, block_size=block_size)
    batch = PagedBatch(random_specs(random.randint(1, 6), block_size, prefill), cache, num_heads)
    args = batch.attention_args(cache, QUERY_DTYPE[kv_dtype])
    out = torch.ops.qkiln.paged_attention(*args)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    expected = reference_paged_attention(*args)
    assert rel_error(out, expected) < TOLERANCE[out.dtype]


@pytest.mark.parametrize("kv_dtype,group_size,head_dim", [("fp8", 16, 64), ("int4", 16, 64), ("int4", 8, 64),
                                                         ("int4", 64, 64), ("int4", 16, 32), ("int4", 8, 128),
                                                         ("int4", 4, 128)])
def test_quantized_caches_serve_bf16_queries(ext, kv_dtype, group_size, head_dim):
    """The serving case: bf16 activations over an fp8 or int4 cache (int4 groups smaller than,
    equal to and larger than a 16-float vector; K read as codes up to 16 groups a head, group 4 at
    D = 128 is 32 and takes the dequantizing path), decodes and a prefill chunk in one call."""
    cache = make_cache(kv_dtype, 60, 3, head_dim, group_size=group_size)
    batch = PagedBatch(random_specs(10, 16, prefill=True), cache, 9)
    args = batch.attention_args(cache, torch.bfloat16)
    out = torch.ops.qkiln.paged_attention(*args)
    assert out.dtype == torch.bfloat16 and rel_error(out, reference_paged_attention(*args)) < TOLERANCE[torch.bfloat16]


def test_attention_reads_a_strided_query_for_decode_and_prefill_rows(ext):
    cache = make_cache("bf16", 40, 2, 64)
    batch = PagedBatch([(50, 1), (40, 40), (17, 1), (29, 11)], cache, 6)
    qkv = torch.randn(batch.query.shape[0], 10, 64, dtype=torch.bfloat16)  # q heads, then 4 more
    qkv[:, :6] = batch.query.bfloat16()
    args = list(batch.attention_args(cache, torch.bfloat16))
    args[0] = qkv[:, :6]  # a view: rows at stride 10 * 64
    out = torch.full((qkv.shape[0], 6, 64), float("nan"))
    ext.paged_attention(args[0], cache.k, cache.v, batch.block_tables, batch.seq_lens,
                        batch.query_start_loc, batch.scale, out)
    assert rel_error(out, reference_paged_attention(*args).float()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32"])
def test_cache_write_matches_the_reference_and_skips_padding(ext, kv_dtype):
    native, reference = make_cache(kv_dtype, 6, 2, 64), make_cache(kv_dtype, 6, 2, 64)
    qkv = torch.randn(9, 8, 64, dtype=torch.bfloat16)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # views of a fused qkv output
    slots = torch.randperm(6 * 16)[:9]
    slots[3] = -1
    cache_write(key, value, native, slots)
    reference_cache_write(key, value, *reference.op_tensors(), slots)
    for a, b in ((native.k, reference.k), (native.v, reference.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN poison included


def e4m3_test_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties round to even) and the
    floats just either side of them, subnormals, the 2^-6 edge, saturation, inf and NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.full_like(mids, math.inf), torch.full_like(mids, -math.inf)
    edges = torch.tensor([2 ** -6, 2 ** -6 * 0.99, 2 ** -10, 1e-30, -1e-30, 0.0, -0.0, 447.9, 448.1,
                          460.0, 470.0, -600.0, math.inf, -math.inf, math.nan])
    return torch.cat([grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), edges])


@pytest.mark.parametrize("group_size", [2, 8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_cache_write_matches_the_quantizer_bit_for_bit(ext, dtype, group_size):
    """Codes, fp16 scales (rounded up) and minimums (rounded down) as kv_cache.quantize_int4_groups
    makes them, for keys with a few large channels and constant groups (scale at its floor)."""
    key = torch.randn(40, 3, 64) * 3
    key[:, :, 5] *= 40
    key[7] = 0.25
    key, value = key.to(dtype), (torch.randn(40, 3, 64) * 0.01).to(dtype)
    native, reference = (make_cache("int4", 6, 3, 64, group_size=group_size) for _ in range(2))
    slots = torch.randperm(6 * 16)[:40]
    slots[3] = -1
    cache_write(key, value, native, slots)
    reference_cache_write(key, value, *reference.op_tensors(), slots)
    for a, b in zip(native.op_tensors()[:8], reference.op_tensors()[:8]):
        assert a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_write_rounds_like_torch(ext, dtype):
    """clamp(x / scale, +-448) -> e4m3 in the kernel, bit for bit the torch quantizer's bytes."""
    values = e4m3_test_values()
    key = torch.randn(64, 3, 64) * 3
    key.view(-1)[:len(values)] = values
    key = key.to(dtype)
    value = (torch.rand(64, 3, 64) * 0.03 - 0.015).to(dtype)  # around the subnormal range
    native, reference = make_cache("fp8", 6, 3, 64), make_cache("fp8", 6, 3, 64)
    native.k_scale.fill_(1.0)  # the grid as is; v_scale stays random
    reference.k_scale.fill_(1.0)
    reference.v_scale.copy_(native.v_scale)
    slots = torch.randperm(6 * 16)[:64]
    slots[5] = -1
    cache_write(key, value, native, slots)
    reference_cache_write(key, value, *reference.op_tensors(), slots)
    for a, b in ((native.k, reference.k), (native.v, reference.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def within_two_ulps_mostly(a: torch.Tensor, b: torch.Tensor, max_fraction: float = 0.01) -> bool:
    """Equal except on <= max_fraction of the values, which are within two ulps of the dtype (a
    one-ulp change of the normalized value, times a weight of up to 2)."""
    differs = a != b
    ulp = 2 * torch.finfo(a.dtype).eps * b.float().abs()
    one_ulp = ((a.float() - b.float()).abs() <= ulp) | ~differs
    return a.dtype == b.dtype and bool(one_ulp.all()) and differs.float().mean().item() <= max_fraction


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (3, 100)])
def test_norms_match_the_reference_to_two_ulps(ext, dtype, rows, hidden):
    x, residual = (torch.randn(rows, hidden) * 3).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    assert within_two_ulps_mostly(ops.rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))
    x_native, r_native, x_ref, r_ref = x.clone(), residual.clone(), x.clone(), residual.clone()
    ops.fused_add_rms_norm(x_native, r_native, weight, 1e-5)
    reference_fused_add_rms_norm(x_ref, r_ref, weight, 1e-5)
    assert same_bits(r_native, r_ref)  # the residual add is exact
    assert within_two_ulps_mostly(x_native, x_ref)


def test_fp32_norm_differs_only_by_summation_order(ext):
    x, weight = torch.randn(8, 576), torch.rand(576) + 0.5
    assert rel_error(ops.rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6)) < 1e-6


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32])
@pytest.mark.parametrize("shape", [(1, 3072), (5, 7, 200), (4, 34)])
def test_silu_and_mul_is_bit_identical_to_the_reference(ext, dtype, shape):
    gate_up = (torch.randn(shape) * 4).to(dtype)
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    if dtype != torch.float32:
        assert same_bits(out, reference_silu_and_mul(gate_up))
    else:  # torch's own fp32 tail (width % 16) uses std::exp, so the last bits may differ
        assert rel_error(out, reference_silu_and_mul(gate_up)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 49152), (3, 37), (1, 16)])
def test_scale_columns_is_torchs_mul(ext, dtype, shape):
    """The int8 head's per-channel scale, in place: the bits of torch's x.mul_(fp32 scales)."""
    x = (torch.randn(shape) * 30).to(dtype)
    scales = torch.rand(shape[1]) / 100
    expected = x.clone().mul_(scales)
    actual = cpu_native.scale_columns_(x, scales)
    assert actual.data_ptr() == x.data_ptr() and torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_embedding_is_bit_identical_to_the_reference(ext, dtype, head_dim):
    qkv = torch.randn(6, 15, head_dim).to(dtype)  # 9 q + 3 k heads rotated, 3 v heads not
    cos, sin = torch.randn(2, 6, 1, head_dim).to(dtype)
    native, expected = qkv.clone(), qkv.clone()
    ops.rotary_embedding(native, cos, sin, 12)
    reference_rotary_embedding(expected, cos, sin, 12)
    assert same_bits(native, expected) and same_bits(native[:, 12:], qkv[:, 12:])


def tiny_config(qk_norm: bool) -> ModelConfig:
    return ModelConfig("qwen3" if qk_norm else "llama", vocab_size=97, hidden_size=96,
                       intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=16, qk_norm=qk_norm)


@pytest.mark.parametrize("fused,qk_norm", [(True, False), (False, False), (True, True)])
def test_bf16_model_gives_the_same_logits_with_or_without_the_fused_ops(ext, fused, qk_norm):
    config = tiny_config(qk_norm)
    names = {f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    model = CausalLM(config, fused=names if fused else frozenset()).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5)
    ids = torch.randint(0, 97, (2, 11))
    with torch.inference_mode():
        previous = cpu_native.use_native_ops(False)
        expected = model(ids)
        cpu_native.use_native_ops(True)
        actual = model(ids)
        cpu_native.use_native_ops(previous)
    assert rel_error(actual, expected) < TOLERANCE[torch.bfloat16]
    # Mostly identical: over 150 seeds 149 had >= 97.7% identical logits; in one (83.6%) an early
    # norm's one-ulp flip carried through both layers (a CI run drew such a case at 85.4%).
    assert (actual == expected).float().mean().item() >= 0.75


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int4"])
def test_paged_attention_front_door_uses_the_native_decode(ext, kv_dtype):
    cache = make_cache(kv_dtype, 20, 3, 64)
    batch = PagedBatch([(33, 1), (16, 1)], cache, 9)
    query = batch.query.bfloat16()
    out = paged_attention(query, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale)
    previous = cpu_native.use_native_ops(False)
    torch_out = paged_attention(query, cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, batch.scale)
    cpu_native.use_native_ops(previous)
    assert rel_error(out, torch_out) < TOLERANCE[torch.bfloat16]


def test_portable_build_ops_match_the_references(ext):
    """The vector fallback (a build without AVX-512, cached after once: vec.h's AVX2 halves where
    the compiler targets AVX2, else plain C++) gives the same small-op results and decode
    attention as the references."""
    portable = cpu_native.build_portable_extension()
    x, w = torch.randn(5, 72).to(torch.bfloat16), torch.randn(72).to(torch.bfloat16)
    assert rel_error(portable.rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)) < 1e-2
    gate_up = torch.randn(3, 2 * 40).to(torch.bfloat16)
    assert torch.equal(portable.silu_and_mul(gate_up), reference_silu_and_mul(gate_up))
    qkv, cos, sin = torch.randn(4, 3, 32), torch.randn(4, 32), torch.randn(4, 32)
    expected = qkv.clone()
    reference_rotary_embedding(expected, cos, sin, 2)
    portable.rotary_embedding(qkv, cos, sin, 2)
    torch.testing.assert_close(qkv, expected, rtol=1e-6, atol=1e-6)
    cache = make_cache("fp32", 40, 2, 32, block_size=5)
    batch = PagedBatch(random_specs(3, 5, prefill=True), cache, 6)
    args = batch.attention_args(cache, torch.float32)
    query, (tables, lens, starts, scale) = args[0], args[-4:]
    out = torch.empty_like(query)
    portable.paged_attention(query, cache.k, cache.v, tables, lens, starts, scale, out)
    expected = reference_paged_attention(*args)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


def _quant_params(cache):
    """A cache's k/v scales (fp8) and group scales / minimums (int4), as the native ops take them."""
    return (cache.k_scale, cache.v_scale, cache.k_group_scale, cache.k_group_min, cache.v_group_scale,
            cache.v_group_min)


def test_portable_build_serves_quantized_caches(ext):
    """fp8 and int4 caches through the build without AVX-512: attention against the reference, writes
    bit for bit (the fp8 edge values; int4 on the same values with NaN and inf made finite)."""
    portable = cpu_native.build_portable_extension()
    cache = make_cache("fp8", 40, 2, 32, block_size=5)
    args = PagedBatch(random_specs(3, 5, prefill=True), cache, 6).attention_args(cache, torch.float32)
    portable.paged_attention(args[0], cache.k, cache.v, *args[-4:], out := torch.empty_like(args[0]),
                             *_quant_params(cache))
    assert rel_error(out, reference_paged_attention(*args)) < TOLERANCE[torch.float32]
    key = e4m3_test_values().view(-1, 2, 32)  # 1024 values: 16 rows
    written, expected_cache = make_cache("fp8", 4, 2, 32), make_cache("fp8", 4, 2, 32)
    for c in (written, expected_cache):
        c.k_scale.fill_(1.0), c.v_scale.fill_(0.5)
    slots = torch.randperm(64)[:key.shape[0]]
    portable.cache_write(key, key, written.k, written.v, slots, *_quant_params(written))
    reference_cache_write(key, key, *expected_cache.op_tensors(), slots)
    assert torch.equal(written.k.view(torch.uint8), expected_cache.k.view(torch.uint8))
    assert torch.equal(written.v.view(torch.uint8), expected_cache.v.view(torch.uint8))
    cache = make_cache("int4", 40, 2, 32, block_size=5)
    args = PagedBatch(random_specs(3, 5, prefill=True), cache, 6).attention_args(cache, torch.float32)
    portable.paged_attention(args[0], cache.k, cache.v, *args[-4:], out := torch.empty_like(args[0]),
                             *_quant_params(cache))
    assert rel_error(out, reference_paged_attention(*args)) < TOLERANCE[torch.float32]
    written, expected_cache = make_cache("int4", 4, 2, 32), make_cache("int4", 4, 2, 32)
    value = torch.randn(key.shape)
    portable.cache_write(key.nan_to_num(0, 448, -448), value, written.k, written.v, slots,
                         *_quant_params(written))
    reference_cache_write(key.nan_to_num(0, 448, -448), value, *expected_cache.op_tensors(), slots)
    for a, b in zip(written.op_tensors()[:8], expected_cache.op_tensors()[:8]):
        assert a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
