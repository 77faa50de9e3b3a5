"""What a build reuses must be what it would compute: the layer cache misses when the model's
config changes, the reference follows the evaluation text, the unquantized reference is the
fp32 source, the cache stays bounded, and AWQ's folding keeps the function it folds."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from qkiln.compile import calibrate
from qkiln.compile.artifact import read_manifest
from qkiln.compile.build import build
from qkiln.compile.evaluate import evaluate
from qkiln.compile.layer_cache import LayerCache, write_cache_file
from qkiln.compile.recipe import preset
from qkiln.errors import QkilnError, RecipeError
from qkiln.quant.scheme import AWQOptions, QuantScheme, WeightScheme
from qkiln.runtime.attention import DenseAttention
from qkiln.runtime.source import load_source
from tiny_models import write_tiny_hf_model, write_tiny_model_and_text

OTHER_TEXT = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition. " * 40


def _recipe(name, calib, data):
    r = preset(name)
    return dataclasses.replace(
        r, calibration=dataclasses.replace(r.calibration, source=str(calib), num_samples=2, seq_len=32),
        evaluation=dataclasses.replace(r.evaluation, data=str(data), seq_len=32, max_tokens=128))


def _build(model, recipe, out):
    return build(str(model), recipe, out, progress=False, log=lambda m: None)


def _fp32_perplexity(model_dir, data):
    source = load_source(str(model_dir))
    model = source.build_model(torch.float32)
    return evaluate(lambda ids: model(ids), source.tokenizer, str(data), 32, 128, progress=False)["perplexity"]


def test_a_changed_config_misses_the_cache_and_changes_the_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    recipe = _recipe("w4a16-gptq", calib, calib)
    first = _build(model, recipe, tmp_path / "a")
    edited = tmp_path / "edited"
    shutil.copytree(model, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps(config | {"rope_theta": 100.0, "rms_norm_eps": 0.1}))
    second = _build(edited, recipe, tmp_path / "b")
    assert second.num_cached_layers == 0
    assert first.manifest.source["sha256"] != second.manifest.source["sha256"]
    assert _build(model, recipe, tmp_path / "c").num_cached_layers == first.num_layers  # the original still hits


def test_the_reference_is_the_fp32_source_and_follows_the_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    data = tmp_path / "eval.txt"
    data.write_text(calib.read_text())
    recipe = _recipe("w4a16-rtn", calib, data)
    first = _build(model, recipe, tmp_path / "a").manifest.accuracy
    # the build rounds its own model's high-precision tensors to bf16; the reference stays fp32
    assert first["reference_perplexity"] == pytest.approx(_fp32_perplexity(model, data), rel=1e-6)
    data.write_text(OTHER_TEXT)  # same path, other text: the cached reference must not be reused
    second = _build(model, recipe, tmp_path / "b").manifest.accuracy
    assert second["reference_perplexity"] == pytest.approx(_fp32_perplexity(model, data), rel=1e-6)
    assert second["reference_perplexity"] != pytest.approx(first["reference_perplexity"], rel=1e-3)


def test_a_cached_awq_rebuild_scores_against_the_unfolded_source(tmp_path, monkeypatch):
    """Restoring a cached layer copied its AWQ-folded norms into the source's own tensors, and the
    reference built from them scored with folded norms and unscaled linears."""
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    recipe = _recipe("w4a16-awq", calib, calib)
    first = _build(model, recipe, tmp_path / "a")
    second = _build(model, recipe, tmp_path / "b")
    assert second.num_cached_layers == second.num_layers
    assert second.manifest.accuracy["reference_perplexity"] == pytest.approx(_fp32_perplexity(model, calib), rel=1e-6)
    assert second.manifest.accuracy == first.manifest.accuracy


def test_kv_only_builds_store_no_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    _build(model, _recipe("kv-int4", calib, calib), tmp_path / "a")
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


def test_the_cache_evicts_the_least_recently_used_entries(tmp_path):
    entry = {"w": torch.zeros(1024, dtype=torch.float32)}  # ~4 KiB a file
    cache = LayerCache(tmp_path, max_bytes=3 * 4096 + 2048)
    for key in ("a", "b", "c"):
        cache.put(key, entry, {})
    old = (tmp_path / "a.safetensors").stat().st_mtime - 100
    for i, key in enumerate("abc"):  # a, b, c from oldest to newest
        os.utime(tmp_path / f"{key}.safetensors", (old + i, old + i))
    assert cache.get("a") is not None  # used: now the newest
    cache.put("d", entry, {})
    assert sorted(p.stem for p in tmp_path.glob("*.safetensors")) == ["a", "c", "d"]


def test_a_write_cut_short_by_ctrl_c_leaves_no_temp_file(tmp_path):
    def interrupted(tmp):
        tmp.write_bytes(b"half a layer")
        raise KeyboardInterrupt  # SIGINT; SIGTERM arrives as SystemExit

    with pytest.raises(KeyboardInterrupt):
        write_cache_file(tmp_path / "k.safetensors", interrupted)
    assert list(tmp_path.iterdir()) == []


def test_the_cache_leaves_the_artifact_its_free_space(tmp_path):
    # cache and output on one disk: entries that took the space failed the build at its last step
    said, cache_dir = [], tmp_path / "new" / "cache"  # not made yet: its first entry is checked too
    too_much = shutil.disk_usage(tmp_path).free + (1 << 30)
    cache = LayerCache(cache_dir, warn=said.append, reserve=(tmp_path / "out", too_much))
    cache.put("a", {"w": torch.zeros(1024)}, {})
    cache.put("b", {"w": torch.zeros(1024)}, {})
    assert not cache_dir.exists() and cache.directory is None
    assert len(said) == 1 and "keeps" in said[0] and "QKILN_CACHE_DIR" in said[0]
    LayerCache(cache_dir, reserve=(tmp_path / "out", 0)).put("a", {"w": torch.zeros(1024)}, {})
    assert [p.name for p in cache_dir.iterdir()] == ["a.safetensors"]
    elsewhere = Path("/dev/shm")
    if elsewhere.is_dir() and os.access(elsewhere, os.W_OK) and elsewhere.stat().st_dev != tmp_path.stat().st_dev:
        LayerCache(cache_dir, reserve=(elsewhere / "out", too_much)).put("b", {"w": torch.zeros(1024)}, {})
        assert (cache_dir / "b.safetensors").is_file()  # the output's disk is another: nothing to keep here


def test_an_entry_is_not_written_once_its_source_changed(tmp_path):
    def changed():
        raise RuntimeError("the source changed")

    with pytest.raises(RuntimeError, match="the source changed"):
        LayerCache(tmp_path, before_write=changed).put("a", {"w": torch.zeros(4)}, {})
    assert list(tmp_path.iterdir()) == []


def test_another_user_s_entries_are_hits(other_user):
    """A cache shared by a team (QKILN_CACHE_DIR on a common volume): entries were 0600, as
    safetensors creates them, and touching another user's file failed too; both were misses. The
    folders the cache creates are 0755 whatever the umask: under 077 every other user had missed."""
    shared = other_user.folder / "cache" / "layers"
    old_umask = os.umask(0o077)
    try:
        LayerCache(shared).put("a", {"w": torch.arange(4.0)}, {"ok": 1})
    finally:
        os.umask(old_umask)
    assert (shared / "a.safetensors").stat().st_mode & 0o777 == 0o644
    assert shared.stat().st_mode & 0o777 == shared.parent.stat().st_mode & 0o777 == 0o755
    read = ("from pathlib import Path; from qkiln.compile.layer_cache import LayerCache\n"
            "hit = LayerCache(Path(sys.argv[1])).get('a'); print(hit[0]['w'].tolist() if hit else None)")
    out = other_user.python(read, shared)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0, 1.0, 2.0, 3.0]"


def test_a_private_cache_of_another_user_is_said_once_and_the_build_goes_on(other_user):
    shared = other_user.folder / "layers"
    LayerCache(shared).put("a", {"w": torch.arange(4.0)}, {"ok": 1})
    shared.chmod(0o700)
    read = ("from pathlib import Path; from qkiln.compile.layer_cache import LayerCache\n"
            "cache = LayerCache(Path(sys.argv[1]), warn=print)\n"
            "print(cache.get('a'), cache.get('b'), cache.directory)")
    out = other_user.python(read, shared)
    assert out.returncode == 0, out.stderr
    said, result = out.stdout.strip().splitlines()
    assert "cannot be read" in said and "Permission denied" in said and "ask its owner" in said
    assert result == "None None None"  # no cache for the rest of the build, and no second warning


def test_an_entry_under_another_key_s_name_is_a_miss(tmp_path):
    """An entry copied over another's file (between caches, by hand) passed its payload's sha256:
    an artifact labelled w4a16-rtn was built with a GPTQ layer."""
    cache = LayerCache(tmp_path)
    cache.put("a", {"w": torch.arange(4.0)}, {"ok": 1})
    cache.put("b", {"w": torch.ones(4)}, {"ok": 2})
    shutil.copy(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert cache.get("b") is None and not (tmp_path / "b.safetensors").exists()
    assert cache.get("a")[1] == {"ok": 1}


def test_a_damaged_cache_entry_is_a_miss_not_an_artifact_s_weights(tmp_path, monkeypatch):
    """A flipped low bit passed as valid codes into a verified artifact; a high one crashed the build."""
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    recipe = _recipe("w4a16-rtn", calib, calib)
    clean = _build(model, recipe, tmp_path / "a")
    entries = sorted((tmp_path / "cache" / "layers").glob("*.safetensors"))
    for path, flip in zip(entries, (0x01, 0x10)):
        raw = bytearray(path.read_bytes())
        raw[-100] ^= flip
        path.write_bytes(bytes(raw))
    rebuilt = _build(model, recipe, tmp_path / "b")
    assert rebuilt.num_cached_layers == clean.num_layers - 2
    weights = lambda r: {k: v for k, v in read_manifest(r.path).files.items() if k.startswith("weights/")}  # noqa: E731
    assert weights(rebuilt) == weights(clean) != {}
    assert _build(model, recipe, tmp_path / "c").num_cached_layers == clean.num_layers  # stored again


def test_fp8_weights_without_activations_are_refused_up_front():
    with pytest.raises(RecipeError, match="fp8 weights run as FP8 W8A8"):
        QuantScheme(weights=WeightScheme(num_bits=8, type="float", symmetric=True, group_size=None), algorithm="rtn")


@pytest.mark.parametrize("scale_o_proj", [False, True])
def test_awq_folding_keeps_a_biased_model_s_function(tmp_path, scale_o_proj):
    """Qwen2 has q/k/v biases: folding v_proj's scales must divide its bias too."""
    source = load_source(str(write_tiny_hf_model(tmp_path, "qwen2")))
    model = source.build_model(torch.float32)
    torch.manual_seed(0)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data = torch.randn_like(proj.bias) * 0.5
    scheme = QuantScheme(weights=WeightScheme(num_bits=4, symmetric=False, group_size=32), algorithm="awq",
                         awq=AWQOptions(scale_o_proj=scale_o_proj, clip=False))
    ids = torch.randint(0, 256, (2, 48))
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        before = model(ids)
        hidden = model.model.embed_tokens(ids)
        for i, layer in enumerate(model.model.layers):  # fold the scales only: nothing is quantized
            stats = calibrate._capture(layer, hidden, positions, model.rope, scheme, 2)
            calibrate._apply_awq(layer, f"model.layers.{i}.", scheme, stats, len(model.model.layers))
            hidden = calibrate._run_layer(layer, hidden, positions, model.rope, DenseAttention(), 2)
        after = model(ids)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_the_layer_key_covers_the_code_that_computes_a_layer(tmp_path, monkeypatch):
    """A change to the model forward or the simulation changes calibrated layers; only quant/ and
    calibrate.py were hashed, so such a change reused layers the old code computed."""
    from qkiln.compile import layer_cache

    package = Path(layer_cache.__file__).parents[1]
    hashed = {Path(p).name for p in layer_cache._LAYER_CODE}
    assert {"simulate.py", "model.py", "attention.py", "gguf_reader.py", "source.py"} <= hashed
    assert all((package / p).is_file() for p in layer_cache._LAYER_CODE)
    before = layer_cache.code_version()
    copy = tmp_path / "qkiln"  # the package with one edited forward, hashed from there
    for p in [*layer_cache._LAYER_CODE, *(f"quant/{q.name}" for q in (package / "quant").glob("*.py"))]:
        (copy / p).parent.mkdir(parents=True, exist_ok=True)
        (copy / p).write_bytes((package / p).read_bytes())
    (copy / "runtime" / "attention.py").write_text((package / "runtime" / "attention.py").read_text() + "\n# edited\n")
    monkeypatch.setattr("qkiln.quant.__file__", str(copy / "quant" / "__init__.py"))
    layer_cache.code_version.cache_clear()
    try:
        assert layer_cache.code_version() != before
    finally:
        layer_cache.code_version.cache_clear()


def test_a_cache_that_cannot_be_written_or_was_torn_does_not_fail_the_build(tmp_path, monkeypatch):
    """The caches only save time. One that cannot be written (here its folder is under a file: a
    read-only home or a full disk did the same) had failed the build with a traceback after its
    calibration work; a self-generated-samples file torn by a killed build had failed every later
    build with the same inputs."""
    model, text = write_tiny_model_and_text(tmp_path)
    recipe = _recipe("w4a16-gptq", "self:2", text)
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "file" / "cache"))
    said = []
    unwritable = build(str(model), recipe, tmp_path / "a", progress=False, log=said.append)
    assert read_manifest(unwritable.path).name == "a"
    assert sum("cannot be written" in line and "without it" in line for line in said) == 2, said  # both caches
    # a file in the way: free space would not help (said so until s48, as for a read-only file system)
    assert not any("free space" in line for line in said), said

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    first = _build(model, recipe, tmp_path / "b")
    [samples] = (tmp_path / "cache" / "selfgen").glob("*.json")
    samples.write_text(samples.read_text()[:20])  # torn mid-write
    second = _build(model, recipe, tmp_path / "c")
    assert second.manifest.calibration["token_sha256"] == first.manifest.calibration["token_sha256"] \
        == unwritable.manifest.calibration["token_sha256"]  # the same samples, generated again
    assert json.loads(samples.read_text())  # and stored whole

    monkeypatch.setenv("QKILN_CACHE_MAX_GB", "8G")
    with pytest.raises(QkilnError, match="QKILN_CACHE_MAX_GB='8G' is not a number of GiB"):
        LayerCache(tmp_path / "cache")


def test_calibrated_layers_are_cached_per_thread_count_and_data_free_ones_are_shared(tmp_path, monkeypatch):
    """GPTQ's codes change with the thread count (16% of SmolLM2's between 1 and 2 threads), and the
    key left it out: a 1-thread build served a 2-thread build's layers, a partly filled cache gave
    a mix no clean build reproduces, and the manifest said neither."""
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    threads = torch.get_num_threads()
    try:
        for name, calibrated in (("w4a16-gptq", True), ("w4a16-rtn", False)):
            torch.set_num_threads(1)
            one = _build(model, _recipe(name, calib, calib), tmp_path / f"{name}-1")
            torch.set_num_threads(2)
            two = _build(model, _recipe(name, calib, calib), tmp_path / f"{name}-2")
            assert two.num_cached_layers == (0 if calibrated else two.num_layers), name
            if calibrated:
                assert one.manifest.toolchain["threads"] == 1 and two.manifest.toolchain["threads"] == 2
                assert one.manifest.toolchain["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
            else:  # the same bytes on every host: nothing about it is recorded
                assert "threads" not in two.manifest.toolchain
            torch.set_num_threads(1)
            assert _build(model, _recipe(name, calib, calib), tmp_path / f"{name}-1b").num_cached_layers \
                == one.num_layers
    finally:
        torch.set_num_threads(threads)


def test_an_empty_cache_dir_setting_is_the_default_not_the_working_directory(tmp_path, monkeypatch):
    """QKILN_CACHE_DIR= (a template's unset variable) cached layers into ./layers of the build's folder."""
    from qkiln.compile.layer_cache import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QKILN_CACHE_DIR", "")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "qkiln" / "layers"


def test_a_negative_calibration_seed_is_refused():
    """Python's random.Random(-7) draws what random.Random(7) draws: a seed sweep over -N..N built
    each calibration twice under two manifests."""
    with pytest.raises(RecipeError, match="calibration.seed must be an integer >= 0, got -7"):
        preset("w4a16-gptq").with_overrides(calibration={"seed": -7})
