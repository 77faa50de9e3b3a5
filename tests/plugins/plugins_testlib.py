"""Shared builders for the plugins tests: random paged batches, poisoned caches, error metric."""

import torch

from qkiln.plugins import allocate_kv_cache
from qkiln.plugins.reference import dequantize_grouped, reference_cache_write

QUERY_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
               "fp8": torch.float32, "int4": torch.float32}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "output has NaN/inf: a row was not written or read poison"
    error = (actual.double() - expected.double()).abs().max()
    return (error / expected.double().abs().max()).item()


def poison_(t: torch.Tensor | None) -> None:
    """Fill every byte with 0xFF: NaN for bf16/fp16/fp32/fp8 e4m3fn, q=15 for packed int4."""
    if t is not None:
        t.view(torch.uint8).fill_(0xFF)


def make_cache(kv_dtype, num_blocks, num_kv_heads, head_dim, device="cpu", group_size=16,
               block_size=16, with_channel_scale=False):
    """A poisoned single-layer cache with random static scales where the dtype has them."""
    cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, kv_dtype,
                              group_size, device, has_k_channel_scale=with_channel_scale)[0]
    for t in (cache.k, cache.v, cache.k_group_scale, cache.k_group_min, cache.v_group_scale,
              cache.v_group_min):
        poison_(t)
    if kv_dtype == "fp8":  # K/V below are ~N(0, 2): a scale of 0.02 saturates beyond 9 (4.5 sigma)
        cache.k_scale.copy_(torch.rand(num_kv_heads) * 0.02 + 0.02)
        cache.v_scale.copy_(torch.rand(num_kv_heads) * 0.02 + 0.02)
    if with_channel_scale:
        cache.k_channel_scale.copy_(torch.rand(num_kv_heads, head_dim) * 1.5 + 0.5)
    return cache


class PagedBatch:
    """Sequences (ctx_len, q_len), shuffled block tables (padding -1), K/V already written."""

    def __init__(self, specs, cache, num_heads, device="cpu"):
        block_size, num_kv_heads, head_dim = cache.block_size, cache.num_kv_heads, cache.head_dim
        num_blocks_needed = [-(-ctx // block_size) for ctx, _ in specs]
        max_blocks = max(num_blocks_needed) + 1  # one spare column of padding
        ids = torch.randperm(cache.num_blocks)[:sum(num_blocks_needed)].tolist()
        self.block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
        slots = []
        for s, ((ctx, _), n) in enumerate(zip(specs, num_blocks_needed)):
            row = [ids.pop() for _ in range(n)]
            self.block_tables[s, :n] = torch.tensor(row, dtype=torch.int32)
            slots += [row[p // block_size] * block_size + p % block_size for p in range(ctx)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32)
        q_lens = torch.tensor([q for _, q in specs])
        self.query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
        num_tokens = int(q_lens.sum())
        self.key = torch.randn(len(slots), num_kv_heads, head_dim) * 2  # the whole context
        self.value = torch.randn(len(slots), num_kv_heads, head_dim) * 2
        self.query = torch.randn(num_tokens, num_heads, head_dim)
        self.scale = head_dim ** -0.5
        self.device = device
        reference_cache_write(self.key, self.value, *cache.op_tensors(), self.slot_mapping)

    def attention_args(self, cache, query_dtype):
        """Flat arguments of paged_attention for this batch, on the batch's device."""
        to = lambda t: t.to(self.device)  # noqa: E731
        return (to(self.query.to(query_dtype)), *(to(t) if t is not None else None
                                                   for t in cache.op_tensors()),
                to(self.block_tables), to(self.seq_lens), to(self.query_start_loc), self.scale)


MIXED = [(37, 37), (50, 1), (33, 9), (16, 1), (5, 1)]  # prefill, decodes, a chunk, full block
DECODE = [(50, 1), (16, 1), (5, 1), (31, 1)]


def canonical_int4(out_features, in_features, group_size, is_symmetric):
    """Random canonical int4 weights (see packed_weights.py) with realistic scales."""
    num_groups = -(-in_features // group_size)
    scales = torch.rand(out_features, num_groups) * 0.02 + 0.005
    if is_symmetric:
        return torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8), scales, None
    qweight = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    return qweight, scales, torch.rand(out_features, num_groups) * 15


FP32_SLACK = 1e-5  # of sum |w| |x|: a kernel's fp32 scaling, group sums and zero term


def half_ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = 8 if dtype == torch.bfloat16 else 11  # significant bits
    exponent = torch.frexp(v.abs().clamp_min(1e-30))[1].double()  # |v| < 2^exponent
    return torch.exp2(exponent - 1 - bits)


def fixed_point_bound(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """[rows, out]: sum over activations of half a fixed-point step times |w|."""
    bound = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], group):
        seg = x[:, k0:k0 + group].double()
        exponent = torch.frexp(seg.abs().amax(dim=1))[1].double()  # amax < 2^exponent
        step = torch.exp2(exponent - 15)
        bound += (step / 2)[:, None] * weight[:, k0:k0 + group].abs().sum(dim=1)[None, :]
    return bound


def fixed16_compiled(module) -> bool:
    """Whether a build of the native kernels runs bf16 / fp16 rows as 16-bit fixed point
    (csrc/cpu_gemv_fixed16.cpp: AVX2 without AVX512-BF16, where the int4 kernel is "avx2")."""
    return module.int4_kernel_isa() == "avx2"


def assert_within_fixed_point_bound(actual, x, weight, bias, group, exact_activations=False, slack=FP32_SLACK):
    """actual (a native GEMV's output for x, weight [out, K] in fp64) against the fp64 value:
    within half an ulp of x's dtype, fp32 slack and, unless exact_activations, the fixed-point
    bound of groups of `group` channels (cpu_gemv_fixed16.cpp)."""
    exact = x.double() @ weight.t() + bias.double()
    allowed = half_ulp(exact, x.dtype) + slack * (x.double().abs() @ weight.abs().t())
    if not exact_activations:
        allowed += fixed_point_bound(x, weight, group)
    error = (actual.double() - exact).abs()
    worst = (error / allowed).max().item()
    assert worst <= 1.0, f"an output is {worst:.2f}x its bound off the exact value"


def assert_int4_within_bound(actual, x, qweight, scales, zeros, group, bias, exact_activations=False,
                             slack=FP32_SLACK):
    """assert_within_fixed_point_bound for a canonical int4 weight."""
    weight = dequantize_grouped(qweight, scales.double(), None if zeros is None else zeros.double(),
                                group).double()
    assert_within_fixed_point_bound(actual, x, weight, bias, group, exact_activations, slack)
