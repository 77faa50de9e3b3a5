"""Same inputs give identical tensors, for every algorithm (no hidden randomness, no order effects)."""

import torch

from qkiln.quant.awq import search_clip, search_scales
from qkiln.quant.fp8 import quantize_weight_fp8
from qkiln.quant.gptq import accumulate_hessian, make_empty_hessian, quantize_weight
from qkiln.quant.kv import calibrate_kv_scales, quantize_kv_int4
from qkiln.quant.rtn import quantize_rtn
from qkiln.quant.scheme import GPTQOptions, KVCacheScheme, WeightScheme


def _run_all(W, x, k):
    scheme = WeightScheme(4, symmetric=False, group_size=32)
    H, _count = accumulate_hessian(make_empty_hessian(x.shape[1]), x, 0)
    gptq, _info = quantize_weight(W, H, scheme, GPTQOptions(act_order=True))
    awq = search_scales(x, [W], scheme, grid_size=5)
    clip = search_clip(x, W, scheme, grid_size=10)
    calibration = calibrate_kv_scales(k, KVCacheScheme("int4", 16, key_smoothing=True), is_key=True)
    return [quantize_rtn(W, scheme).qweight, gptq.qweight, gptq.scales, gptq.zeros, awq.scales, clip.max_val,
            quantize_weight_fp8(W).weight.view(torch.uint8), calibration.channel_scale,
            *quantize_kv_int4(k, 16, calibration.channel_scale)]


def test_same_inputs_identical_outputs():
    W, x, k = torch.randn(16, 80), torch.randn(64, 80), torch.randn(20, 2, 32)
    first, second = _run_all(W, x, k), _run_all(W.clone(), x.clone(), k.clone())
    for a, b in zip(first, second):
        assert torch.equal(a, b)
