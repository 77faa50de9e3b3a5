"""Interop on real files: artifact -> compressed-tensors (read back by compressed-tensors and by
transformers), and compressed-tensors / GPTQ / AWQ checkpoints -> verified artifacts, every
quantized weight compared bit for bit with an independent reading of the source.

Independent readers: compressed-tensors' own compressors (its QuantizationConfig, decompress,
and its AutoAWQ converter), transformers' CompressedTensors loader, and a GPTQ reference written
here from AutoGPTQ's QuantLinear (pack / forward), whose packer this test follows because
AutoGPTQ and GPTQModel cannot be installed without CUDA; AutoAWQ's `WQLinear_GEMM.from_linear`
packing is followed the same way (its package needs old transformers and `datasets` to import).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkiln.compile.artifact import read_manifest, verify_artifact
from qkiln.compile.build import build
from qkiln.compile.export_compressed_tensors import (check_export, export_compressed_tensors, hf_config_dict,
                                                     hf_generation_config_dict, load_artifact_quantized)
from qkiln.compile.import_checkpoint import import_checkpoint, read_checkpoint
from qkiln.compile.recipe import Recipe, preset
from qkiln.errors import ArtifactError, SourceModelError
from qkiln.quant import KVCacheScheme, QuantScheme, WeightScheme
from qkiln.quant.rtn import quantize_rtn
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.loader import load_for_serving
from tiny_models import hf_config, write_tiny_model_and_text

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def linear_names(num_layers=2):
    return [f"model.layers.{i}.{part}.{p}" for i in range(num_layers)
            for part, projs in (("self_attn", ATTENTION), ("mlp", MLP)) for p in projs]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    return (root, *write_tiny_model_and_text(root))


def _build(tiny, name, scheme: QuantScheme, monkeypatch_env=None):
    root, model, text = tiny
    recipe = Recipe(name, scheme)
    recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, source=str(text),
                                                                         num_samples=4, seq_len=64))
    out = root / name
    if not out.exists():
        build(str(model), recipe, out, use_cache=False, progress=False, log=lambda m: None)
    return out


SCHEMES = {
    "w4a16-asym": preset("w4a16-rtn").scheme,
    # group 96 leaves a partial last group in every layer (in_features 128 and 256)
    "w4a16-sym-g96": QuantScheme(weights=WeightScheme(num_bits=4, symmetric=True, group_size=96)),
    "w8a16": preset("w8a16").scheme,
    "fp8-static-kv": dataclasses.replace(preset("fp8-w8a8-static").scheme,
                                         kv_cache=KVCacheScheme(dtype="fp8", key_smoothing=False)),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_export_reads_back_bit_exact_with_compressed_tensors_and_transformers(tiny, tmp_path, name):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    artifact = _build(tiny, name, SCHEMES[name])
    result = export_compressed_tensors(artifact, tmp_path / "ct")
    qm = load_artifact_quantized(artifact)
    head_quantized = SCHEMES[name].lm_head is not None
    assert check_export(artifact, result.path) == len(qm.weights) == 14
    config = json.loads((result.path / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    # a tied head is a Linear in transformers, in high precision; an int8 head is written untied as
    # its exact dequantized values
    assert qc["ignore"] == ["lm_head"]
    assert config["tie_word_embeddings"] is not head_quantized
    assert qc["format"] == ("float-quantized" if name.startswith("fp8") else "pack-quantized")
    if name == "w4a16-sym-g96":
        assert result.group_size == 32  # gcd(96, 128, 256): the same scales, repeated
    if name == "fp8-static-kv":
        assert qc["kv_cache_scheme"]["strategy"] == result.kv_strategy == "attn_head"
    # transformers' own loader decompresses with compressed-tensors into fp32 weights
    model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    for layer, w in qm.weights.items():
        assert same_bits(state[layer + ".weight"], w.dequantize()), layer
    if head_quantized:
        assert same_bits(state["lm_head.weight"], qm.fp_tensors["lm_head.weight"])
    assert torch.equal(state["model.norm.weight"], qm.fp_tensors["model.norm.weight"])
    stored = load_file(str(result.path / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16  # as the artifact stores it


def test_export_refuses_what_compressed_tensors_cannot_store(tiny, tmp_path):
    pytest.importorskip("compressed_tensors")
    fractional = _build(tiny, "w4-float-zero", QuantScheme(
        weights=WeightScheme(num_bits=4, symmetric=False, group_size=64, zero_point="float")))
    with pytest.raises(ArtifactError, match=r"linear model\.layers\.0\.mlp\.down_proj: .*fractional"):
        export_compressed_tensors(fractional, tmp_path / "a")
    int4_kv = _build(tiny, "kv-int4", preset("w4a16-rtn+kv-int4").scheme)
    with pytest.raises(ArtifactError, match="int4 KV cache.*--drop-kv"):
        export_compressed_tensors(int4_kv, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    weights_only = export_compressed_tensors(int4_kv, tmp_path / "b", drop_kv=True)
    assert json.loads((weights_only.path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None


def test_hf_config_round_trips():
    for arch in ("llama", "llama3", "mistral", "qwen2", "qwen3"):
        hf = hf_config(arch)
        config = ModelConfig.from_hf(hf.to_dict() | {"architectures": [type(hf).__name__.replace("Config", "ForCausalLM")]})
        assert ModelConfig.from_hf(hf_config_dict(config)) == config, arch
    # the model's recommended sampling values go to generation_config.json, where vLLM reads them
    recommended = ModelConfig.from_hf(hf_config_dict(config),
                                      {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "eos_token_id": [7, 9]})
    assert recommended.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert ModelConfig.from_hf(hf_config_dict(recommended), hf_generation_config_dict(recommended)) == recommended
    assert hf_generation_config_dict(recommended)["do_sample"] is True
    # transformers runs greedy without do_sample: max_new_tokens alone, or temperature 0, stays greedy
    for greedy in ({"max_new_tokens": 64}, {"temperature": 0.0, "top_p": 0.9}):
        assert hf_generation_config_dict(ModelConfig.from_hf(hf_config_dict(config), greedy))["do_sample"] is False
    assert hf_generation_config_dict(config) is None


def test_export_import_round_trip_serves_identical_logits(tiny, tmp_path):
    pytest.importorskip("compressed_tensors")
    # a bf16 head: an int8 head is exported as dense fp32 values and comes back as a dense head
    scheme = dataclasses.replace(SCHEMES["w4a16-asym"], lm_head=None)
    artifact = _build(tiny, "w4a16-asym-bf16-head", scheme)
    exported = export_compressed_tensors(artifact, tmp_path / "ct").path
    imported = import_checkpoint(exported, tmp_path / "back")
    verify_artifact(imported)
    a, b = load_artifact_quantized(artifact), load_artifact_quantized(imported)
    for layer, w in a.weights.items():
        assert same_bits(b.weights[layer].dequantize(), w.dequantize()), layer
    again = export_compressed_tensors(artifact, tmp_path / "ct2").path
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (exported / name).read_bytes() == (again / name).read_bytes(), name  # reproducible
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits = [load_for_serving(str(p), dtype="fp32").model(ids) for p in (artifact, imported)]
    assert torch.equal(logits[0], logits[1])


def test_a_kv_cache_only_artifact_round_trips(tiny, tmp_path):
    """Export wrote a KV-only artifact (weights as stored, fp8 KV scales) that import refused: "no
    quantized linear found". (The kv-fp8 preset's key offset has no compressed-tensors form: export
    widens k_scale instead, so only an offset-free scheme comes back the same.)"""
    pytest.importorskip("compressed_tensors")
    artifact = _build(tiny, "kv-fp8-no-offset", QuantScheme(kv_cache=KVCacheScheme(dtype="fp8", key_smoothing=False)))
    imported = import_checkpoint(export_compressed_tensors(artifact, tmp_path / "ct").path, tmp_path / "back")
    verify_artifact(imported)
    a, b = load_artifact_quantized(artifact), load_artifact_quantized(imported)
    assert not b.weights and b.scheme.kv_cache.dtype == "fp8"
    assert a.kv.keys() == b.kv.keys() and all(torch.equal(x.scale, y.scale) for i in a.kv for x, y in zip(a.kv[i], b.kv[i]))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits = [load_for_serving(str(p), dtype="fp32").model(ids) for p in (artifact, imported)]
    assert torch.equal(logits[0], logits[1])


def test_an_int8_head_survives_export_and_import_bit_for_bit(tiny, tmp_path):
    """The presets' int8 head is exported as its exact fp32 values (compressed-tensors has no form
    for it beside int4 layers); import finds its codes and scales again rather than storing bf16."""
    pytest.importorskip("compressed_tensors")
    artifact = _build(tiny, "w4a16-asym", SCHEMES["w4a16-asym"])
    exported = export_compressed_tensors(artifact, tmp_path / "ct").path
    head = read_checkpoint(exported).qm.weights["lm_head"]
    assert head.num_bits == 8 and head.qweight.dtype == torch.int8
    # the artifact's head as its exact values (how the export writes it)
    assert same_bits(head.dequantize(), load_artifact_quantized(artifact).fp_tensors["lm_head.weight"])
    imported = import_checkpoint(exported, tmp_path / "back")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits = [load_for_serving(str(p), dtype="fp32").model(ids) for p in (artifact, imported)]
    assert torch.equal(logits[0], logits[1])


# ---------------------------------------------------------------------------------------------
# Checkpoints written by other tools' layouts


def _source_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _write_checkpoint(directory: Path, model_dir: Path, tensors: dict, quantization_config: dict | None,
                      extra_files: dict | None = None) -> Path:
    directory.mkdir(parents=True)
    config = json.loads((model_dir / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, directory / name)
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _pack_rows(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """AutoGPTQ / AutoAWQ packing: word k of a row holds values k*n .. k*n+n-1 of that row,
    value order[i] in bits i*b .. i*b+b-1 (n = 32 / b). values [rows, cols] non-negative."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    v = values.to(torch.int64)
    words = torch.zeros(v.shape[0], v.shape[1] // per_word, dtype=torch.int64)
    for col in range(words.shape[1]):
        for i in range(per_word):
            words[:, col] |= (v[:, col * per_word + order[i]] & ((1 << bits) - 1)) << (bits * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _unsigned_quantization(W, bits, symmetric, group_size):
    """qkiln RTN with fp16 scales -> unsigned codes [out, in], zeros [out, groups], scales [out, groups]."""
    w = quantize_rtn(W, WeightScheme(num_bits=bits, symmetric=symmetric, group_size=group_size,
                                     scale_dtype="float16"))
    mid = 1 << (bits - 1)
    if symmetric:
        return (w.qweight.to(torch.int16) + mid), torch.full_like(w.scales, mid, dtype=torch.int16), w.scales
    return w.qweight.to(torch.int16), w.zeros.to(torch.int16), w.scales


def write_gptq(directory, model_dir, bits, group_size, sym, checkpoint_format, act_order_layer=None):
    """AutoGPTQ's QuantLinear.pack layout: qweight [in*b/32, out] packed along in, qzeros
    [groups, out*b/32] along out holding zero - 1 for v1 (masked, as GPTQModel writes it),
    scales fp16 [groups, out], g_idx int32."""
    tensors = _source_weights(model_dir)
    for name in linear_names():
        W = tensors.pop(name + ".weight")
        codes, zeros, scales = _unsigned_quantization(W, bits, sym, None if group_size == -1 else group_size)
        in_features = W.shape[1]
        g_idx = torch.arange(in_features, dtype=torch.int32) // (in_features if group_size == -1 else group_size)
        if name == act_order_layer:  # columns quantized in a permuted order: groups no longer consecutive
            g_idx = g_idx[torch.randperm(in_features, generator=torch.Generator().manual_seed(0))]
        stored_zeros = (zeros - 1) & ((1 << bits) - 1) if checkpoint_format == "gptq" else zeros
        tensors[name + ".qweight"] = _pack_rows(codes, bits).t().contiguous()  # [in*b/32, out]
        tensors[name + ".qzeros"] = _pack_rows(stored_zeros.t().contiguous(), bits)
        tensors[name + ".scales"] = scales.t().contiguous().half()
        tensors[name + ".g_idx"] = g_idx
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": False,
          "checkpoint_format": checkpoint_format}
    return _write_checkpoint(Path(directory), model_dir, tensors, qc)


def gptq_reference(tensors, name, bits, checkpoint_format):
    """AutoGPTQ's torch dequantization (QuantLinear.forward without kernels), in fp32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    mask = (1 << bits) - 1
    qweight = tensors[name + ".qweight"].to(torch.int64) & 0xFFFFFFFF
    qzeros = tensors[name + ".qzeros"].to(torch.int64) & 0xFFFFFFFF
    zeros = ((qzeros[:, :, None] >> shifts) & mask).reshape(qzeros.shape[0], -1)  # [groups, out]
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & mask
    weight = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])  # [in, out]
    g_idx = tensors[name + ".g_idx"].long()
    scales = tensors[name + ".scales"].float()
    return (scales[g_idx] * (weight - zeros[g_idx]).float()).t()  # [out, in]


@pytest.mark.parametrize("bits, group_size, sym, checkpoint_format", [
    (4, 32, True, "gptq"), (4, 64, False, "gptq"), (4, 32, False, "gptq_v2"), (8, -1, True, "gptq")])
def test_import_gptq_is_bit_exact(tiny, tmp_path, bits, group_size, sym, checkpoint_format):
    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, bits, group_size, sym, checkpoint_format)
    artifact = import_checkpoint(src, tmp_path / "a")
    verify_artifact(artifact)
    tensors = load_file(str(src / "model.safetensors"))
    qm = load_artifact_quantized(artifact)
    assert sorted(qm.weights) == sorted(linear_names())
    for name in linear_names():
        assert same_bits(qm.weights[name].dequantize(), gptq_reference(tensors, name, bits, checkpoint_format)), name
    manifest = json.loads((artifact / "manifest.json").read_text())
    entry = manifest["quantization"]["linears"]["model.layers.1.mlp.down_proj"]
    assert entry["format"] == f"int{bits}" and entry["symmetric"] == sym
    assert manifest["source"]["kind"] == "gptq" and manifest["recipe"]["scheme"]["algorithm"] == "gptq"


def test_import_gptq_refuses_act_order_g_idx(tiny, tmp_path):
    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 32, True, "gptq", act_order_layer="model.layers.1.mlp.up_proj")
    with pytest.raises(SourceModelError, match=r"model\.layers\.1\.mlp\.up_proj: act-order g_idx"):
        import_checkpoint(src, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_import_refuses_a_checkpoint_that_disagrees_with_its_config(tiny, tmp_path):
    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 32, True, "gptq")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.qzeros"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(SourceModelError, match=r"q_proj\.qzeros is missing"):
        import_checkpoint(src, tmp_path / "a")


def _damage(src: Path, how: str) -> None:
    path = src / "model.safetensors"
    if how == "truncated file":
        path.write_bytes(path.read_bytes()[:5000])
        return
    if how in ("quantization_config a string", "group_size 0", "bits a string"):
        config = json.loads((src / "config.json").read_text())
        qc = config["quantization_config"]
        config["quantization_config"] = {"quantization_config a string": "gptq",
                                         "group_size 0": qc | {"group_size": 0},
                                         "bits a string": qc | {"bits": "4"}}[how]
        (src / "config.json").write_text(json.dumps(config))
        return
    tensors = load_file(str(path))
    if how == "a NaN scale":
        tensors["model.layers.0.mlp.up_proj.scales"][0, 0] = float("nan")
    elif how == "a short embedding":
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:100].clone()
    save_file(tensors, str(path))


DAMAGE = {"truncated file": "not a valid safetensors file",
          "quantization_config a string": "not an object", "group_size 0": "does not describe these weights",
          "bits a string": "must be an integer", "a NaN scale": "NaN", "a short embedding": "wrong shape"}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_with_what_is_wrong(tiny, tmp_path, how):
    """Each of these imported (and verified) into an artifact that crashed or generated NaN, or
    failed with a traceback; each is a SourceModelError naming the problem now."""
    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 32, False, "gptq")
    _damage(src, how)
    with pytest.raises(SourceModelError, match=DAMAGE[how]):
        import_checkpoint(src, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_a_stray_file_beside_model_safetensors_is_not_read_as_transformers_does_not(tiny, tmp_path):
    """Without an index transformers reads model.safetensors alone; a copy beside it (a re-save,
    an adapter) had been read too ("tensor ... is in both")."""
    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 32, False, "gptq")
    shutil.copy(src / "model.safetensors", src / "model-extra.safetensors")
    assert import_checkpoint(src, tmp_path / "a").is_dir()


def _shard(src: Path, stale: bool) -> None:
    """Split model.safetensors into two shards named by an index, as transformers saves large
    models; with `stale`, the old single file stays beside them, damaged (as after a re-save)."""
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(src / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if stale:
        _damage(src, "a NaN scale")
    else:
        (src / "model.safetensors").unlink()


def test_a_sharded_checkpoint_reads_the_shards_its_index_names(tiny, tmp_path):
    """Only the index's shards are weights (as transformers reads them): a stale single file beside
    them was read too, and refused as duplicate tensors."""
    root, model_dir, _ = tiny
    whole = read_checkpoint(write_gptq(tmp_path / "whole", model_dir, 4, 32, True, "gptq")).qm
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 32, True, "gptq")
    _shard(src, stale=True)
    sharded = read_checkpoint(src).qm
    for name, w in whole.weights.items():
        assert torch.equal(w.qweight, sharded.weights[name].qweight) and same_bits(w.scales, sharded.weights[name].scales)
    verify_artifact(import_checkpoint(src, tmp_path / "a"))
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceModelError, match="model-00002-of-00002.safetensors, not in the directory"):
        read_checkpoint(src)


def test_a_sharded_hf_model_loads_as_the_whole_one(tiny, tmp_path):
    from qkiln.runtime.source import load_source

    root, model_dir, _ = tiny
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    _shard(sharded, stale=False)
    (sharded / "stale.safetensors").write_bytes(b"not weights")  # not named by the index: not read
    whole, parts = load_source(model_dir), load_source(sharded)
    assert sorted(whole.state_dict) == sorted(parts.state_dict)
    assert all(same_bits(whole.state_dict[n], parts.state_dict[n]) for n in whole.state_dict)


def test_int4_groups_the_cpu_cannot_serve_are_refused_at_import(tiny, tmp_path):
    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 16, True, "gptq")
    with pytest.raises(SourceModelError, match="multiple of 32"):
        import_checkpoint(src, tmp_path / "a")
    verify_artifact(import_checkpoint(src, tmp_path / "b", target="cuda"), check_target=False)


def test_compressed_tensors_groups_take_the_most_specific_target():
    """compressed-tensors' precedence: an exact layer name, then a regex, then the class."""
    from qkiln.compile.checkpoint_layouts import _ct_group

    by_class, by_regex, by_name = ({"targets": ["Linear"]}, {"targets": ["re:.*down_proj$"]},
                                   {"targets": ["model.layers.0.mlp.down_proj"]})
    groups = [by_class, by_regex, by_name]
    assert _ct_group("model.layers.0.mlp.down_proj", groups) is by_name
    assert _ct_group("model.layers.1.mlp.down_proj", groups) is by_regex
    assert _ct_group("model.layers.1.mlp.up_proj", groups) is by_class
    assert _ct_group("model.layers.1.mlp.up_proj", [by_regex]) is None


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def write_awq(directory, model_dir, group_size):
    """AutoAWQ's WQLinear_GEMM.from_linear layout: qweight [in, out/8] and qzeros [groups, out/8]
    packed along out in the order 0,2,4,6,1,3,5,7; scales fp16 [groups, out]; zero as is."""
    tensors = _source_weights(model_dir)
    for name in linear_names():
        codes, zeros, scales = _unsigned_quantization(tensors.pop(name + ".weight"), 4, False, group_size)
        tensors[name + ".qweight"] = _pack_rows(codes.t().contiguous(), 4, AWQ_ORDER)
        tensors[name + ".qzeros"] = _pack_rows(zeros.t().contiguous(), 4, AWQ_ORDER)
        tensors[name + ".scales"] = scales.t().contiguous().half()
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return _write_checkpoint(Path(directory), model_dir, tensors, qc)


def test_import_awq_matches_compressed_tensors_autoawq_converter(tiny, tmp_path):
    root, model_dir, _ = tiny
    src = write_awq(tmp_path / "awq", model_dir, 32)
    artifact = import_checkpoint(src, tmp_path / "a")
    verify_artifact(artifact)
    qm = load_artifact_quantized(artifact)
    assert qm.weights["model.layers.0.self_attn.q_proj"].zeros is not None
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert import AutoAWQConverter

    converter = AutoAWQConverter.from_autoawq_config(json.loads((src / "config.json").read_text())["quantization_config"])
    converted = converter.process(load_file(str(src / "model.safetensors")))
    scheme = converter.update_config(None).config_groups["config_group_0"]
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    for name in linear_names():
        state = {p: converted[f"{name}.{p}"] for p in compressor.compression_param_names(scheme)}
        state["weight_scale"] = state["weight_scale"].float()  # fp32 arithmetic: the product is exact
        expected = compressor.decompress(state, scheme)["weight"]
        assert same_bits(qm.weights[name].dequantize(), expected), name


def test_import_checkpoint_made_by_compressed_tensors_compressors(tiny, tmp_path):
    """int4 asymmetric groups (MLP) and fp8 W8A8 dynamic (attention) in one checkpoint, an fp8 KV
    cache scheme, all quantized and packed by compressed-tensors' own functions."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    root, model_dir, _ = tiny
    int4 = QuantizationScheme(targets=["re:.*mlp\\..*"], format="pack-quantized", weights=dict(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32))
    fp8 = QuantizationScheme(targets=["re:.*self_attn\\..*"], format="float-quantized",
                             weights=dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                             input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True))
    config = QuantizationConfig(config_groups={"group_0": int4, "group_1": fp8}, ignore=["lm_head"],
                                format="mixed-precision", quantization_status="compressed",
                                kv_cache_scheme=dict(num_bits=8, type="float", strategy="tensor", dynamic=False))
    tensors = _source_weights(model_dir)
    for name in linear_names():
        scheme = int4 if ".mlp." in name else fp8
        W = tensors.pop(name + ".weight")
        grouped = W.reshape(W.shape[0], -1, 32) if scheme is int4 else W.unsqueeze(1)  # [out, groups, size]
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
        state = {"weight": W, "weight_scale": scale, "weight_zero_point": zero_point}
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        tensors.update({f"{name}.{k}": v for k, v in compressor.compress(state, scheme).items()})
    for i in range(2):
        for j, key in enumerate(("k_scale", "v_scale")):
            tensors[f"model.layers.{i}.self_attn.{key}"] = torch.tensor([0.01 * (1 + i + 2 * j)])
    src = _write_checkpoint(tmp_path / "ct", model_dir, tensors, None)
    ModelCompressor(quantization_config=config).update_config(str(src))

    artifact = import_checkpoint(src, tmp_path / "a")
    verify_artifact(artifact)
    qm = load_artifact_quantized(artifact)
    for name in linear_names():
        scheme = int4 if ".mlp." in name else fp8
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        state = {p: tensors[f"{name}.{p}"] for p in compressor.compression_param_names(scheme)}
        assert same_bits(qm.weights[name].dequantize(), compressor.decompress(state, scheme)["weight"].float()), name
    manifest = json.loads((artifact / "manifest.json").read_text())
    formats = {e["format"] for e in manifest["quantization"]["linears"].values()}
    assert formats == {"int4", "fp8"} and manifest["kv_cache"]["dtype"] == "fp8"
    assert torch.equal(qm.kv[1][1].scale, torch.tensor([0.04, 0.04]))  # per tensor -> every KV head
    # and back out: two config groups naming their layers, per-channel fp8 beside grouped int4
    back = export_compressed_tensors(artifact, tmp_path / "back")
    qc = json.loads((back.path / "config.json").read_text())["quantization_config"]
    assert sorted(len(g["targets"]) for g in qc["config_groups"].values()) == [6, 8]
    assert back.kv_strategy == "tensor" and check_export(artifact, back.path) == 14


def test_unpacked_zero_points_import_exactly_and_a_bad_layout_is_refused(tiny, tmp_path):
    """compressed-tensors wrote asymmetric pack-quantized zero points one per int8 ([out, groups])
    before it packed them into int32 words; reading those as words imported every layer wrong."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    root, model_dir, _ = tiny
    scheme = QuantizationScheme(targets=["Linear"], format="pack-quantized", weights=dict(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32))
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors, expected = _source_weights(model_dir), {}
    for name in linear_names():
        W = tensors.pop(name + ".weight")
        scale, zero_point = calculate_qparams(*(f(W.reshape(W.shape[0], -1, 32), -1) for f in (torch.amin, torch.amax)),
                                              scheme.weights)
        packed = compressor.compress({"weight": W, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        expected[name] = compressor.decompress(dict(packed), scheme)["weight"].float()
        tensors.update({f"{name}.{k}": v for k, v in packed.items()})
        tensors[f"{name}.weight_zero_point"] = zero_point.to(torch.int8).contiguous()  # the older, unpacked layout
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="pack-quantized",
                                quantization_status="compressed")

    def imported(tensors, name):
        src = _write_checkpoint(tmp_path / name, model_dir, tensors, None)
        ModelCompressor(quantization_config=config).update_config(str(src))
        return import_checkpoint(src, tmp_path / f"{name}-artifact")

    qm = load_artifact_quantized(imported(tensors, "unpacked"))
    assert all(same_bits(qm.weights[name].dequantize(), expected[name]) for name in linear_names())
    name = linear_names()[0]
    tensors[f"{name}.weight_zero_point"] = tensors[f"{name}.weight_zero_point"].to(torch.int16)[:-1]  # neither layout
    with pytest.raises(SourceModelError, match=f"linear {name}: weight_zero_point has shape"):
        imported(tensors, "bad")


def test_runtime_generates_from_an_imported_artifact(tiny, tmp_path):
    from qkiln.runtime.llm import LLM
    from qkiln.runtime.sampling_params import SamplingParams

    root, model_dir, _ = tiny
    src = write_gptq(tmp_path / "gptq", model_dir, 4, 32, False, "gptq")
    artifact = import_checkpoint(src, tmp_path / "a")
    again = import_checkpoint(src, tmp_path / "b")
    shard = "weights/model-00001-of-00001.safetensors"
    assert (artifact / shard).read_bytes() == (again / shard).read_bytes()  # reproducible
    llm = LLM(str(artifact), dtype="fp32", num_kv_blocks=32)
    out = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and all(0 <= t < 260 for t in out[0].token_ids)


def run_cli(*args):
    from typer.testing import CliRunner

    from qkiln.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_export_and_import(tiny, tmp_path):
    pytest.importorskip("compressed_tensors")
    artifact = _build(tiny, "w4a16-asym", SCHEMES["w4a16-asym"])
    done = run_cli("export", artifact, "--format", "compressed-tensors", "-o", tmp_path / "ct")
    assert done.exit_code == 0 and "verified with compressed-tensors" in done.stdout, done.output
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "ct").iterdir()} == \
        {f.name: 0o644 for f in (tmp_path / "ct").iterdir()}  # readable by a server running as another user
    again = run_cli("export", artifact, "--format", "compressed-tensors", "-o", tmp_path / "ct")
    assert again.exit_code == 6 and again.stderr.startswith("error:") and "already exists" in again.stderr
    assert run_cli("export", artifact, "--format", "compressed-tensors", "-o", tmp_path / "ct", "--force").exit_code == 0
    (tmp_path / "ct" / "README.md").write_text("model card")  # as a Hub upload adds: --force keeps it
    kept = run_cli("export", artifact, "--format", "compressed-tensors", "-o", tmp_path / "ct", "--force")
    assert kept.exit_code == 6 and "holds files qkiln did not write (README.md)" in kept.stderr
    (tmp_path / "ct" / "README.md").unlink()
    theirs = tmp_path / "hf"  # someone's Hugging Face checkpoint: --force must not delete it
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    (theirs / "pytorch_model.bin").write_bytes(b"weights")
    refused = run_cli("export", artifact, "--format", "compressed-tensors", "-o", theirs, "--force")
    assert refused.exit_code == 6 and "refusing to replace" in refused.stderr
    assert (theirs / "pytorch_model.bin").read_bytes() == b"weights"
    bad = run_cli("export", artifact, "--format", "gguf", "-o", tmp_path / "x")
    assert bad.exit_code == 2 and "compressed-tensors" in bad.stderr and not (tmp_path / "x").exists()
    imported = run_cli("import", tmp_path / "ct", "-o", tmp_path / "a")
    assert imported.exit_code == 0, imported.output
    assert run_cli("verify", tmp_path / "a").exit_code == 0
    inspected = run_cli("inspect", tmp_path / "a", "--json")
    source = json.loads(inspected.stdout)["source"]
    assert inspected.exit_code == 0 and source["kind"] == "compressed-tensors"
    made = read_manifest(artifact)  # where the weights were made survives the round trip
    assert source["exported_from"] == {"artifact": made.name, "recipe": made.recipe["name"],
                                       "source_sha256": made.source["sha256"]}
    missing = run_cli("import", tmp_path / "nope", "-o", tmp_path / "b")
    assert missing.exit_code == 3 and "config.json" in missing.stderr
