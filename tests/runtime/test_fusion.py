"""Serving-time fusion of q/k/v and gate/up (runtime/fusion.py): same logits, fewer modules."""

import pytest
import torch

from qkiln.runtime.fusion import fuse_tensors
from qkiln.runtime.loader import load_for_serving
from tiny_models import write_tiny_hf_model


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).float()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qkv bias; q/k norm (rotated separately)
def test_fused_source_model_gives_the_same_logits(tmp_path, arch):
    path = write_tiny_hf_model(tmp_path / arch, arch)
    fused = load_for_serving(str(path), dtype="fp32").model
    plain = load_for_serving(str(path), dtype="fp32", fuse=False).model
    layer = fused.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and plain.model.layers[0].self_attn.qkv_proj is None
    ids = torch.randint(0, 256, (2, 23))
    torch.testing.assert_close(_logits(fused, ids), _logits(plain, ids), rtol=1e-5, atol=1e-5)


def test_fused_quantized_artifact_gives_the_same_logits(tmp_path):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    path = write_tiny_hf_model(tmp_path / "m", "llama")
    artifact = build(str(path), load_recipe("w4a16-rtn"), tmp_path / "a", use_cache=False, progress=False,
                     log=lambda m: None).path
    fused = load_for_serving(str(artifact), dtype="fp32").model
    plain = load_for_serving(str(artifact), dtype="fp32", fuse=False).model
    assert fused.model.layers[1].mlp.gate_up_proj.kind == "int4"
    ids = torch.randint(0, 256, (1, 17))
    torch.testing.assert_close(_logits(fused, ids), _logits(plain, ids), rtol=1e-4, atol=1e-4)


def _int4_entry(out_features, group_size=32):
    return {"format": "int4", "group_size": group_size, "in_features": 64, "out_features": out_features}


def _int4_tensors(name, out_features):
    return {f"{name}.qweight": torch.zeros(out_features, 32, dtype=torch.uint8),
            f"{name}.scales": torch.ones(out_features, 2), f"{name}.zeros": torch.zeros(out_features, 2)}


def test_a_set_with_mixed_formats_stays_unfused():
    """A per-layer fallback (k_proj kept at 8 bits) must not be concatenated with int4 members."""
    prefix = "model.layers.0.self_attn."
    tensors, linears = {}, {}
    for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        tensors.update(_int4_tensors(prefix + name, out))
        linears[prefix + name] = _int4_entry(out)
    linears[prefix + "k_proj"] = dict(linears[prefix + "k_proj"], format="int8")
    sizes = {"self_attn.qkv_proj": [64, 32, 32], "mlp.gate_up_proj": [128, 128]}
    assert fuse_tensors(tensors, linears, 1, sizes) == set()
    assert prefix + "qkv_proj" not in linears and prefix + "q_proj.qweight" in tensors

    linears[prefix + "k_proj"] = _int4_entry(32)  # now uniform: fused, members removed
    assert fuse_tensors(tensors, linears, 1, sizes) == {prefix + "qkv_proj"}
    assert linears[prefix + "qkv_proj"]["out_features"] == 128 and prefix + "q_proj" not in linears
    assert tensors[prefix + "qkv_proj.qweight"].shape == (128, 32)
    assert not any(k.startswith(prefix + "q_proj") for k in tensors)
