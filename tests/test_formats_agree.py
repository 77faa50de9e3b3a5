"""The numeric formats written twice across the quant/ -> plugins/ boundary (plugins may not import
quant: DESIGN's layering) agree. The build simulates with quant/, the server computes with plugins/,
so a drift between the copies makes the recorded accuracy describe another model than the one served
(the dynamic fp8 scale floor had drifted: fp32 eps in quant, 1e-12 in the kernels)."""

import pytest
import torch

from qkiln.plugins import kv_cache, reference
from qkiln.quant import fp8


def test_fp8_constants_agree():
    assert (fp8.FP8_DTYPE, fp8.FP8_MAX) == (kv_cache.FP8_DTYPE, kv_cache.FP8_MAX)


@pytest.mark.parametrize("amplitude", [1.0, 3e-3, 3e-6, 0.0])
def test_dynamic_per_token_fp8_agrees(amplitude):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 96, generator=g) * amplitude
    x[0] *= 1000  # rows of very different range in one batch
    simulated, sim_scale = fp8.quantize_activation_dynamic(x)
    served, served_scale = reference.fake_quantize_fp8_per_token(x)
    assert torch.equal(sim_scale, served_scale)
    assert torch.equal(simulated.float(), served.float())


def test_static_fp8_agrees():
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(1)) * 50
    scale = torch.tensor(0.05)
    assert torch.equal(fp8.quantize_activation_static(x, scale).float(),
                       reference.quantize_fp8_static(x, scale).float())
