"""plugins/weight_arena.py: the CPU GEMV weights moved into one buffer compute the same bits."""

import torch
from plugins_testlib import canonical_int4

from qkiln.plugins import prepare_w4a16, prepare_w8a16, w4a16_linear, w8a16_linear
from qkiln.plugins.weight_arena import gather_gemv_weights


def _weights():
    sym = prepare_w4a16(*canonical_int4(40, 128, 32, is_symmetric=True), 32, "cpu", keep_dequantized=True)
    asym = prepare_w4a16(*canonical_int4(24, 96, 32, is_symmetric=False), 32, "cpu")
    int8 = prepare_w8a16(torch.randint(-128, 128, (56, 128), dtype=torch.int8), torch.rand(56) * 0.01, "cpu")
    return sym, asym, int8


def _outputs(weights, xs):
    sym, asym, int8 = weights
    return [w4a16_linear(xs[128], sym), w4a16_linear(xs[96], asym), w8a16_linear(xs[128], int8)]


def _gemv_tensors(weights):
    sym, asym, int8 = weights
    return [t for t in (sym.packed, sym.scales, sym.zeros, asym.packed, asym.scales, asym.zeros,
                        int8.weight, int8.scales) if t is not None]


def test_gathered_weights_compute_the_same_bits():
    weights = _weights()
    # GEMV rows, the few-row form and (sym, which has one) the dense copy's GEMM
    xs = [{k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (96, 128)} for rows in (1, 5, 20)]
    before = [_outputs(weights, x) for x in xs]
    tensors, dense = [t.clone() for t in _gemv_tensors(weights)], weights[0].dequantized

    size = gather_gemv_weights([*weights, "not a weight"])

    moved = _gemv_tensors(weights)
    assert size >= sum(t.nbytes for t in moved)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # one buffer
    pointers = [t.data_ptr() for t in moved]
    assert pointers == sorted(pointers) and all(p % 64 == 0 for p in pointers)  # in order, aligned
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(moved, tensors))
    assert weights[0].dequantized is dense  # the many-row copy stays where it was
    for x, expected in zip(xs, before):
        assert all(torch.equal(a, b) for a, b in zip(_outputs(weights, x), expected))


def test_nothing_to_gather():
    assert gather_gemv_weights([]) == 0
