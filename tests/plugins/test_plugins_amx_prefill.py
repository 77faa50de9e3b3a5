"""The AMX prefill attention (csrc/cpu_attention_prefill_amx.cpp) against the float64 reference.

Sequences with 16+ query rows over a bf16, fp8 or int4 cache take it where AMX is ready; the other rows of the
same call stay on the per-block kernels. QKILN_AMX_PREFILL=0 turns it off, per call.
"""

import pytest
import torch
from plugins_testlib import TOLERANCE, PagedBatch, make_cache, rel_error

from qkiln.plugins import cpu_native, paged_attention
from qkiln.plugins.reference import reference_paged_attention

ext = cpu_native.native_extension()
pytestmark = pytest.mark.skipif(ext is None or not ext.amx_prefill_ready(),
                                reason="needs the native extension on a CPU with AMX-BF16")

# (context length, query rows): exactly one row tile, a tile and one row, a chunk after 45
# cached tokens, a whole prompt, a short chunk and a decode (both left to the other kernels),
# a chunk ending mid-tile deep into its context.
SPECS = [(16, 16), (17, 17), (145, 100), (130, 130), (40, 9), (60, 1), (300, 37)]
AMX_ROWS = [True, True, True, True, False, False, True]


def _attention(args, cache, monkeypatch, amx: bool):
    monkeypatch.setenv("QKILN_AMX_PREFILL", "1" if amx else "0")
    return paged_attention(args[0], cache, *args[10:])


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("group", [1, 3, 9])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int4"])
def test_amx_prefill_matches_reference(kv_dtype, head_dim, group, block_size, monkeypatch):
    """fp8 caches are widened to bf16 exactly while staged, their scales applied as elsewhere; int4
    caches dequantized in fp32 and rounded to bf16."""
    torch.manual_seed(head_dim + group + block_size)
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in SPECS) + 4
    cache = make_cache(kv_dtype, num_blocks, 2, head_dim, block_size=block_size)  # unused: NaN
    batch = PagedBatch(SPECS, cache, num_heads=2 * group)
    args = batch.attention_args(cache, torch.bfloat16)
    expected = reference_paged_attention(*args)
    amx = _attention(args, cache, monkeypatch, amx=True)
    assert amx.dtype == torch.bfloat16 and rel_error(amx, expected) < TOLERANCE[torch.bfloat16]
    avx512 = _attention(args, cache, monkeypatch, amx=False)
    starts = batch.query_start_loc.tolist()
    on_amx = torch.zeros(len(amx), dtype=torch.bool)
    for s, served in enumerate(AMX_ROWS):
        rows = slice(starts[s], starts[s + 1])
        on_amx[rows] = served
        seq_error = rel_error(amx[rows], expected[rows])
        assert seq_error < TOLERANCE[torch.bfloat16], f"sequence {s}: {seq_error}"
    # the rows the AMX kernel does not serve are the other kernel's exactly; its own sum in
    # another order, so over hundreds of rows some differ in the last bits
    assert torch.equal(amx[~on_amx], avx512[~on_amx])
    assert not torch.equal(amx[on_amx], avx512[on_amx])


def test_amx_prefill_rows_are_causal(monkeypatch):
    """Each row sees only its own prefix: changing the last token's K/V changes the last row only."""
    torch.manual_seed(1)
    cache = make_cache("bf16", 40, 1, 64)
    batch = PagedBatch([(48, 48)], cache, num_heads=3)
    args = batch.attention_args(cache, torch.bfloat16)
    before = _attention(args, cache, monkeypatch, amx=True)
    last_slot = int(batch.slot_mapping[-1])
    cache.k.view(-1, 1, 64)[last_slot] += 3.0
    cache.v.view(-1, 1, 64)[last_slot] -= 3.0
    after = _attention(args, cache, monkeypatch, amx=True)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.equal(before[-1], after[-1])


@pytest.mark.parametrize("group_size", [8, 32])
def test_amx_prefill_int4_groups(group_size, monkeypatch):
    """int4 groups shorter than 16 elements are dequantized element by element, others 16 at once."""
    torch.manual_seed(group_size)
    num_blocks = sum(-(-ctx // 16) for ctx, _ in SPECS) + 4
    cache = make_cache("int4", num_blocks, 2, 64, group_size=group_size)
    batch = PagedBatch(SPECS, cache, num_heads=6)
    args = batch.attention_args(cache, torch.bfloat16)
    expected = reference_paged_attention(*args)
    amx = _attention(args, cache, monkeypatch, amx=True)
    assert rel_error(amx, expected) < TOLERANCE[torch.bfloat16]
    assert not torch.equal(amx, _attention(args, cache, monkeypatch, amx=False))
