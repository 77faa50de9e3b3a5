"""Triton kernels against the reference: on the GPU when there is one, else under TRITON_INTERPRET.

The interpreter is slow, so shapes stay tiny (head_dim 32, contexts of at most 2 blocks of 16).
It truncates fp32 -> bf16 instead of rounding, and its fp8 is not trusted: fp8 runs only on GPU.
"""

import pytest
import torch
from plugins_testlib import QUERY_DTYPE, TOLERANCE, PagedBatch, make_cache, poison_, rel_error

from qkiln.plugins import prepare_w4a16, prepare_w8a16
from qkiln.plugins.reference import (reference_cache_write, reference_paged_attention,
                                     reference_w4a16_linear, reference_w8a16_linear)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_DTYPES = ["bf16", "fp32", "int4"] + (["fp8"] if DEVICE == "cuda" else [])
MIXED = [(20, 20), (31, 1), (17, 5), (16, 1)]  # prefill, decode, chunk, decode at a block edge
DECODE = [(31, 1), (16, 1), (5, 1)]


@pytest.fixture(scope="module")
def kernels():
    from qkiln.plugins import triton_attention, triton_kv, triton_w4a16

    if DEVICE == "cpu" and not triton_kv.is_interpreter():
        pytest.skip("no GPU and the Triton kernels were imported without TRITON_INTERPRET=1")
    return triton_attention, triton_kv, triton_w4a16


def _query_dtype(kv_dtype):
    """Real GPU runs use bf16 queries over quantized caches, as serving does."""
    if DEVICE == "cuda" and kv_dtype in ("fp8", "int4"):
        return torch.bfloat16
    return QUERY_DTYPE[kv_dtype]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_triton_attention_matches_reference(kernels, kv_dtype, group):
    query_dtype = _query_dtype(kv_dtype)
    for specs, partition_sizes in ((MIXED, [None]), (DECODE, [None, 16])):
        cache = make_cache(kv_dtype, 8, 2, 32, with_channel_scale=kv_dtype in ("fp8", "int4"))
        batch = PagedBatch(specs, cache, num_heads=2 * group, device=DEVICE)
        args = batch.attention_args(cache, query_dtype)
        expected = reference_paged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in args))
        for partition_size in partition_sizes:  # 16: several partitions and the reduce kernel
            out = torch.full_like(args[0], float("nan"))  # every row must be written
            kernels[0].triton_paged_attention(*args, partition_size=partition_size, out=out)
            assert rel_error(out.cpu(), expected) < TOLERANCE[query_dtype]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_triton_a_non_finite_value_reaches_only_the_rows_that_see_it(kernels, kv_dtype):
    """One position's overflowed V (NaN) made the earlier rows of its prefill tile NaN too (their p
    for it is 0, but 0 * NaN is NaN), and the prefix cache kept their KV."""
    cache = make_cache(kv_dtype, 8, 2, 32)
    batch = PagedBatch([(20, 12), (9, 1)], cache, num_heads=4, device=DEVICE)  # a chunk after 8 cached, a decode
    bad = int(batch.block_tables[0, 0]) * 16 + 15  # position 15 of the chunk's sequence
    cache.v[bad // 16, bad % 16, 1] = float("nan")  # kv head 1 only
    args = batch.attention_args(cache, QUERY_DTYPE[kv_dtype])
    out = kernels[0].triton_paged_attention(*args).cpu()
    rows_before, rows_after = out[:15 - 8], out[15 - 8:12]  # query rows of positions 8..14, 15..19
    assert torch.isfinite(rows_before).all() and torch.isfinite(out[12:]).all()
    assert torch.isnan(rows_after[:, 2:]).all() and torch.isfinite(rows_after[:, :2]).all()  # heads of kv 1


def test_triton_int4_attention_with_non_power_of_two_head_dim(kernels):
    """head_dim 48 (3 groups of 16) takes the general tile loader, not the reshape one."""
    cache = make_cache("int4", 8, 1, 48, with_channel_scale=True)
    batch = PagedBatch([(21, 1), (9, 1)], cache, num_heads=2, device=DEVICE)
    args = batch.attention_args(cache, torch.float32)
    expected = reference_paged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    out = torch.full_like(args[0], float("nan"))
    kernels[0].triton_paged_attention(*args, out=out)
    assert rel_error(out.cpu(), expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_triton_cache_write_matches_reference(kernels, kv_dtype):
    has_kcs = kv_dtype in ("fp8", "int4")
    expected = make_cache(kv_dtype, 4, 2, 32, with_channel_scale=has_kcs)
    actual = make_cache(kv_dtype, 4, 2, 32, with_channel_scale=has_kcs)
    for name in ("k_scale", "v_scale", "k_channel_scale"):
        if getattr(expected, name) is not None:
            getattr(actual, name).copy_(getattr(expected, name))
    key, value = torch.randn(2, 9, 2, 32) * 2
    key[0, 1], value[3, 0, 5] = 1e5, -3e5  # past fp16: int4 saturates, fp16 stores inf
    slots = torch.randperm(64)[:9]
    slots[4] = -1
    reference_cache_write(key, value, *expected.op_tensors(), slots)
    tensors = [t.to(DEVICE) if t is not None else None for t in actual.op_tensors()]
    kernels[1].triton_cache_write(key.to(DEVICE), value.to(DEVICE), *tensors, slots.to(DEVICE))
    for want, got in zip(expected.op_tensors(), tensors):
        if want is None:
            continue
        got = got.cpu()
        if want.dtype == torch.bfloat16 and DEVICE == "cpu":
            # The interpreter truncates to bf16: one ulp (2^-7 relative) at most.
            both = torch.isfinite(want)
            assert torch.equal(both, torch.isfinite(got))
            assert ((want[both].float() - got[both].float()).abs()
                    <= want[both].float().abs() * 2 ** -7).all()
        else:  # same formula, IEEE division, same rounding: the same bytes
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


def _canonical_int4(out_features, in_features, group_size, is_symmetric):
    num_groups = -(-in_features // group_size)
    scales = torch.rand(out_features, num_groups) * 0.02 + 0.005
    if is_symmetric:
        return torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8), scales, None
    return (torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8), scales,
            torch.rand(out_features, num_groups) * 15)


@pytest.mark.parametrize("is_symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size,in_features", [(32, 96), (64, 192), (128, 576)])
def test_triton_w4a16_matches_reference(kernels, group_size, in_features, is_symmetric):
    """in=576 with group 128 ends in a 64-wide group (SmolLM2's hidden size)."""
    qweight, scales, zeros = _canonical_int4(24, in_features, group_size, is_symmetric)
    x = torch.randn(3, in_features)
    expected = reference_w4a16_linear(x, qweight, scales, zeros, group_size)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = prepare_w4a16(qweight.to(DEVICE), scales.to(DEVICE),
                      zeros.to(DEVICE) if zeros is not None else None, group_size, "cuda",
                      dtype=dtype)
    out = torch.full((3, 24), float("nan"), dtype=dtype, device=DEVICE)
    kernels[2].triton_wna16_linear(x.to(DEVICE, dtype), w.packed, w.scales, w.zeros, group_size,
                                   4, in_features, 24, out=out)
    assert rel_error(out.cpu(), expected) < TOLERANCE[dtype]


def test_triton_w8a16_matches_reference(kernels):
    qweight = torch.randint(-128, 128, (24, 80), dtype=torch.int8)
    scales = torch.rand(24) * 0.01 + 0.001
    bias = torch.randn(24)
    x = torch.randn(2, 80)
    w = prepare_w8a16(qweight, scales, "cuda")
    out = kernels[2].triton_wna16_linear(x.to(DEVICE), w.weight.to(DEVICE), w.scales.to(DEVICE),
                                         None, 128, 8, 80, 24, bias=bias.to(DEVICE))
    expected = reference_w8a16_linear(x, qweight, scales, bias)
    assert rel_error(out.cpu(), expected) < TOLERANCE[torch.float32]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_poisoned_cache_reaches_the_output(kernels):
    """Guard for the tests above: a NaN cache really does reach the output if read unmasked."""
    cache = make_cache("fp32", 4, 1, 32)
    batch = PagedBatch([(5, 1)], cache, num_heads=1, device=DEVICE)
    poison_(cache.k[batch.block_tables[0, 0].long()])  # the sequence's own block
    out = kernels[0].triton_paged_attention(*batch.attention_args(cache, torch.float32))
    assert torch.isnan(out).all()


def test_triton_ops_refuse_shapes_that_would_index_past_the_cache(kernels):
    """A query or key whose head_dim is not the cache's: a ValueError before any launch (on a GPU
    the kernels would read or write past each cache row), as the reference raises."""
    cache = make_cache("fp32", 4, 2, 32)
    batch = PagedBatch([(9, 1), (5, 1)], cache, num_heads=4, device=DEVICE)
    args = list(batch.attention_args(cache, torch.float32))
    args[0] = torch.randn(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 64 but the cache holds 32"):
        kernels[0].triton_paged_attention(*args)
    before = cache.k.clone()
    key = torch.randn(3, 2, 48, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[tokens, 2, 32\]"):
        kernels[1].triton_cache_write(key, key, *cache.op_tensors(), torch.arange(3, device=DEVICE))
    assert torch.equal(before.view(torch.uint8), cache.k.view(torch.uint8))


def test_triton_attention_takes_a_query_with_strided_channels(kernels):
    cache = make_cache("fp32", 8, 1, 32)
    batch = PagedBatch([(11, 3), (6, 1)], cache, num_heads=2, device=DEVICE)
    args = list(batch.attention_args(cache, torch.float32))
    expected = reference_paged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    args[0] = args[0].transpose(0, 2).contiguous().transpose(0, 2)  # stride(-1) != 1
    assert rel_error(kernels[0].triton_paged_attention(*args).cpu(), expected) < TOLERANCE[torch.float32]


def test_gpu_int4_cache_with_a_group_the_gpu_cannot_write_is_refused_when_made():
    """Allocated for CUDA (not run: the check is before any tensor exists), a group of 10 in a
    head_dim 80 is refused naming the power-of-two sizes that divide 80."""
    from qkiln.errors import RecipeError
    from qkiln.plugins import allocate_kv_cache

    with pytest.raises(RecipeError, match="group_size 4 or 8 or 16$"):
        allocate_kv_cache(1, 2, 16, 1, 80, "int4", 10, device="cuda")
