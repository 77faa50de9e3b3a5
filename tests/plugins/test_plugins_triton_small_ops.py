"""The Triton small ops (plugins/triton_small_ops.py) against reference_small_ops.py: on the GPU
through the `qkiln::` ops when there is one, else the kernels themselves under TRITON_INTERPRET
on CPU tensors (the interpreter truncates fp32 -> bf16, so it is exact only in fp32; bf16 there
is checked to bf16 tolerance)."""

import pytest
import torch
from plugins_testlib import rel_error

from qkiln.plugins import ops
from qkiln.plugins.reference_small_ops import (reference_fused_add_rms_norm, reference_rms_norm,
                                               reference_rotary_embedding, reference_silu_and_mul)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE == "cuda" else [])


@pytest.fixture(scope="module")
def kernels():
    from qkiln.plugins import triton_kv, triton_small_ops

    if DEVICE == "cpu" and not triton_kv.is_interpreter():
        pytest.skip("no GPU and the Triton kernels were imported without TRITON_INTERPRET=1")
    return triton_small_ops


def _check(actual, expected, dtype):
    """Exact in fp32; bf16/fp16 within one rounding of the dtype (exp and sqrt may differ by an ulp
    from torch's, the interpreter truncates)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
    else:
        # the interpreter truncates at each of the (up to three) roundings instead of rounding
        assert rel_error(actual.float(), expected.float()) < (1e-2 if DEVICE == "cuda" else 3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_the_reference(kernels, dtype):
    x, residual = torch.randn(2, 5, 72, device=DEVICE).to(dtype), torch.randn(2, 5, 72, device=DEVICE).to(dtype)
    weight = torch.randn(72, device=DEVICE).to(dtype)
    _check(kernels.triton_rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6), dtype)
    x2, r2 = x.clone(), residual.clone()
    kernels.triton_fused_add_rms_norm(x, residual, weight, 1e-5)
    reference_fused_add_rms_norm(x2, r2, weight, 1e-5)
    _check(residual, r2, dtype)
    _check(x, x2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference(kernels, dtype):
    gate_up = (3 * torch.randn(7, 2 * 1100, device=DEVICE)).to(dtype)  # I > one 1024 block
    _check(kernels.triton_silu_and_mul(gate_up), reference_silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_on_a_fused_qkv_view(kernels, dtype):
    qkv = torch.randn(2, 3, 9, 32, device=DEVICE).to(dtype)  # [B, T, q + k + v heads, D]
    cos, sin = torch.randn(2, 3, 1, 32, device=DEVICE).to(dtype), torch.randn(2, 3, 1, 32, device=DEVICE).to(dtype)
    expected = qkv.clone()
    reference_rotary_embedding(expected, cos, sin, 6)
    kernels.triton_rotary_embedding(qkv, cos, sin, 6)
    _check(qkv, expected, dtype)
    assert torch.equal(qkv[..., 6:, :], expected[..., 6:, :])  # v heads untouched


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_cuda_ops_dispatch_to_triton_and_match_in_bf16():
    x = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    assert rel_error(ops.rms_norm(x, weight, 1e-5).float(), reference_rms_norm(x, weight, 1e-5).float()) < 4e-3
    gate_up = torch.randn(4, 3072, device="cuda", dtype=torch.bfloat16)
    assert rel_error(ops.silu_and_mul(gate_up).float(), reference_silu_and_mul(gate_up).float()) < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_cuda_bf16_model_takes_the_fused_path_with_the_same_logits(tmp_path, monkeypatch):
    from qkiln.runtime import fused_ops
    from qkiln.runtime.loader import load_for_serving
    from tiny_models import write_tiny_hf_model

    model = load_for_serving(str(write_tiny_hf_model(tmp_path / "m", "llama")), dtype="bf16", device="cuda").model
    ids = torch.randint(0, 256, (2, 17), device="cuda")
    with torch.inference_mode():
        assert fused_ops.use_fused_ops(model.model.embed_tokens(ids))
        fused = model(ids).float()
        monkeypatch.setattr(fused_ops, "_gpu_fused_ops", lambda: False)
        plain = model(ids).float()
    assert rel_error(fused, plain) < 2e-2


def test_shapes_the_kernels_cannot_take_run_the_reference(kernels):
    """A residual or weight unlike x, an odd gate_up, more rotary heads than qkv has: the
    reference's answer or its error, never a kernel indexing past a tensor."""
    x, weight = torch.randn(3, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    with pytest.raises(RuntimeError):
        kernels.triton_fused_add_rms_norm(x, torch.randn(1, 64, device=DEVICE), weight, 1e-6)
    with pytest.raises(RuntimeError):
        kernels.triton_rms_norm(x, torch.randn(32, device=DEVICE), 1e-6)
    residual = torch.randn(3, 64, device=DEVICE, dtype=torch.float64)  # kept in its own dtype
    x2, r2 = x.clone(), residual.clone()
    kernels.triton_fused_add_rms_norm(x, residual, weight, 1e-6)
    reference_fused_add_rms_norm(x2, r2, weight, 1e-6)
    assert torch.equal(residual, r2) and torch.equal(x, x2)
    with pytest.raises(RuntimeError):
        kernels.triton_silu_and_mul(torch.randn(3, 7, device=DEVICE))
    buffer = torch.randn(4, 3, 16, device=DEVICE)
    qkv, cos, sin = buffer[:2], torch.randn(2, 16, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    expected, past = qkv.clone(), buffer[2:].clone()
    kernels.triton_rotary_embedding(qkv, cos, sin, num_heads=5)
    reference_rotary_embedding(expected, cos, sin, num_heads=5)
    assert torch.equal(qkv, expected) and torch.equal(buffer[2:], past)
