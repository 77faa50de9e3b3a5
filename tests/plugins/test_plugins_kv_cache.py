"""KV cache layout, sizing, quantization math and the CPU cache_write op against the reference."""

import subprocess
import sys

import pytest
import torch
from plugins_testlib import make_cache, poison_

from qkiln.errors import RecipeError
from qkiln.plugins import KV_DTYPES, allocate_kv_cache, cache_write, kv_bytes_per_block
from qkiln.plugins.kv_cache import dequantize_int4_groups, quantize_int4_groups
from qkiln.plugins.reference import reference_cache_write


def test_importing_plugins_does_not_import_triton():
    code = "import sys, qkiln.plugins; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bytes_per_block_matches_allocation(kv_dtype):
    caches = allocate_kv_cache(2, 3, 16, 2, 64, kv_dtype, group_size=32)
    per_block = sum(t.nbytes // t.shape[0] for c in caches for t in
                    (c.k, c.v, c.k_group_scale, c.k_group_min, c.v_group_scale, c.v_group_min)
                    if t is not None)
    assert kv_bytes_per_block(2, 16, 2, 64, kv_dtype, group_size=32) == per_block
    assert caches[0].head_dim == 64 and caches[0].block_size == 16


def test_bad_layouts_raise_recipe_errors():
    with pytest.raises(RecipeError, match="unknown kv cache dtype"):
        allocate_kv_cache(1, 2, 16, 2, 64, "int3")
    with pytest.raises(RecipeError, match="group_size"):
        kv_bytes_per_block(1, 16, 2, 64, "int4", group_size=48)


def test_int4_round_trip_within_half_a_step():
    x = torch.randn(40, 3, 64) * torch.rand(40, 3, 1) * 5
    x[0, 0, :32] = 1.25  # a constant group must come back exactly
    packed, scale, minimum = quantize_int4_groups(x, 32)
    assert packed.shape == (40, 3, 32) and packed.dtype == torch.uint8
    back = dequantize_int4_groups(packed, scale, minimum)
    step = scale.float().repeat_interleave(32, dim=-1)
    # Half a step plus the fp16 rounding of min (relative 2^-11).
    bound = step / 2 + minimum.float().abs().repeat_interleave(32, dim=-1) * 2 ** -10 + 1e-6
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[0, 0, :32], x[0, 0, :32])


def test_int4_matches_quant_kv_simulation_bit_for_bit():
    """The offline simulation (quant/kv.py, fp16 parameters) must see exactly what we store."""
    kv = pytest.importorskip("qkiln.quant.kv")
    x = torch.randn(50, 2, 64) * 3
    channel_scale = torch.rand(2, 64) + 0.5
    want_packed, want_scale, want_zero = kv.quantize_kv_int4(x, 32, channel_scale, "float16")
    packed, scale, minimum = quantize_int4_groups(x / channel_scale, 32)
    assert torch.equal(packed, want_packed)
    assert torch.equal(scale.float(), want_scale) and torch.equal(minimum.float(), want_zero)


def test_int4_saturates_past_fp16_instead_of_inf():
    """fp16 group parameters end at 65504: a group reaching past it must stay finite (its extreme
    codes saturate) instead of making attention over the whole sequence NaN; what fp16 min and
    scale can still reach (up to min + 15 * 65504) comes back within half a step."""
    kv = pytest.importorskip("qkiln.quant.kv")
    x = torch.randn(6, 2, 32)
    x[0, 0, 3], x[1, 1, 20], x[2, 0, :16] = 1e5, -3e5, 7e4  # outliers; a whole group past 65504
    x[3, 1, 7] = float("inf")
    packed, scale, minimum = quantize_int4_groups(x, 16)
    assert torch.isfinite(scale).all() and torch.isfinite(minimum).all()
    back = dequantize_int4_groups(packed, scale, minimum)
    assert torch.isfinite(back).all()
    assert back[1, 1, 20] == -65504 and back[3, 1, 7] > 65504  # saturated
    step = scale.float().repeat_interleave(16, dim=-1)
    bound = step / 2 + minimum.float().abs().repeat_interleave(16, dim=-1) * 2 ** -10 + 1e-6
    within = (back - x).abs() <= bound
    within[1, 1, 20] = within[3, 1, 7] = True
    assert within.all()
    want_packed, want_scale, want_zero = kv.quantize_kv_int4(x, 16, None, "float16")
    assert torch.equal(packed, want_packed)
    assert torch.equal(scale.float(), want_scale) and torch.equal(minimum.float(), want_zero)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cpu_cache_write_matches_reference_and_skips_padding(kv_dtype):
    has_kcs = kv_dtype in ("fp8", "int4")
    expected = make_cache(kv_dtype, 6, 2, 32, with_channel_scale=has_kcs)
    actual = make_cache(kv_dtype, 6, 2, 32, with_channel_scale=has_kcs)
    for name in ("k_scale", "v_scale", "k_channel_scale"):
        if getattr(expected, name) is not None:
            getattr(actual, name).copy_(getattr(expected, name))
    key, value = torch.randn(2, 11, 2, 32) * 2
    key[0, 1], value[3, 0, 5] = 1e5, -3e5  # past fp16: int4 saturates, fp16 stores inf
    slots = torch.randperm(6 * 16)[:11]
    slots[[2, 7]] = -1  # padding rows
    reference_cache_write(key, value, *expected.op_tensors(), slots)
    cache_write(key, value, actual, slots)
    for want, got in zip(expected.op_tensors(), actual.op_tensors()):
        if want is not None:
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    # Untouched slots keep their poison: nothing outside slot_mapping was written.
    written = torch.zeros(6 * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (actual.k.flatten(0, 1)[~written].view(torch.uint8) == 0xFF).all()
    assert (actual.v.flatten(0, 1)[~written].view(torch.uint8) == 0xFF).all()


@pytest.mark.parametrize("kv_dtype,bound", [("bf16", 2 ** -8), ("fp16", 2 ** -11),
                                            ("fp32", 0.0), ("fp8", 2 ** -4), ("int4", None)])
def test_cache_write_round_trip(kv_dtype, bound):
    cache = make_cache(kv_dtype, 4, 2, 32, with_channel_scale=kv_dtype == "int4")
    key = torch.randn(20, 2, 32) * 2
    if kv_dtype == "fp8":  # calibrated scales: the largest value maps to the fp8 maximum
        cache.k_scale.copy_(key.abs().amax(dim=(0, 2)) / 448)
    slots = torch.randperm(64)[:20]
    cache_write(key, key.clone(), cache, slots)
    flat = cache.k.flatten(0, 1)[slots]
    if kv_dtype == "int4":
        scale = cache.k_group_scale.flatten(0, 1)[slots].float().repeat_interleave(16, dim=-1)
        minimum = cache.k_group_min.flatten(0, 1)[slots].float().repeat_interleave(16, dim=-1)
        back = dequantize_int4_groups(flat, cache.k_group_scale.flatten(0, 1)[slots],
                                      cache.k_group_min.flatten(0, 1)[slots])
        # Half a step plus fp16 rounding of the min, in the smoothed domain, then scaled back.
        error = (back * cache.k_channel_scale - key).abs()
        assert (error <= (scale / 2 + minimum.abs() * 2 ** -10) * cache.k_channel_scale
                + 1e-5).all()
        return
    head_scale = cache.k_scale[:, None] if kv_dtype == "fp8" else torch.ones(2, 1)
    back = flat.float() * head_scale
    # Relative rounding bound, plus the subnormal spacing for fp8 (2^-9 of the scale).
    assert ((back - key).abs() <= key.abs() * bound + head_scale * 2 ** -9 * (kv_dtype == "fp8")
            + 1e-7).all()


def test_poison_fills_every_byte():
    t = torch.zeros(4, dtype=torch.bfloat16)
    poison_(t)
    assert torch.isnan(t).all()
