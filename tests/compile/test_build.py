"""`qkiln build` end to end on a tiny real checkpoint: verify, tamper, reproducibility, cache,
recipes refused up front, and the artifact served by the runtime without transformers."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkiln.compile.artifact import verify_artifact
from qkiln.compile.build import build
from qkiln.compile.recipe import EvalSpec, load_recipe, preset
from qkiln.errors import ArtifactError, CalibrationDataError, RecipeError, SourceModelError
from qkiln.quant.scheme import WeightScheme
from tiny_models import write_tiny_model_and_text

SHARED_TEXT = Path(__file__).resolve().parents[2] / "../shared/data/janeausten/emma.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    return (root, *write_tiny_model_and_text(root))


def _recipe(name, text, **calibration):
    r = preset(name)
    return dataclasses.replace(
        r, calibration=dataclasses.replace(r.calibration, source=str(text), num_samples=4, seq_len=64, **calibration),
        evaluation=dataclasses.replace(r.evaluation, data=str(text), seq_len=64, max_tokens=256))


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_build_verify_and_tamper(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    result = build(str(model), _recipe("w4a16-gptq+kv-int4", text), tmp_path / "a", progress=False, log=lambda m: None)
    assert len(verify_artifact(result.path)) >= 4
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["calibration"]["token_sha256"] and manifest["source"]["sha256"]
    assert manifest["accuracy"]["perplexity"] > 1 and "kl_divergence" in manifest["accuracy"]
    assert manifest["quantization"]["linears"]["model.layers.0.mlp.down_proj"]["format"] == "int4"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[2], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout (CI's is): the commit that built it, which the version (0.1.0) is not
        assert manifest["toolchain"]["qkiln_revision"].split("+")[0] == head.stdout.strip()
    for rel in [p for p in _files(result.path) if p.startswith("weights/")]:
        f = result.path / rel
        original = f.read_bytes()
        f.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(ArtifactError, match=rel.split("/")[-1]):
            verify_artifact(result.path)
        f.write_bytes(original)
    verify_artifact(result.path)


def test_two_builds_are_byte_identical_and_kv_change_reuses_layers(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    first = build(str(model), _recipe("w4a16-awq+kv-fp8", text), tmp_path / "a", progress=False, log=lambda m: None)
    # the same text read through another path: the manifest and reports name the file, not the path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / text.name).write_bytes(text.read_bytes())
    monkeypatch.chdir(elsewhere)
    again = build(str(model), _recipe("w4a16-awq+kv-fp8", Path(text.name)), tmp_path / "b", use_cache=False,
                  progress=False, log=lambda m: None)
    a, b = _files(first.path), _files(again.path)
    ma, mb = (json.loads(files.pop("manifest.json")) for files in (a, b))
    assert ma["recipe"]["evaluation"]["data"] == text.name and ma["calibration"]["source"] == text.name
    # an fp8 cache has no groups: neither its manifest entry nor the recorded recipe lists int4's fields
    assert ma["kv_cache"]["dtype"] == "fp8" and "group_size" not in ma["kv_cache"]
    assert ma["recipe"]["scheme"]["kv_cache"] == ma["kv_cache"]
    assert a == b  # only the artifact name (the directory's) differs, and the manifest's digest with it
    assert {k: v for k, v in ma.items() if k not in ("name", "digest")} == \
        {k: v for k, v in mb.items() if k not in ("name", "digest")}
    assert first.num_cached_layers == 0
    # the manifest's recipe section (with the fallbacks the build recorded) is a recipe file that
    # rebuilds it: it was refused for its `fallbacks` key
    (tmp_path / "again.json").write_text(json.dumps(ma["recipe"]))
    assert load_recipe(str(tmp_path / "again.json")).to_dict() == {k: v for k, v in ma["recipe"].items()
                                                                    if k != "fallbacks"}
    kv_only = build(str(model), _recipe("w4a16-awq+kv-int4", text), tmp_path / "c", progress=False, log=lambda m: None)
    assert kv_only.num_cached_layers == kv_only.num_layers
    w_c = _files(kv_only.path)["weights/model-00001-of-00001.safetensors"]
    assert w_c != a["weights/model-00001-of-00001.safetensors"]  # KV scales differ, weights reused


def test_an_output_path_through_dot_dot_is_named_after_its_folder(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    result = build(str(model), _recipe("w4a16-rtn", text), Path("b/x/.."), progress=False, log=lambda m: None)
    # it was named "..", built in a folder b/x made on the way
    assert json.loads((result.path / "manifest.json").read_text())["name"] == "b"
    assert result.path == tmp_path / "b" and not (tmp_path / "b" / "x").exists()


def test_kv_only_recipe_keeps_weights_in_high_precision(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    result = build(str(model), _recipe("kv-int4", text), tmp_path / "kv", progress=False, log=lambda m: None)
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["quantization"]["linears"] == {} and manifest["kv_cache"]["dtype"] == "int4"
    assert manifest["accuracy"]["perplexity_change"] < 0.05


def _with_large_keys(model: Path, out: Path, factor: float) -> Path:
    """The model with layer 0's keys `factor` times larger and its queries as much smaller: the
    same function, with K far out in magnitude (a real model's outlier channels, exaggerated)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] *= factor
    tensors["model.layers.0.self_attn.q_proj.weight"] /= factor
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_int4_kv_refuses_keys_past_its_fp16_group_parameters(tiny, tmp_path, monkeypatch):
    """An int4 cache keeps each group's minimum and scale in fp16: keys past 65504 made them inf
    and every answer NaN (a build with evaluation then failed on its manifest, `not plain JSON`).
    The cache now saturates there instead; the build still refuses calibration data that goes past
    it, names the layer, and warns when the calibration data comes near."""
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    huge = _with_large_keys(model, tmp_path / "huge", 2e5)
    with pytest.raises(RecipeError, match=r"model\.layers\.0: its keys reach 1\.\d+e\+05 .*fp8 KV cache"):
        build(str(huge), _recipe("kv-int4", text), tmp_path / "a", progress=False, log=lambda m: None)
    assert not (tmp_path / "a").exists()
    fp8 = build(str(huge), _recipe("kv-fp8", text), tmp_path / "b", progress=False, log=lambda m: None)
    assert verify_artifact(fp8.path)  # fp8's per-head scales are fp32: no such limit
    # Serving such a model with an int4 cache anyway (no calibration to check) saturates: finite
    # answers, not NaN logprobs.
    from qkiln.runtime.llm import LLM
    from qkiln.runtime.sampling_params import SamplingParams

    out = LLM(str(huge), kv_dtype="int4", dtype="float32").generate(
        ["a b c d e f"], SamplingParams(max_tokens=4, logprobs=2, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(lp.logprob == lp.logprob for step in out.logprobs for lp in step.values())

    logs = []
    large = _with_large_keys(model, tmp_path / "large", 1e4)
    build(str(large), _recipe("kv-int4", text), tmp_path / "c", progress=False, log=logs.append)
    warning = [m for m in logs if "int4 KV cache" in m]
    assert len(warning) == 1 and "model.layers.0 keys" in warning[0] and "model.layers.1" not in warning[0]
    logs.clear()
    build(str(model), _recipe("kv-int4", text), tmp_path / "d", progress=False, log=logs.append)
    assert not [m for m in logs if "int4 KV cache" in m]


def test_bad_recipes_are_refused_before_any_work(tiny, tmp_path):
    root, model, text = tiny
    with pytest.raises(RecipeError, match="unknown preset"):
        load_recipe("w3a16-gptq")
    bad = tmp_path / "r.yaml"
    bad.write_text("scheme:\n  weights: {num_bits: 3}\n")
    with pytest.raises(RecipeError, match="num_bits"):
        load_recipe(str(bad))
    bad.write_text("scheme: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(bad))
    long = _recipe("w4a16-rtn", text)
    long = dataclasses.replace(long, calibration=dataclasses.replace(long.calibration, seq_len=100_000))
    with pytest.raises(RecipeError, match="exceeds the model's context"):
        build(str(model), long, tmp_path / "x", progress=False, log=lambda m: None)
    assert not (tmp_path / "x").exists()
    # an output path already taken fails before calibration (it used to after the whole build)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    logged = []
    with pytest.raises(ArtifactError, match="already exists"):
        build(str(model), _recipe("w4a16-gptq", text), taken, progress=False, log=logged.append)
    assert logged == [] and (taken / "notes.txt").read_text() == "keep me"
    # a named evaluation file that is missing is an error up front, not a build without a report
    missing = dataclasses.replace(long, calibration=_recipe("w4a16-rtn", text).calibration,
                                  evaluation=dataclasses.replace(long.evaluation, data=str(tmp_path / "nope.txt")))
    with pytest.raises(CalibrationDataError, match="nope.txt: no such file"):
        build(str(model), missing, tmp_path / "y", progress=False, log=logged.append)
    assert logged == [] and not (tmp_path / "y").exists()
    # schemes an artifact could not store or the target could not serve: int8 weights with zero
    # points or groups (the artifact used to crash, or to store asymmetric codes as int8 without
    # their zero points), int4 groups the CPU kernels do not take (served used to fail at load)
    rtn = _recipe("w4a16-rtn", text)
    for weights, message in ((WeightScheme(8, symmetric=False, group_size=None), "8-bit integer weights"),
                             (WeightScheme(8, symmetric=True, group_size=32), "8-bit integer weights"),
                             (WeightScheme(4, symmetric=False, group_size=48), "multiple of 32")):
        r = dataclasses.replace(rtn, scheme=dataclasses.replace(rtn.scheme, weights=weights))
        with pytest.raises(RecipeError, match=message):
            build(str(model), r, tmp_path / "z", progress=False, log=logged.append)
        assert logged == [] and not (tmp_path / "z").exists()


def test_recipe_file_round_trip(tmp_path):
    r = preset("fp8-w8a8+kv-fp8")
    (tmp_path / "r.json").write_text(json.dumps(r.to_dict()))
    assert load_recipe(str(tmp_path / "r.json")).scheme == r.scheme
    (tmp_path / "r.toml").write_text('preset = "w4a16-gptq"\n[calibration]\nnum_samples = 8\n')
    t = load_recipe(str(tmp_path / "r.toml"))
    assert t.scheme.algorithm == "gptq" and t.calibration.num_samples == 8


def test_recipe_overrides_merge_into_their_sections_and_are_checked():
    r = preset("w4a16-gptq")
    o = r.with_overrides(calibration={"num_samples": 8}, evaluation={"data": "bundled:wikitext2-test-raw"},
                         target="cuda")
    assert (o.calibration.num_samples, o.calibration.seq_len, o.calibration.source) == \
        (8, r.calibration.seq_len, r.calibration.source)
    assert (o.evaluation.data, o.evaluation.max_tokens, o.target, o.scheme) == \
        ("bundled:wikitext2-test-raw", r.evaluation.max_tokens, "cuda", r.scheme)
    assert r.with_overrides(calibration={}, evaluation=None) == r
    with pytest.raises(RecipeError, match="num_samples >= 1"):
        r.with_overrides(calibration={"num_samples": 0})


def test_artifact_serves_without_transformers(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    art = build(str(model), _recipe("fp8-w8a8-static+kv-fp8", text), tmp_path / "a", progress=False,
                log=lambda m: None).path
    code = (
        "import sys\n"
        "from qkiln.runtime.llm import LLM\n"
        "from qkiln.runtime.sampling_params import SamplingParams\n"
        f"llm = LLM({str(art)!r}, num_kv_blocks=32)\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))\n"
        "assert len(out[0].token_ids) == 5, out\n"
        "assert llm.engine.kv_dtype == 'fp8'\n"
        "print('transformers' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_fp8_gptq_preset_keeps_the_last_mlp_in_bf16_and_serves(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    art = build(str(model), _recipe("fp8-w8a8", text), tmp_path / "a", progress=False, log=lambda m: None).path
    manifest = json.loads((art / "manifest.json").read_text())
    linears = manifest["quantization"]["linears"]
    assert manifest["recipe"]["scheme"]["algorithm"] == "gptq" and manifest["calibration"]["token_sha256"]
    last = {f"model.layers.1.mlp.{n}_proj" for n in ("gate", "up", "down")}  # the tiny model has 2 layers
    assert last.isdisjoint(linears) and len(linears) == 2 * 7 - 3
    assert all(e["format"] == "fp8" and e["algorithm"] == "gptq" and e["group_size"] is None for e in linears.values())
    assert manifest["accuracy"]["perplexity_change"] < 0.05
    from qkiln.runtime.llm import LLM
    from qkiln.runtime.sampling_params import SamplingParams

    out = LLM(str(art), num_kv_blocks=16).generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    # served under its folder's name, which a registry may have changed (was the name built under)
    from qkiln.runtime.loader import load_for_serving

    renamed = shutil.copytree(art, tmp_path / "registry-v7")
    assert load_for_serving(str(renamed)).name == "registry-v7"


def test_static_input_scales_cover_what_the_quantized_layer_feeds_each_gemm(tiny, tmp_path, monkeypatch):
    """Static fp8 scales are observed group by group on the quantized upstream (as the served
    model computes): on the calibration tokens no linear's input passes its scale's range. Observed
    on the unquantized layer, layer 1's o_proj input had passed it by 1.6% here (down_proj's by
    4.5% on another tiny model) and was clipped."""
    from safetensors import safe_open

    from qkiln.calib_data import load_text_source, sample_token_set
    from qkiln.compile.model_ref import open_model
    from qkiln.quant.fp8 import FP8_MAX

    from safetensors.torch import load_file, save_file

    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    # a bf16 source, as real ones are: the artifact stores its embeddings as calibration saw them
    bf16 = shutil.copytree(model, tmp_path / "bf16")
    save_file({k: v.bfloat16() for k, v in load_file(str(bf16 / "model.safetensors")).items()},
              str(bf16 / "model.safetensors"))
    recipe = _recipe("fp8-w8a8-static", text)
    result = build(str(bf16), recipe, tmp_path / "a", progress=False, log=lambda m: None)
    scales = {}
    for shard in (result.path / "weights").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            scales |= {k.removesuffix(".input_scale"): f.get_tensor(k) for k in f.keys() if k.endswith(".input_scale")}
    loaded = open_model(str(result.path))
    spec = recipe.calibration
    ids = torch.tensor(sample_token_set(load_text_source(spec.source, None, spec.seed), loaded.tokenizer,
                                        spec.num_samples, spec.seq_len, spec.seed).input_ids)
    amax, hooks = {}, []
    for name, module in loaded.model.named_modules():
        if name in scales:  # prepended: the input before the simulation's own fake-quant hook
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item())),
                prepend=True))
    with torch.no_grad():
        for start in range(0, len(ids), 8):  # the build's calibration batches
            loaded.model(ids[start:start + 8])
    assert set(amax) == set(scales) and len(scales) == 14
    over = {name: amax[name] / (float(scales[name]) * FP8_MAX) - 1 for name in scales}
    assert max(over.values()) <= 1e-6, over
    assert min(over.values()) > -1e-3, over  # and the scales are not loose either


def test_fp8_rtn_preset_is_data_free_and_quantizes_every_layer(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    recipe = preset("fp8-w8a8-rtn")
    assert not recipe.needs_calibration
    art = build(str(model), recipe, tmp_path / "a", progress=False, log=lambda m: None).path
    manifest = json.loads((art / "manifest.json").read_text())
    linears = manifest["quantization"]["linears"]
    assert len(linears) == 2 * 7 and all(e["format"] == "fp8" and e["algorithm"] == "rtn" for e in linears.values())
    assert manifest["calibration"] is None  # no calibration tokens were read


def test_awq_module_level_loss_builds(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    r = _recipe("w4a16-awq", text)
    r = dataclasses.replace(r, scheme=dataclasses.replace(
        r.scheme, awq=dataclasses.replace(r.scheme.awq, module_loss=True, loss_samples=2)))
    manifest = build(str(model), r, tmp_path / "a", progress=False, log=lambda m: None).manifest
    assert manifest.recipe["scheme"]["awq"]["module_loss"] is True
    assert manifest.quantization["linears"]["model.layers.1.self_attn.q_proj"]["algorithm"] == "awq"
    assert manifest.accuracy["perplexity_change"] < 0.5


def test_awq_options_build_and_are_recorded(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    r = _recipe("w4a16-awq", text)
    awq = dataclasses.replace(r.scheme.awq, quantizer="gptq", scale_o_proj=True, fp_inputs=True, grid_size=5)
    r = dataclasses.replace(r, scheme=dataclasses.replace(
        r.scheme, awq=awq, weights=dataclasses.replace(r.scheme.weights, observer="mse")))
    manifest = build(str(model), r, tmp_path / "a", progress=False, log=lambda m: None).manifest
    recorded = manifest.recipe["scheme"]
    assert recorded["awq"]["quantizer"] == "gptq" and recorded["awq"]["scale_o_proj"] is True
    assert recorded["awq"]["fp_inputs"] is True and recorded["weights"]["observer"] == "mse"
    entry = manifest.quantization["linears"]["model.layers.1.self_attn.o_proj"]
    assert entry["algorithm"] == "awq" and entry["format"] == "int4"
    assert manifest.accuracy["perplexity_change"] < 0.5


def test_the_accuracy_report_describes_the_artifact(tiny, tmp_path, monkeypatch):
    """The build scores the model as the artifact stores it (bf16 embeddings and unquantized
    weights), so `qkiln eval ARTIFACT` on the same protocol gives the report's numbers."""
    from qkiln.compile.evaluate import evaluate
    from qkiln.compile.model_ref import open_model

    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    result = build(str(model), _recipe("w4a16-gptq+kv-int4", text), tmp_path / "a", progress=False,
                   log=lambda m: None)
    artifact = open_model(str(result.path))
    report = evaluate(artifact, artifact.tokenizer, str(text), 64, 256, progress=False)
    assert report["num_tokens"] == result.manifest.accuracy["num_tokens"]
    assert report["perplexity"] == pytest.approx(result.manifest.accuracy["perplexity"], rel=1e-6)


@pytest.mark.parametrize("recipe, message", [
    ("preset: 4\n", "preset must be a name"),
    ("preset: w4a16-rtn\nscheme: {weights: {num_bits: 4}}\n", "not both"),
    ("preset: w4a16-rtn\ncalibration: {num_samples: 8.5}\n", "calibration.num_samples must be int"),
    ("preset: w4a16-rtn\ncalibration: {seed: abc}\n", "calibration.seed must be int"),
    ("preset: w4a16-rtn\ncalibration: {source: 123}\n", "calibration.source must be str"),
    ("preset: w4a16-rtn\ncalibration: [1]\n", "calibration must be a mapping"),
    ("preset: w4a16-rtn\nevaluation: {seq_len: '512'}\n", "evaluation.seq_len must be int"),
    ("preset: w4a16-rtn\nevaluation: {seq_len: 1}\n", "seq_len >= 2"),
    ("preset: w4a16-rtn\nevaluation: {data: 123}\n", "evaluation.data must be str or null"),
    ("preset: w4a16-rtn\nevaluation: {window: 5}\n", "unknown evaluation keys ['window']"),
    # an llm-compressor user's recipes (s49 probe): each was accepted meaning something else, or a traceback
    ("scheme:\n  weights: {num_bits: 4, group_size: 64}\nscheme:\n  kv_cache: {dtype: int4}\n",
     "the key 'scheme' appears twice in one mapping (lines 1 and 3)"),  # was: a KV-only artifact
    ("scheme: {weights: {num_bits: 4, group_size: 64, group_size: 128}}\n", "'group_size' appears twice"),
    ("scheme: {weights: {num_bits: 4, group_size: 0200}}\n", "0200 (line 1) is read by YAML as 128"),
    ("scheme: {weights: {num_bits: 4, group_size: 0x40}}\n", "read by YAML as 64"),
    ("scheme: {weights: {num_bits: 4}}\nquantization: {kv_cache: {dtype: int4}}\n", "not both"),
    ("preset: w4a16-rtn\n1: a\nfoo: b\n", "unknown recipe keys ['1', 'foo']"),
    ("prest: w4a16-rtn\n", "unknown recipe keys ['prest']; a recipe takes name, preset or scheme"),
    ("# nothing yet\n", "recipe r is empty; give a preset: name or a scheme: section"),
    ("scheme: {weights: {4: x, foo: y}}\n", "unknown weights field(s) ['4', 'foo']"),
    ("scheme: {weights: {num_bits: 4}, ignore: null}\n", "ignore must be a list"),
    ("name: [a, b]\npreset: w4a16-rtn\n", "name must be a string"),
    ("scheme: {weights: {num_bits: 4}, algorithm: gptq, gptq: {dampening_frac: .inf}}\n", "finite number > 0"),
    ("scheme: {weights: {num_bits: 4}, gptq: {dampening_frac: 0.1}}\n", "algorithm is 'rtn', so they would not"),
    ("scheme: {weights: {num_bits: 4}, algorithm: gptq, awq: {clip: false}}\n", "awq options are given"),
    # errors name the field as the file spells it (were 'weights.type' for the head, 'WeightScheme.', 'int | None')
    ("scheme: {weights: {num_bits: 4}, lm_head: {type: fp8}}\n", "lm_head.type must be 'int' or 'float'"),
    ("scheme: {weights: {num_bits: 4, group_size: '64'}}\n", "weights.group_size must be a whole number or null"),
    ("preset: w4a16-rtn\nevaluation: {max_tokens: 1}\n", "--eval-tokens or evaluation.max_tokens"),
])
def test_recipe_files_with_wrong_types_are_refused_with_the_field(tmp_path, recipe, message):
    path = tmp_path / "r.yaml"
    path.write_text(recipe)
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(str(path))


def test_recipe_files_are_told_from_preset_names(tmp_path, monkeypatch):
    """A recipe file without a suffix, or a path, was taken for a preset name ("unknown preset")."""
    monkeypatch.chdir(tmp_path)
    for name in ("nosuffix", "UP.YML", "w4a16-rtn"):
        (tmp_path / name).write_text("preset: w4a8-rtn\n" if name == "w4a16-rtn" else "preset: w4a16-rtn\n")
    assert load_recipe("UP.YML").name == "UP"  # the suffix in any case
    assert load_recipe("w4a16-rtn").name == "w4a16-rtn"  # a preset, though a file has its name
    for spec in ("nosuffix", "sub/recipe", str(tmp_path / "nosuffix")):
        with pytest.raises(RecipeError, match="a recipe file's name ends in .yaml"):
            load_recipe(spec)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe("missing.YML")


def test_recipe_files_read_numbers_and_merges_as_their_authors_mean(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("scheme:\n  weights:\n    <<: {num_bits: 4, symmetric: false, group_size: 32}\n    group_size: 64\n"
                    "  algorithm: gptq\n  gptq: {dampening_frac: 1e-2}\n")
    scheme = load_recipe(str(path)).scheme
    # 1e-2 was a string to YAML 1.1 ("must be float, got '1e-2'"); a merged key may be overridden
    assert scheme.gptq.dampening_frac == 0.01 and scheme.weights.group_size == 64 and not scheme.weights.symmetric
    (tmp_path / "r.json").write_text('{"preset": "w4a16-rtn", "name": "a", "name": "b"}')
    with pytest.raises(RecipeError, match="'name' appears twice"):
        load_recipe(str(tmp_path / "r.json"))


@pytest.mark.parametrize("suffix, text", [(".json", '{"preset": "w8a16"}'), (".toml", 'preset = "w8a16"\n'),
                                          (".yaml", "preset: w8a16\n")])
def test_recipe_files_saved_with_a_byte_order_mark_read_as_without(tmp_path, suffix, text):
    """Notepad saves UTF-8 with a BOM: JSON and TOML refused such a file ("Unexpected UTF-8 BOM")."""
    path = tmp_path / f"r{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_recipe(str(path)).scheme == load_recipe("w8a16").scheme


@pytest.mark.parametrize("head, message", [
    ("{num_bits: 8}", "lm_head: 8-bit integer weights are symmetric"),  # group_size 128 by default
    ("{num_bits: 4, symmetric: false, group_size: 20}", "lm_head: target cpu serves int4 groups"),
])
def test_a_head_scheme_the_artifact_cannot_hold_is_refused_before_calibration(tiny, tmp_path, head, message):
    """Only the weights' scheme was checked: an int8 head with groups calibrated every layer (47 s on
    SmolLM2 with 4 samples) and then failed with exit 6; an int4 head in 20-channel groups built,
    then could not be served."""
    root, model, text = tiny
    path = tmp_path / "r.yaml"
    path.write_text(f"scheme:\n  weights: {{num_bits: 4, symmetric: false, group_size: 64}}\n  algorithm: gptq\n"
                    f"  lm_head: {head}\ncalibration: {{source: {text}, num_samples: 2, seq_len: 32}}\n")
    said = []
    with pytest.raises(RecipeError, match=re.escape(message)):
        build(str(model), load_recipe(str(path)), tmp_path / "a", progress=False, log=said.append)
    assert not any("calibration:" in line for line in said), said


def test_evaluation_data_too_short_is_refused_before_calibration(tiny, tmp_path):
    """It failed after the whole calibration (5 min 48 s for GPTQ on SmolLM2), naming eval's --seq-len."""
    root, model, text = tiny
    (tmp_path / "short.txt").write_text("a")
    recipe = dataclasses.replace(_recipe("w4a16-gptq", text), evaluation=EvalSpec(str(tmp_path / "short.txt"), 32, 64))
    said = []
    with pytest.raises(CalibrationDataError, match="--eval-seq-len or evaluation.seq_len"):
        build(str(model), recipe, tmp_path / "a", progress=False, log=said.append)
    assert not any("calibration:" in line for line in said), said


def test_unreadable_recipe_files_are_recipe_errors(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes(b"preset: w4a16-rtn # caf\xe9\n")
    (tmp_path / "dir.yaml").mkdir()
    for name in ("latin1.yaml", "dir.yaml"):
        with pytest.raises(RecipeError, match="cannot be read as UTF-8"):
            load_recipe(str(tmp_path / name))


def test_ignore_entries_must_name_a_linear(tiny, tmp_path):
    root, model, text = tiny
    rtn = _recipe("w4a16-rtn", text)
    for ignore, message in ((("lm_head", "layerz"), r"ignore entries \['layerz'\] match no linear"),
                            (("re:.*",), "leaves no linear to quantize")):
        r = dataclasses.replace(rtn, scheme=dataclasses.replace(rtn.scheme, ignore=ignore))
        with pytest.raises(RecipeError, match=message):
            build(str(model), r, tmp_path / "z", progress=False, log=lambda m: None)
    # llm-compressor's way to name the head: refused on this tied model ("match no linear"), taken on untied ones
    kept = dataclasses.replace(rtn, scheme=dataclasses.replace(rtn.scheme, ignore=("re:.*lm_head", "down_proj")))
    result = build(str(model), kept, tmp_path / "ok", progress=False, log=lambda m: None)
    assert not any(n.endswith("down_proj") for n in result.manifest.quantization["linears"])


def test_the_evaluation_window_is_checked_only_when_there_is_evaluation_data():
    """A 512-token model that adds BOS had been refused for the 512-token evaluation window of a
    build without evaluation data."""
    from qkiln.compile.build import _check_lengths

    recipe = preset("w4a16-rtn")
    _check_lengths(dataclasses.replace(recipe, evaluation=dataclasses.replace(recipe.evaluation, data=None)), 512, True)
    with pytest.raises(RecipeError, match="a window of 513 tokens"):
        _check_lengths(dataclasses.replace(recipe, evaluation=dataclasses.replace(recipe.evaluation, data="x.txt")),
                       512, True)


def test_calibration_larger_than_the_host_is_refused_before_sampling(tiny, tmp_path):
    """num_samples 100000 failed with an allocator traceback after the samples were drawn."""
    root, model, text = tiny
    r = _recipe("w4a16-gptq", text)
    recipe = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, num_samples=10**7))  # 610 GiB
    said = []
    with pytest.raises(RecipeError, match="lower --num-samples or calibration.seq_len"):
        build(str(model), recipe, tmp_path / "a", progress=False, log=said.append)
    assert not any("calibration:" in line for line in said), said


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float64])
def test_a_checkpoint_builds_as_its_fp32_twin_does(tiny, tmp_path, monkeypatch, stored):
    """The build holds a bf16 source as stored and computes in fp32 (compile/upcast.py): the artifact
    and its accuracy report are those of the same values held in fp32 (upcasting is exact). A
    float64 one is held in fp32 (calibrated and scored in float64, its artifact differed)."""
    from safetensors.torch import load_file, save_file

    from qkiln.runtime.source import load_source

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    root, model, text = tiny
    weights = load_file(str(model / "model.safetensors"))
    twins = {}
    for dtype in (stored, torch.float32):
        twin = shutil.copytree(model, tmp_path / str(dtype), ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.to(torch.bfloat16).to(dtype) for k, v in weights.items()}, str(twin / "model.safetensors"),
                  metadata={"format": "pt"})
        twins[dtype] = twin
    held = {torch.bfloat16: torch.bfloat16, torch.float64: torch.float32}[stored]
    assert {t.dtype for t in load_source(str(twins[stored])).state_dict.values()} == {held}
    built = {dtype: build(str(twin), _recipe("w4a16-gptq+kv-int4", text), tmp_path / f"out-{dtype}", use_cache=False,
                          progress=False, log=lambda m: None) for dtype, twin in twins.items()}
    a, b = (_files(result.path) for result in built.values())
    ma, mb = (json.loads(files.pop("manifest.json")) for files in (a, b))
    assert a == b
    assert ma["accuracy"] == mb["accuracy"] and "kl_divergence" in ma["accuracy"]


def test_a_quantized_fp8_head_is_scored_as_the_artifact_computes_it(tmp_path, monkeypatch):
    """`ignore: []` quantizes an untied head too: with dynamic fp8 activations the build's report
    scores its activations quantized as `qkiln eval ARTIFACT` (and serving) do (it scored them
    exact); with static ones, whose head scale nothing calibrates, the recipe is refused up front
    (the artifact was written, then refused by every loader for its missing lm_head.input_scale)."""
    from qkiln.compile.evaluate import evaluate
    from qkiln.compile.model_ref import open_model
    from tiny_models import CALIBRATION_SENTENCE, write_tiny_hf_model

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model = write_tiny_hf_model(tmp_path / "m", "mistral", vocab_size=272)  # untied; fp8 wants a multiple of 16
    text = tmp_path / "t.txt"
    text.write_text(CALIBRATION_SENTENCE * 100)

    def head_too(name):
        r = _recipe(name, text)
        return dataclasses.replace(r, scheme=dataclasses.replace(r.scheme, ignore=()))

    result = build(str(model), head_too("fp8-w8a8-rtn"), tmp_path / "a", progress=False, log=lambda m: None)
    assert result.manifest.quantization["linears"]["lm_head"]["format"] == "fp8"
    artifact = open_model(str(result.path))
    report = evaluate(artifact, artifact.tokenizer, str(text), 64, 256, progress=False)
    assert report["perplexity"] == pytest.approx(result.manifest.accuracy["perplexity"], rel=1e-6)
    with pytest.raises(RecipeError, match="not lm_head"):
        build(str(model), head_too("fp8-w8a8-static"), tmp_path / "b", progress=False, log=lambda m: None)


def test_a_tied_head_left_out_of_ignore_is_said_to_stay_in_high_precision(tiny, tmp_path, monkeypatch):
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    r = preset("w8a16")
    r = dataclasses.replace(r, scheme=dataclasses.replace(r.scheme, ignore=(), lm_head=None))
    lines = []
    result = build(str(model), r, tmp_path / "a", progress=False, log=lines.append)
    assert "lm_head" not in result.manifest.quantization["linears"]
    assert any("lm_head is tied to the embeddings" in line for line in lines)


@pytest.mark.parametrize("step", ["quantize weights", "evaluate accuracy"])
def test_a_source_rewritten_during_the_build_is_refused_and_nothing_is_written(tiny, tmp_path, monkeypatch, step):
    # the build reads a safetensors source through the file's pages, not copies: weights read after
    # a rewrite would have been another model's under the first one's sha256, in the artifact and in
    # the layer cache a rerun reads
    root, model, text = tiny
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "source"
    shutil.copytree(model, source)
    weights = source / "model.safetensors"
    original = weights.read_bytes()
    stat = weights.stat()

    def rewrite(at):
        if at == step:  # in place, as `rsync -a --inplace` does: one weight's byte, the mtime kept
            weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    with pytest.raises(SourceModelError, match="model.safetensors .* changed while the model was read"):
        build(str(source), _recipe("w4a16-rtn", text), tmp_path / "a", progress=False, log=lambda m: None,
              on_step=rewrite)
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a*"))
    if step == "quantize weights":
        assert not list((tmp_path / "cache").rglob("*.safetensors"))  # no entry computed from the new bytes
    weights.write_bytes(original)  # the same bytes again, as a `touch` or a chmod leaves them: not a change
    build(str(source), _recipe("w4a16-rtn", text), tmp_path / "b", progress=False, log=lambda m: None,
          on_step=lambda at: weights.touch() if at == step else None)
    assert verify_artifact(tmp_path / "b")