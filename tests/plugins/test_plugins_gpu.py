"""CUDA-only checks: the registered ops on real shapes (Llama-3-8B heads), fp8, CUDA graphs.

Skipped without a GPU. The reference runs on the same cache tensors, copied to the CPU.
"""

import pytest
import torch
from plugins_testlib import TOLERANCE, rel_error

from qkiln.plugins import (allocate_kv_cache, cache_write, fp8_w8a8_linear, paged_attention,
                           prepare_fp8_w8a8, prepare_w4a16, prepare_w8a16, w4a16_linear,
                           w8a16_linear)
from qkiln.plugins.cpu_attention import cpu_cache_write
from qkiln.plugins.reference import (reference_fp8_w8a8_linear, reference_paged_attention,
                                     reference_w4a16_linear, reference_w8a16_linear)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _batch(specs, num_blocks):
    """Block tables, slot mapping of all context tokens, seq_lens, query_start_loc (CPU int)."""
    ids = torch.randperm(num_blocks)
    max_blocks = max(-(-ctx // BLOCK_SIZE) for ctx, _ in specs)
    tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    slots, used = [], 0
    for s, (ctx, _) in enumerate(specs):
        n = -(-ctx // BLOCK_SIZE)
        tables[s, :n] = ids[used:used + n].to(torch.int32)
        used += n
        positions = torch.arange(ctx)
        blocks = tables[s, positions // BLOCK_SIZE].long()
        slots.append(blocks * BLOCK_SIZE + positions % BLOCK_SIZE)
    seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32)
    q_lens = torch.tensor([q for _, q in specs])
    qsl = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    return tables, torch.cat(slots), seq_lens, qsl


def _check_attention(kv_dtype, specs, num_blocks=600):
    cache = allocate_kv_cache(1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_dtype, 32,
                              "cuda", has_k_channel_scale=kv_dtype == "int4")[0]
    if kv_dtype == "fp8":
        cache.k_scale.copy_(torch.rand(NUM_KV_HEADS) * 0.01 + 0.02)
        cache.v_scale.copy_(torch.rand(NUM_KV_HEADS) * 0.01 + 0.02)
    if kv_dtype == "int4":
        cache.k_channel_scale.copy_(torch.rand(NUM_KV_HEADS, HEAD_DIM) + 0.5)
    tables, slots, seq_lens, qsl = _batch(specs, num_blocks)
    key, value = (torch.randn(2, len(slots), NUM_KV_HEADS, HEAD_DIM, device="cuda") * 2
                  ).to(torch.bfloat16)
    cache_write(key, value, cache, slots.cuda())
    # The CUDA write equals the CPU write byte for byte.
    cpu_tensors = [t.cpu() if t is not None else None for t in cache.op_tensors()]
    fresh = [t.clone() if t is not None else None for t in cpu_tensors]
    cpu_cache_write(key.cpu(), value.cpu(), *fresh, slots)
    for got, want in zip(cpu_tensors, fresh):
        if got is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    query = torch.randn(int(qsl[-1]), NUM_HEADS, HEAD_DIM).to(torch.bfloat16)
    out = paged_attention(query.cuda(), cache, tables.cuda(), seq_lens.cuda(), qsl.cuda(),
                          HEAD_DIM ** -0.5)
    expected = reference_paged_attention(query, *cpu_tensors, tables, seq_lens, qsl,
                                         HEAD_DIM ** -0.5)
    assert rel_error(out.cpu(), expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "int4"])
def test_gpu_mixed_batch_llama8b_heads(kv_dtype):
    _check_attention(kv_dtype, [(700, 700), (1000, 1), (333, 77), (16, 1), (1, 1), (65, 64)])


@pytest.mark.parametrize("kv_dtype", ["bf16", "int4"])
def test_gpu_decode_batch_many_partitions(kv_dtype):
    """6 sequences x 8 kv heads leave SMs idle: the context splits into several partitions."""
    specs = [(int(n), 1) for n in torch.randint(1, 2048, (6,))] + [(2048, 1)]
    _check_attention(kv_dtype, specs, num_blocks=7 * 128)


def test_gpu_decode_replays_in_a_cuda_graph():
    """Static buffers, no host sync: capture once, change lengths and tables, replay."""
    cache = allocate_kv_cache(1, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "bf16", 32, "cuda")[0]
    cache.k.normal_()
    cache.v.normal_()
    num_seqs, max_blocks = 4, 8
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(64, device="cuda")[:num_seqs * max_blocks].view(num_seqs, -1).int()
    seq_lens = torch.full((num_seqs,), 5, dtype=torch.int32, device="cuda")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    paged_attention(query, cache, tables, seq_lens, qsl, 0.1)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(query, cache, tables, seq_lens, qsl, 0.1)
    for lens in ([1, 17, 128, 77], [100, 3, 16, 33]):
        seq_lens.copy_(torch.tensor(lens))
        tables.copy_(torch.randperm(64, device="cuda")[:num_seqs * max_blocks].view(num_seqs, -1))
        query.normal_()
        graph.replay()
        expected = reference_paged_attention(query.cpu(), *(t.cpu() if t is not None else None
                                                            for t in cache.op_tensors()),
                                             tables.cpu(), seq_lens.cpu(), qsl.cpu(), 0.1)
        assert rel_error(out.cpu(), expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 16, 100])
@pytest.mark.parametrize("out_features,in_features,group_size,is_symmetric",
                         [(4096, 4096, 128, True), (1536, 576, 128, False), (576, 1536, 64, True),
                          (14336, 4096, 128, False)])
def test_gpu_w4a16_op(rows, out_features, in_features, group_size, is_symmetric):
    num_groups = -(-in_features // group_size)
    scales = torch.rand(out_features, num_groups, device="cuda") * 0.02 + 0.005
    if is_symmetric:
        qweight = torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8, device="cuda")
        zeros = None
    else:
        qweight = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8,
                                device="cuda")
        zeros = torch.rand(out_features, num_groups, device="cuda") * 15
    x = torch.randn(rows, in_features, device="cuda").to(torch.bfloat16)
    bias = torch.randn(out_features, device="cuda").to(torch.bfloat16)
    weight = prepare_w4a16(qweight, scales, zeros, group_size, "cuda")
    expected = reference_w4a16_linear(x.float(), qweight, scales, zeros, group_size, bias.float())
    assert rel_error(w4a16_linear(x, weight, bias).float(), expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_w8a16_and_fp8_ops(rows):
    w = torch.randn(2048, 1024, device="cuda")
    x = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16)
    int8_scale = w.abs().amax(dim=1) / 127
    qweight = (w / int8_scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    actual = w8a16_linear(x, prepare_w8a16(qweight, int8_scale, "cuda"))
    expected = reference_w8a16_linear(x.float(), qweight, int8_scale)
    assert rel_error(actual.float(), expected) < TOLERANCE[torch.bfloat16]
    fp8_scale = w.abs().amax(dim=1) / 448
    fp8 = (w / fp8_scale[:, None]).to(torch.float8_e4m3fn)
    actual = fp8_w8a8_linear(x, prepare_fp8_w8a8(fp8, fp8_scale, "cuda"))
    expected = reference_fp8_w8a8_linear(x.float(), fp8, fp8_scale)
    assert rel_error(actual.float(), expected) < TOLERANCE[torch.bfloat16]
    input_scale = x.float().abs().amax().cpu() / 448  # static activations
    actual = fp8_w8a8_linear(x, prepare_fp8_w8a8(fp8, fp8_scale, "cuda", input_scale=input_scale))
    expected = reference_fp8_w8a8_linear(x.float(), fp8, fp8_scale, input_scale=input_scale.cuda())
    assert rel_error(actual.float(), expected) < TOLERANCE[torch.bfloat16]
    # group-wise weight scales (128 channels a group): served from the dequantized weight
    group_scale = fp8_scale[:, None].expand(-1, 1024 // 128).contiguous()
    actual = fp8_w8a8_linear(x, prepare_fp8_w8a8(fp8, group_scale, "cuda", group_size=128))
    assert rel_error(actual.float(), reference_fp8_w8a8_linear(x.float(), fp8, fp8_scale)) < TOLERANCE[torch.bfloat16]


def test_gpu_opcheck_attention_and_w4a16():
    cache = allocate_kv_cache(1, 8, BLOCK_SIZE, 2, 64, "int4", 32, "cuda")[0]
    tables, slots, seq_lens, qsl = _batch([(20, 4), (9, 1)], 8)
    key, value = torch.randn(2, len(slots), 2, 64, device="cuda")
    cache_write(key, value, cache, slots.cuda())
    query = torch.randn(5, 4, 64, device="cuda")
    torch.library.opcheck(torch.ops.qkiln.paged_attention.default,
                          (query, *cache.op_tensors(), tables.cuda(), seq_lens.cuda(), qsl.cuda(),
                           0.125))
    weight = prepare_w4a16(torch.randint(0, 16, (64, 128), dtype=torch.uint8, device="cuda"),
                           torch.rand(64, 1, device="cuda"), torch.rand(64, 1, device="cuda"),
                           128, "cuda")
    torch.library.opcheck(torch.ops.qkiln.w4a16_linear.default,
                          (torch.randn(3, 128, device="cuda").to(torch.bfloat16), weight.packed,
                           weight.scales, weight.zeros, 128, 128, 64, None, None))
