"""qkiln.quant: quantization schemes, pure algorithms (RTN, GPTQ, AWQ, FP8, KV INT4/FP8) and bit layouts.

Torch only; imports nothing from other qkiln subpackages except `qkiln.errors`. Every function
takes tensors and returns tensors; hooks, layer order, devices and I/O belong to `qkiln.compile`.
"""

from qkiln.quant import awq, fp8, gptq, kv, pack
from qkiln.quant.fake import dequantized_like, fake_quant_kv, fake_quantize_activation, fake_quantize_weight
from qkiln.quant.fp8 import Fp8Weight, quantize_weight_fp8
from qkiln.quant.kv import KVCalibration, calibrate_kv_scales
from qkiln.quant.rtn import QuantizedWeight, quantize_rtn
from qkiln.quant.scheme import (ActivationScheme, AWQOptions, GPTQOptions, KVCacheScheme, QuantScheme,
                                WeightScheme)

__all__ = [
    "awq", "fp8", "gptq", "kv", "pack",
    "WeightScheme", "ActivationScheme", "KVCacheScheme", "GPTQOptions", "AWQOptions", "QuantScheme",
    "QuantizedWeight", "quantize_rtn", "Fp8Weight", "quantize_weight_fp8", "KVCalibration",
    "calibrate_kv_scales", "fake_quantize_weight", "fake_quantize_activation", "fake_quant_kv",
    "dequantized_like",
]
