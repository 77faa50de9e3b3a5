"""The KV key offset end to end: calibrated, stored in the artifact, subtracted by the paged cache
write, never added back by attention; served greedy tokens equal the simulated model's."""

import pytest
import torch

from qkiln.compile.artifact import load_tensors, read_manifest
from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.plugins import allocate_kv_cache, cache_write, paged_attention
from qkiln.quant.kv import calibrate_kv_scales, dequantize_kv_fp8, quantize_kv_fp8
from qkiln.quant.scheme import KVCacheScheme
from qkiln.runtime.engine import EngineConfig, LLMEngine
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import simulated_greedy, write_tiny_hf_model, write_tiny_model_and_text


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    import dataclasses

    root = tmp_path_factory.mktemp("kvoff")
    model, text = write_tiny_model_and_text(
        root, "The quick brown fox jumps over the lazy dog; then it naps in the sun. " * 100)
    r = preset("kv-fp8")
    r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, source=str(text), num_samples=4,
                                                                  seq_len=64),
                            evaluation=dataclasses.replace(r.evaluation, data=None))
    return build(str(model), r, root / "a", use_cache=False, progress=False, log=lambda m: None).path


def test_kv_fp8_preset_stores_a_key_offset(artifact):
    assert preset("kv-fp8").scheme.kv_cache.key_offset
    manifest = read_manifest(artifact)
    tensors = load_tensors(artifact, manifest, verify=False)
    offset = tensors["model.layers.0.self_attn.k_offset"]
    assert offset.dtype == torch.float32 and offset.shape == (2, 32) and offset.abs().max() > 0
    assert "model.layers.0.self_attn.v_offset" not in tensors


def test_served_greedy_tokens_equal_simulated(artifact):
    served = load_for_serving(str(artifact), dtype="fp32")
    assert served.kv_dtype == "fp8" and len(served.kv_scales["k_offset"]) == served.model.config.num_hidden_layers
    engine = LLMEngine(served.model, served.tokenizer, EngineConfig(kv_dtype="fp8", num_kv_blocks=16),
                       kv_scales=served.kv_scales)
    assert torch.equal(engine.caches[1].k_offset, served.kv_scales["k_offset"][1])
    prompt = list(b"The lazy dog")
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got = out.token_ids
    assert got == simulated_greedy(artifact, prompt, 12)


def test_an_fp8_cache_without_calibrated_scales_warns(artifact):
    import warnings

    served = load_for_serving(str(artifact), dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the artifact's calibrated scales: nothing to say
        LLMEngine(served.model, served.tokenizer, EngineConfig(kv_dtype="fp8", num_kv_blocks=4),
                  kv_scales=served.kv_scales)
    with pytest.warns(UserWarning, match=r"no calibrated scales .* scale 1\.0 .*kv-fp8 recipe"):
        LLMEngine(served.model, served.tokenizer, EngineConfig(kv_dtype="fp8", num_kv_blocks=4))


def test_each_model_loaded_without_fp8_scales_is_warned_about_by_name(tmp_path):
    """An eval job loading models from one line of code was warned for the first only (Python shows a
    warning once per text and place), and not told which."""
    import warnings

    from qkiln.runtime.llm import LLM

    models = [write_tiny_hf_model(tmp_path / name, "llama") for name in ("first", "second")]
    # two builds in folders of one name (runs/1/art, runs/2/art): named by their manifests too
    models += [build(str(models[0]), preset(recipe), tmp_path / "runs" / str(i) / "art", progress=False,
                     log=lambda m: None, use_cache=False).path for i, recipe in enumerate(("w4a16-rtn", "w8a16"))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for model in models:
            LLM(str(model), kv_dtype="fp8", num_kv_blocks=4)
    said = [str(w.message).split(": the fp8")[0] for w in caught if "no calibrated scales" in str(w.message)]
    assert said[:2] == [str(m) for m in models[:2]], said  # a source is named by its path
    assert len(said) == 4 and said[2].startswith("art (manifest ") and said[3].startswith("art (manifest "), said
    assert said[2] != said[3]


def test_cache_stores_keys_minus_offset_and_attention_ignores_it():
    torch.manual_seed(0)
    keys = torch.randn(6, 2, 16) + torch.linspace(-8, 8, 16)  # [tokens, kv heads, head_dim], large means
    values, query = torch.randn(6, 2, 16), torch.randn(6, 4, 16)
    cal = calibrate_kv_scales(keys, KVCacheScheme("fp8", key_offset=True), is_key=True)
    v_cal = calibrate_kv_scales(values, KVCacheScheme("fp8"), is_key=False)
    cache = allocate_kv_cache(1, 1, 8, 2, 16, "fp8", has_k_offset=True)[0]
    cache.k_scale.copy_(cal.scale), cache.v_scale.copy_(v_cal.scale), cache.k_offset.copy_(cal.offset)
    cache_write(keys, values, cache, torch.arange(6))
    stored = cache.k[0, :6]
    assert torch.equal(stored.view(torch.uint8), quantize_kv_fp8(keys - cal.offset, cal.scale).view(torch.uint8))
    out = paged_attention(query, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                          torch.tensor([0, 6], dtype=torch.int32), 0.25)
    k_hat = dequantize_kv_fp8(stored, cal.scale) + cal.offset  # what the keys were, up to rounding
    v_hat = dequantize_kv_fp8(cache.v[0, :6], v_cal.scale)
    scores = torch.einsum("qhd,khd->hqk", query, k_hat.repeat_interleave(2, dim=1)) * 0.25
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_hat.repeat_interleave(2, dim=1))
    torch.testing.assert_close(out.float(), want, rtol=1e-4, atol=1e-4)
