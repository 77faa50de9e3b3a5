"""torch.library.opcheck on every qkiln op (schema, fake kernel, autograd registration, AOT)."""

import pytest
import torch
from plugins_testlib import PagedBatch, make_cache

from qkiln.plugins import prepare_fp8_w8a8, prepare_w4a16, prepare_w8a16


def _clean_cache(kv_dtype):
    """opcheck compares repeated runs, so start from zeros rather than NaN poison."""
    cache = make_cache(kv_dtype, 8, 1, 16, group_size=8, with_channel_scale=kv_dtype == "int4")
    for t in (cache.k, cache.v, cache.k_group_scale, cache.k_group_min, cache.v_group_scale,
              cache.v_group_min):
        if t is not None:
            t.zero_()
    return cache


@pytest.mark.parametrize("kv_dtype", ["bf16", "int4"])
def test_opcheck_cache_ops(kv_dtype):
    cache = _clean_cache(kv_dtype)
    batch = PagedBatch([(5, 2), (3, 1)], cache, num_heads=2)
    torch.library.opcheck(torch.ops.qkiln.paged_attention.default,
                          batch.attention_args(cache, torch.float32))
    key, value = torch.randn(2, 3, 1, 16)
    torch.library.opcheck(torch.ops.qkiln.cache_write.default,
                          (key, value, *cache.op_tensors(), torch.tensor([0, -1, 37])))


def test_opcheck_linear_ops():
    qweight = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    w = prepare_w4a16(qweight, torch.rand(16, 2), torch.rand(16, 2) * 15, 32, "cpu")
    x = torch.randn(2, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.qkiln.w4a16_linear.default,
                          (x, w.packed, w.scales, w.zeros, w.group_size, 64, 16, None, None))
    w8 = prepare_w8a16(torch.randint(-128, 128, (16, 64), dtype=torch.int8), torch.rand(16), "cpu")
    torch.library.opcheck(torch.ops.qkiln.w8a16_linear.default, (x, w8.weight, w8.scales, None, None))
    fp8 = prepare_fp8_w8a8(torch.randn(16, 64).to(torch.float8_e4m3fn), torch.rand(16), "cpu")
    # opcheck traces with fake tensors, which cannot stand for a weight pre-packed for oneDNN (an
    # opaque MkldnnCPU tensor): check the op with the plain bf16 weight it was packed from.
    plain = fp8.weight.to_dense() if fp8.weight.is_mkldnn else fp8.weight
    torch.library.opcheck(torch.ops.qkiln.fp8_w8a8_linear.default,
                          (x, plain, fp8.weight_scale, torch.randn(16)))
    torch.library.opcheck(torch.ops.qkiln.fp8_w8a8_linear.default,
                          (x, plain, fp8.weight_scale, None, torch.tensor(0.01)))
