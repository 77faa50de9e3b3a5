"""CPU paged attention (through the registered op) against the float64 reference."""

import pytest
import torch
from plugins_testlib import DECODE, MIXED, QUERY_DTYPE, TOLERANCE, PagedBatch, make_cache, rel_error

from qkiln.plugins import paged_attention
from qkiln.plugins.reference import reference_paged_attention


@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32", "fp8", "int4"])
def test_cpu_attention_matches_reference(kv_dtype, group, specs):
    cache = make_cache(kv_dtype, 24, 2, 32, with_channel_scale=kv_dtype in ("fp8", "int4"))
    batch = PagedBatch(specs, cache, num_heads=2 * group)
    query_dtype = QUERY_DTYPE[kv_dtype]
    args = batch.attention_args(cache, query_dtype)
    expected = reference_paged_attention(*args)
    actual = paged_attention(args[0], cache, *args[10:])
    assert actual.dtype == query_dtype and actual.shape == args[0].shape
    assert rel_error(actual, expected) < TOLERANCE[query_dtype]


def test_cpu_long_prefill_is_chunked_and_causal():
    """More query rows than QUERY_CHUNK, following earlier context (a prefix-cache hit)."""
    cache = make_cache("fp32", 40, 1, 16)
    batch = PagedBatch([(300, 290), (20, 1)], cache, num_heads=2)
    args = batch.attention_args(cache, torch.float32)
    expected = reference_paged_attention(*args)
    assert rel_error(paged_attention(args[0], cache, *args[10:]), expected) < 2e-5


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it(kernels, monkeypatch):
    """One position's overflowed V (NaN) made every row of its prefill chunk NaN, the earlier ones
    too (their probability for it is 0, but 0 * NaN is NaN); the prefix cache then kept them."""
    from qkiln.plugins import cpu_attention, cpu_native

    if kernels == "torch":
        monkeypatch.setattr(cpu_attention, "_native_for", lambda *a: None)
    elif cpu_native.native_extension() is None:
        pytest.skip("qkiln's native CPU kernels are not built here")
    cache = make_cache("fp32", 8, 2, 32)
    batch = PagedBatch([(20, 12), (9, 1)], cache, num_heads=4)  # a chunk after 8 cached tokens, a decode
    bad = int(batch.block_tables[0, 15 // 16]) * 16 + 15  # position 15 of the chunk's sequence
    cache.v[bad // 16, bad % 16, 1] = float("nan")  # kv head 1 only
    args = batch.attention_args(cache, torch.float32)
    for out in (reference_paged_attention(*args), paged_attention(args[0], cache, *args[10:])):
        rows_before, rows_after = out[:15 - 8], out[15 - 8:12]  # query rows of positions 8..14, 15..19
        assert torch.isfinite(rows_before).all() and torch.isfinite(out[12:]).all()
        assert torch.isnan(rows_after[:, 2:]).all() and torch.isfinite(rows_after[:, :2]).all()  # heads of kv 1


def test_cpu_attention_rows_depend_only_on_their_sequence():
    cache = make_cache("bf16", 24, 2, 32)
    batch = PagedBatch(MIXED, cache, num_heads=4)
    args = batch.attention_args(cache, torch.float32)
    together = paged_attention(args[0], cache, *args[10:])
    # Sequence 2 alone: its rows, its block table row, its length.
    rows = slice(int(batch.query_start_loc[2]), int(batch.query_start_loc[3]))
    alone = paged_attention(args[0][rows], cache, batch.block_tables[2:3], batch.seq_lens[2:3],
                            torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
                            batch.scale)
    assert torch.allclose(alone, together[rows], rtol=1e-5, atol=1e-6)


LONG_CHUNKS = [(145, 100), (130, 130), (3, 1)]  # a chunk after 45 cached tokens, a whole prompt, a decode


@pytest.mark.parametrize("specs", [MIXED + [(70, 1)], DECODE, LONG_CHUNKS],
                         ids=["11-row-blocks", "4-row-blocks", "long-chunks"])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("group", [1, 3, 5, 9])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_cpu_bf16_heads_match_reference(kv_dtype, head_dim, group, block_size, specs):
    """bf16 query over a bf16 or fp8 cache at D = 64 / 128 (the native kernel's vdpbf16ps path
    where the CPU has it, decode_group_bf16 over bf16 on AVX2 hosts; fp8 widened in registers,
    its per-head scales folded in): GQA groups
    larger than one register chunk, tiles that span blocks, tasks serving both kv heads (8+ row
    blocks, group <= 8) or one; prefill blocks through the tiled kernel (online softmax across
    16-token tiles, rows of a block ending mid-tile; an fp8 cache's prefix converted to bf16 rows
    first, its scales passed on)."""
    cache = make_cache(kv_dtype, 40, 2, head_dim, block_size=block_size)
    batch = PagedBatch(specs, cache, num_heads=2 * group)
    args = batch.attention_args(cache, torch.bfloat16)
    expected = reference_paged_attention(*args)
    actual = paged_attention(args[0], cache, *args[10:])
    assert actual.dtype == torch.bfloat16 and rel_error(actual, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "int4"])
def test_prefill_blocks_match_reference(kv_dtype, query_dtype, head_dim, group, block_size):
    """Prefill chunks of every cache dtype and head size, whichever kernel the CPU takes for their
    8-row blocks (over int4 without AVX512-BF16: prefill_block_tiled, each K / V tile dequantized
    once for all of a block's rows, online softmax; with it and a bf16 query of D 64 / 128, the
    block's prefix rounded to bf16 rows for prefill_block_bf16): chunks after cached context, rows
    ending mid-tile, tiles across cache blocks of 5 slots, a decode in the step."""
    cache = make_cache(kv_dtype, 80, 2, head_dim, block_size=block_size)  # (no key smoothing: native)
    batch = PagedBatch(LONG_CHUNKS + [(21, 13)], cache, num_heads=2 * group)
    args = batch.attention_args(cache, query_dtype)
    expected = reference_paged_attention(*args)
    actual = paged_attention(args[0], cache, *args[10:])
    assert rel_error(actual, expected) < TOLERANCE[query_dtype]


@pytest.mark.parametrize("head_dim,group_size", [(32, 8), (64, 4), (64, 32), (64, 64), (128, 8), (128, 128)])
def test_int4_group_layouts_match_reference(head_dim, group_size):
    """int4 caches of the group layouts the native kernels take, decodes and prefill chunks in one
    step: with AVX512-BF16 the decode kernel reads K and V as codes and gives each fp32 lane the
    scale of its elements' group (groups of 4 elements up to the whole head)."""
    cache = make_cache("int4", 80, 2, head_dim, group_size=group_size)
    batch = PagedBatch(LONG_CHUNKS + DECODE, cache, num_heads=6)
    args = batch.attention_args(cache, torch.bfloat16)
    expected = reference_paged_attention(*args)
    actual = paged_attention(args[0], cache, *args[10:])
    assert rel_error(actual, expected) < TOLERANCE[torch.bfloat16]


def _native_float_out(args, cache, monkeypatch, split: bool, kv_dtype: str):
    """The native op into an fp32 output (the registered op returns the query's dtype, whose
    rounding would hide the parts' different summation order). Skips where the kernel serving
    kv_dtype never splits: int4 splits everywhere, bf16 with AVX2 or AVX512-BF16, fp8 with
    AVX512-BF16 only."""
    from qkiln.plugins import cpu_native

    ops = cpu_native.native_ops()
    isa = ops.decode_attention_isa() if ops is not None else None
    splits = {"int4": isa is not None, "bf16": isa in ("avx2", "avx512-bf16"), "fp8": isa == "avx512-bf16"}
    if not splits[kv_dtype]:
        pytest.skip(f"the native {kv_dtype} decode kernel of this build ({isa}) does not split rows")
    monkeypatch.setenv("QKILN_DECODE_SPLIT", "1" if split else "0")
    out = torch.empty(args[0].shape, dtype=torch.float32)
    query, k, v, k_scale, v_scale = args[:5]
    ops.paged_attention(query, k, v, *args[10:13], args[13], out, k_scale, v_scale, *args[5:9])
    return out


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int4"])
def test_long_decodes_split_by_context_match_reference(kv_dtype, head_dim, group, block_size, monkeypatch):
    """Few decodes (< 8 rows) over 1024+ tokens are served in parts of ~512 tokens and merged by
    their log-sum-exp (int4: by decode_head_int4, bf16 queries); shorter rows are served whole,
    with the same bits either way."""
    torch.manual_seed(head_dim + group + block_size)
    specs = [(3000, 1), (1030, 1), (100, 1)]
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in specs) + 4
    cache = make_cache(kv_dtype, num_blocks, 3, head_dim, block_size=block_size)
    batch = PagedBatch(specs, cache, num_heads=3 * group)
    args = batch.attention_args(cache, torch.bfloat16)
    expected = reference_paged_attention(*args).float()
    split = _native_float_out(args, cache, monkeypatch, split=True, kv_dtype=kv_dtype)
    whole = _native_float_out(args, cache, monkeypatch, split=False, kv_dtype=kv_dtype)
    assert rel_error(split, expected) < TOLERANCE[torch.bfloat16]
    assert rel_error(split, whole) < 1e-5  # the same softmax, summed in another order
    assert not torch.equal(split[:2], whole[:2])  # the two long rows went through the parts
    assert torch.equal(split[2], whole[2])
    # what the registered op returns (bf16) agrees with the fp32 result
    monkeypatch.setenv("QKILN_DECODE_SPLIT", "1")
    assert rel_error(paged_attention(args[0], cache, *args[10:]), split) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int4"])
def test_uneven_decode_steps_split_rows_per_thread(kv_dtype, block_size, monkeypatch):
    """3 kv heads of one decode row on 2 threads: a row of 256+ tokens is split into one part per
    thread (whole blocks), a shorter one (parts under 128 tokens) is served whole."""
    torch.manual_seed(block_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for context, splits in ((300, True), (200, False)):
            cache = make_cache(kv_dtype, -(-context // block_size) + 2, 3, 64, block_size=block_size)
            args = PagedBatch([(context, 1)], cache, num_heads=9).attention_args(cache, torch.bfloat16)
            split = _native_float_out(args, cache, monkeypatch, split=True, kv_dtype=kv_dtype)
            whole = _native_float_out(args, cache, monkeypatch, split=False, kv_dtype=kv_dtype)
            assert rel_error(split, reference_paged_attention(*args).float()) < TOLERANCE[torch.bfloat16]
            assert rel_error(split, whole) < 1e-5
            assert torch.equal(split, whole) != splits, context
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_avx2_group_decode_agrees_with_the_tiled_kernel(head_dim, group, block_size, monkeypatch):
    """On AVX2 hosts decode_group_bf16 serves bf16 rows over a bf16 cache (the GQA group per pass,
    sub-groups of up to 4 heads); QKILN_GROUP_DECODE=0 falls back to decode_head_tiled. Both are
    the same softmax summed in another order: fp32 outputs agree to 1e-5 and differ in bits.
    Contexts not a multiple of 8 (the scores' last partial chunk), prefill rows, a 1-token row."""
    from qkiln.plugins import cpu_native

    ops = cpu_native.native_ops()
    if ops is None or ops.decode_attention_isa() != "avx2":
        pytest.skip("decode_group_bf16 serves AVX2 builds only")
    torch.manual_seed(head_dim + group + block_size)
    specs = [(203, 1), (37, 1), (1, 1), (29, 11)]
    cache = make_cache("bf16", sum(-(-c // block_size) for c, _ in specs) + 2, 2, head_dim,
                       block_size=block_size)
    args = PagedBatch(specs, cache, num_heads=2 * group).attention_args(cache, torch.bfloat16)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QKILN_GROUP_DECODE", flag)
        outs[flag] = _native_float_out(args, cache, monkeypatch, split=False, kv_dtype="bf16")
    assert rel_error(outs["1"], reference_paged_attention(*args).float()) < TOLERANCE[torch.bfloat16]
    assert rel_error(outs["1"], outs["0"]) < 1e-5
    assert not torch.equal(outs["1"], outs["0"])


def _broken(batch, what: str):
    """The batch's metadata with one thing wrong, as a scheduler bug or a malformed engine feed has it."""
    tables, lens, starts = batch.block_tables.clone(), batch.seq_lens.clone(), batch.query_start_loc.clone()
    if what in ("far block", "next block", "padding block"):
        tables[0, 0] = {"far block": 10_000_000, "next block": 24, "padding block": -1}[what]
    elif what == "context past its table":
        lens[0] = tables.shape[1] * 16 + 1
    elif what == "rows past the query":
        starts[-1] += 5
    elif what == "more rows than context":
        lens[1] = 0
    return tables, lens, starts


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("what, message", [
    ("far block", "reads block 10000000"), ("next block", "reads block 24"), ("padding block", "reads block -1"),
    ("context past its table", "needs 0 <= rows <= context"), ("rows past the query", "query_start_loc must run"),
    ("more rows than context", "needs 0 <= rows <= context")])
def test_native_attention_refuses_metadata_that_would_read_or_write_out_of_bounds(native_ext, kv_dtype, what,
                                                                                 message):
    """Where the torch path raised IndexError, the native kernels read past the cache (NaN output,
    a SIGSEGV for a far block) or wrote past `out` (heap corruption): now a RuntimeError naming it."""
    cache = make_cache(kv_dtype, 24, 2, 32)
    batch = PagedBatch(MIXED, cache, num_heads=4)
    query = batch.attention_args(cache, torch.float32)[0]
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(")):
        paged_attention(query, cache, *_broken(batch, what), batch.scale)


def test_native_cache_write_refuses_mismatched_rows_or_heads(native_ext):
    from qkiln.plugins import cache_write

    cache = make_cache("bf16", 8, 2, 64)
    key = value = torch.randn(8, 2, 64)
    with pytest.raises(RuntimeError, match="slot_mapping has 4 slots for 8 rows"):
        cache_write(key, value, cache, torch.arange(4))
    heads = torch.randn(8, 4, 32)  # the same width in other heads
    with pytest.raises(RuntimeError, match=r"must be \[N, Hkv, D\] as the cache is"):
        cache_write(heads, heads, cache, torch.arange(8))


def test_query_heads_must_be_a_multiple_of_kv_heads(native_ext):
    cache = make_cache("bf16", 24, 2, 32)
    batch = PagedBatch(MIXED, cache, num_heads=3)
    args = batch.attention_args(cache, torch.float32)
    with pytest.raises(RuntimeError, match="3 query heads cannot share 2 kv heads"):
        paged_attention(args[0], cache, *args[10:])


@pytest.mark.parametrize("native_ops", ["1", "0"])
def test_an_empty_step_gives_an_empty_result(native_ops, monkeypatch):
    monkeypatch.setenv("QKILN_NATIVE_CPU_OPS", native_ops)  # "0": torch's code, which crashed on it
    cache = make_cache("bf16", 8, 2, 32)
    out = paged_attention(torch.empty(0, 4, 32), cache, torch.zeros(0, 2, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 32 ** -0.5)
    assert out.shape == (0, 4, 32)
