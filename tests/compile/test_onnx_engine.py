"""ONNX engines on real files: tiny artifacts of every weight format and cache dtype are exported,
passed through onnx's checker, run for two serving steps under onnx's reference evaluator (the
plugin nodes through plugins/onnx_nodes.py) and held to the artifact's own computation; a graph
with a bug fails that check; the CLI and `build --engine onnx` write complete, hashed engines."""

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")

from qkiln.compile import onnx_graph  # noqa: E402
from qkiln.compile.artifact import manifest_digest, read_manifest, verify_artifact  # noqa: E402
from qkiln.compile.artifact_cli import summarize_artifact  # noqa: E402
from qkiln.compile.build import build  # noqa: E402
from qkiln.compile.export_onnx import export_onnx, verify_engine_files  # noqa: E402
from qkiln.compile.onnx_check import check_onnx_engine  # noqa: E402
from qkiln.compile.recipe import preset  # noqa: E402
from qkiln.errors import ArtifactError, RecipeError  # noqa: E402
from tiny_models import CALIBRATION_SENTENCE, simulated_greedy, write_tiny_hf_model  # noqa: E402

# (preset, architecture, weight / KV-cache scheme changes): every linear format, every cache dtype,
# int4 with and without zero points, grouped and per channel, static fp8 activations, group-wise fp8 scales, key smoothing
# and offset, q/k norms (qwen3), biases (qwen2)
CASES = {
    "w4a16-rtn": ("w4a16-rtn", "llama", {}, {}),
    "w4a16-per-channel": ("w4a16-rtn", "llama", {"group_size": None}, {}),
    "gptq-symmetric-kv-int4": ("w4a16-gptq+kv-int4", "llama", {"symmetric": True}, {}),
    "awq-kv-fp8": ("w4a16-awq+kv-fp8", "llama", {}, {}),
    "fp8-static-kv-int4-smoothed": ("fp8-w8a8-static+kv-int4", "llama", {},
                                    {"key_smoothing": True, "key_offset": True}),
    "fp8-dynamic": ("fp8-w8a8", "llama", {}, {}),
    "fp8-grouped": ("fp8-w8a8-rtn", "llama", {"group_size": 32}, {}),
    "w8a16-qwen3": ("w8a16+kv-int4", "qwen3", {}, {}),
    "w4a16-qwen2": ("w4a16-rtn+kv-fp8", "qwen2", {}, {}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    (root / "calib.txt").write_text(CALIBRATION_SENTENCE * 200)
    return root


def _model_and_recipe(root: Path, case: str):
    name, arch, weight_changes, kv_changes = CASES[case]
    model = root / f"model-{arch}"
    if not model.exists():
        write_tiny_hf_model(model, arch)
    r = preset(name)
    scheme = dataclasses.replace(r.scheme, weights=dataclasses.replace(r.scheme.weights, **weight_changes))
    if kv_changes:
        scheme = dataclasses.replace(scheme, kv_cache=dataclasses.replace(scheme.kv_cache, **kv_changes))
    return model, dataclasses.replace(r, scheme=scheme, calibration=dataclasses.replace(
        r.calibration, source=str(root / "calib.txt"), num_samples=4, seq_len=64),
        evaluation=dataclasses.replace(r.evaluation, data=None))


def _artifact(root: Path, case: str, engines=()) -> Path:
    out = root / (case + ("-engine" if engines else ""))
    if not out.exists():
        model, recipe = _model_and_recipe(root, case)
        build(str(model), recipe, out, use_cache=False, progress=False, log=lambda m: None, engines=engines)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_engine_computes_what_the_artifact_computes(root, case):
    artifact = _artifact(root, case)
    result = export_onnx(artifact, root / f"engine-{case}", overwrite=True)  # other tests may have made it
    assert result.check.ok, result.check.summary()
    # tiny models are well conditioned: the engine sits at float32 rounding from the exact result,
    # or a few int4 / fp8 / bf16 cache codes that float32 rounded to the other side (onnx_check.py)
    assert max(result.check.engine_logits) < 2e-4, result.check.summary()
    model = onnx.load(str(result.path / onnx_graph.MODEL_FILE))
    onnx.checker.check_model(model, full_check=True)
    manifest = read_manifest(artifact)
    layers = manifest.architecture["num_hidden_layers"]
    plugins = [n for n in model.graph.node if n.domain == "qkiln"]
    assert sorted(n.op_type for n in plugins) == ["CacheWrite"] * layers + ["PagedAttention"] * layers
    for node in plugins:  # what TensorRT's parser looks a plugin up by
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"qkiln" and attrs["plugin_version"] == b"1"
    dequantized = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dequantized) == len(manifest.quantization["linears"])
    contract = json.loads((result.path / onnx_graph.CONTRACT_FILE).read_text())
    has_zeros = any(n.op_type == "DequantizeLinear" and len(n.input) == 3 for n in model.graph.node)
    assert contract["int4_zero_points"] == has_zeros == (case in ("w4a16-rtn", "w4a16-per-channel", "awq-kv-fp8",
                                                                          "w4a16-qwen2"))
    assert contract["kv_cache"]["dtype"] == (manifest.kv_cache or {"dtype": "bf16"})["dtype"]
    assert [i.name for i in model.graph.input][:7] == contract["inputs"]
    assert {c["output"] for c in contract["cache"]} == {o.name for o in model.graph.output} - {"logits"}


def test_a_wrong_graph_fails_the_check(root, monkeypatch):
    artifact = _artifact(root, "gptq-symmetric-kv-int4")
    good = onnx_graph._Builder.rms_norm

    def no_weight(self, x, weight):  # a norm that forgets its weight
        return good(self, x, weight) if weight != "model.norm.weight" else self.g.op("Identity", [x])

    monkeypatch.setattr(onnx_graph._Builder, "rms_norm", no_weight)
    with pytest.raises(ArtifactError, match="does not compute what the artifact computes"):
        export_onnx(artifact, root / "wrong")
    assert not (root / "wrong").exists() and not list(root.glob(".wrong.partial-*"))


def test_an_engine_copied_while_its_check_runs_never_verifies(root, monkeypatch):
    from qkiln.compile import export_onnx as export_module

    artifact = _artifact(root, "w4a16-rtn")
    copy = root / "engine-copied-mid-check"
    shutil.rmtree(copy, ignore_errors=True)

    def copy_then_die(artifact, engine_dir):
        shutil.copytree(engine_dir, copy)  # what a SIGKILL during the check leaves, renamed
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "require_engine_matches", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(artifact, root / "never")
    with pytest.raises(ArtifactError, match="stopped while checking it"):
        verify_engine_files(copy)
    monkeypatch.undo()
    verify_engine_files(export_onnx(artifact, copy, overwrite=True, verify=False).path)  # --force replaces it


def test_verify_refuses_an_engine_of_another_contract_version_as_eval_does(root):
    old = export_onnx(_artifact(root, "w4a16-rtn"), root / "old-contract", overwrite=True, verify=False).path
    contract = json.loads((old / "engine.json").read_text())
    contract["contract_version"] -= 1
    contract["digest"] = manifest_digest(contract)  # intact, as an older qkiln wrote it
    (old / "engine.json").write_text(json.dumps(contract))
    with pytest.raises(ArtifactError, match="written by another qkiln version .*contract_version"):
        verify_engine_files(old)


def test_a_check_that_does_not_fit_in_memory_is_skipped_and_said(root, monkeypatch):
    from qkiln.compile import onnx_check

    artifact = _artifact(root, "w4a16-rtn")
    monkeypatch.setattr(onnx_check, "CHECK_BYTES_PER_PARAMETER", 1 << 50)  # as if the model were huge
    said = []
    result = export_onnx(artifact, root / "unchecked", log=said.append)
    assert result.check is None and (result.path / onnx_graph.MODEL_FILE).is_file()
    assert len(said) == 1 and said[0].startswith("onnx engine not checked: checking needs")


def test_export_is_deterministic_and_refuses_a_taken_directory(root):
    artifact = _artifact(root, "w4a16-rtn")
    first = export_onnx(artifact, root / "det-a", verify=False).path
    second = export_onnx(artifact, root / "det-b", verify=False).path
    for name in (onnx_graph.MODEL_FILE, onnx_graph.DATA_FILE, onnx_graph.CONTRACT_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    # by path, as checkers must read models past protobuf's 2 GB (small constants are inline)
    onnx.checker.check_model(str(first / onnx_graph.MODEL_FILE), full_check=True)
    with pytest.raises(ArtifactError, match="already exists"):
        export_onnx(artifact, first)
    export_onnx(artifact, first, overwrite=True, verify=False)
    theirs = root / "their-engine"  # an engine.json qkiln did not write: --force must not delete it
    theirs.mkdir(exist_ok=True)
    (theirs / "engine.json").write_text('{"format": "tensorrt"}')
    with pytest.raises(ArtifactError, match="refusing to replace"):
        export_onnx(artifact, theirs, overwrite=True, verify=False)
    assert (theirs / "engine.json").is_file()


def test_build_writes_a_checked_engine_into_the_artifact(root):
    artifact = _artifact(root, "gptq-symmetric-kv-int4", engines=("onnx",))
    listed = verify_artifact(artifact)
    engine = [f for f in listed if f.startswith("engines/onnx/")]
    assert sorted(engine) == [f"engines/onnx/{n}" for n in ("engine.json", "model.onnx", "model.onnx.data")]
    data = (artifact / "engines/onnx/model.onnx.data").read_bytes()
    assert read_manifest(artifact).files["engines/onnx/model.onnx.data"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert check_onnx_engine(artifact, artifact / "engines/onnx").ok
    assert summarize_artifact(artifact)["engines"] == {"onnx": sum(
        (artifact / f).stat().st_size for f in engine)}  # what `qkiln inspect` lists
    # refused before any work (the source "unused" is never opened)
    with pytest.raises(RecipeError, match="unknown engine tensorrt"):
        build("unused", preset("w4a16-rtn"), root / "never", engines=("tensorrt",))
    r = preset("w4a16-rtn")
    float_zeros = dataclasses.replace(r.scheme, weights=dataclasses.replace(r.scheme.weights, zero_point="float"))
    with pytest.raises(RecipeError, match="zero_point: float"):
        build("unused", dataclasses.replace(r, scheme=float_zeros), root / "never", engines=("onnx",))
    assert not (root / "never").exists()


def test_cli_export_onnx(root):
    artifact = _artifact(root, "w4a16-rtn")
    out = root / "cli-engine"
    cmd = [sys.executable, "-m", "qkiln", "export", str(artifact), "--format", "onnx", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "exported an ONNX engine" in done.stdout and "checked: logits" in done.stdout
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode != 0 and again.stderr.strip().startswith("error:") and "--force" in again.stderr
    drop = subprocess.run(cmd[:-2] + ["-o", str(root / "x"), "--drop-kv"], capture_output=True, text=True)
    assert drop.returncode != 0 and "--drop-kv applies to compressed-tensors" in drop.stderr
    ct = [sys.executable, "-m", "qkiln", "export", str(artifact), "-o", str(root / "ct"), "--no-check"]
    ignored = subprocess.run(ct, capture_output=True, text=True)  # it had run the check and said "verified"
    assert ignored.returncode != 0 and "--no-check applies to --format onnx" in ignored.stderr
    unchecked = subprocess.run(cmd[:-2] + ["-o", str(root / "cli-unchecked"), "--no-check"], capture_output=True,
                               text=True)
    assert unchecked.returncode == 0 and unchecked.stdout.rstrip().endswith("not checked"), unchecked.stderr


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_engine(smollm2, root):
    """The real model: large activations make float32 rounding visible through the bf16 cache, so
    the check's bound comes from torch's own float32 distance; the engine must stay within it."""
    r = preset("w4a16-rtn")
    r = dataclasses.replace(r, evaluation=dataclasses.replace(r.evaluation, data=None))
    artifact = build(str(smollm2.path), r, root / "smollm2", use_cache=False, progress=False, log=lambda m: None)
    result = export_onnx(artifact.path, root / "smollm2-engine")
    assert result.check.ok, result.check.summary()
    assert max(result.check.engine_logits) < 1e-2, result.check.summary()


def test_engine_generates_what_the_artifact_generates(root):
    """Greedy decoding through the engine (a prefill, then one token a step, the caches carried
    from step to step, logits for the last row only, as a server asks) gives the tokens the
    artifact's simulation gives; engine.json names the limits and tokens a runtime needs."""
    import torch

    from qkiln.compile.onnx_check import ReferenceEngine
    from qkiln.plugins import allocate_kv_cache
    from qkiln.runtime.config import ModelConfig

    artifact = _artifact(root, "gptq-symmetric-kv-int4")
    engine_dir = root / "engine-gptq-symmetric-kv-int4"
    if not engine_dir.exists():
        export_onnx(artifact, engine_dir, verify=False)
    manifest = read_manifest(artifact)
    config, kv = ModelConfig.from_dict(manifest.architecture), manifest.kv_cache
    caches = allocate_kv_cache(config.num_hidden_layers, 6, 4, config.num_key_value_heads, config.head_dim,
                               kv["dtype"], kv["group_size"])
    engine = ReferenceEngine(engine_dir, caches)
    table = torch.tensor([[4, 1, 5, 0, 2, 3]], dtype=torch.int32)  # scattered blocks of 4 slots
    prompt = list(b"It was a bright")
    tokens, position = [], 0
    ids = prompt
    for _ in range(8):
        positions = torch.arange(position, position + len(ids))
        slots = table[0, positions // 4].long() * 4 + positions % 4
        logits = engine.step(torch.tensor(ids), positions, slots, table,
                             torch.tensor([position + len(ids)], dtype=torch.int32),
                             torch.tensor([0, len(ids)], dtype=torch.int32), torch.tensor([len(ids) - 1]))
        assert logits.shape == (1, config.vocab_size)
        position += len(ids)
        ids = [int(logits[-1].argmax())]
        tokens += ids
    assert tokens == simulated_greedy(artifact, prompt, 8)
    contract = json.loads((engine_dir / onnx_graph.CONTRACT_FILE).read_text())
    assert contract["max_positions"] == config.max_position_embeddings
    assert contract["tokens"]["eos_token_ids"] == list(config.eos_token_ids)
    assert contract["attention"]["num_heads"] == config.num_attention_heads
    assert set(contract["plugin_nodes"]) == {"CacheWrite", "PagedAttention"}
    assert "round half to even" in contract["kv_cache"]["encoding"]  # this artifact's int4 cache, spelled out
    assert contract["files"] == {n: hashlib.sha256((engine_dir / n).read_bytes()).hexdigest()
                                 for n in (onnx_graph.MODEL_FILE, onnx_graph.DATA_FILE)}


@pytest.mark.parametrize("case", ["w4a16-rtn", "fp8-static-kv-int4-smoothed", "w4a16-qwen2"])
def test_reference_engine_frees_values_and_computes_what_the_evaluator_computes(root, case):
    """ReferenceEngine runs the evaluator's nodes itself to drop each value after its last reader:
    logits and written caches equal, bit for bit, those of the evaluator's own `run`, step after step."""
    import numpy as np

    from qkiln.compile.onnx_check import ArtifactCaches, ReferenceEngine, two_steps
    from qkiln.compile.onnx_graph import step_inputs
    from qkiln.runtime.config import ModelConfig

    artifact = _artifact(root, case)
    engine_dir = root / f"engine-{case}"
    if not engine_dir.exists():
        export_onnx(artifact, engine_dir, verify=False)
    config = ModelConfig.from_dict(read_manifest(artifact).architecture)
    engine = ReferenceEngine(engine_dir, ArtifactCaches(artifact, config).new(8))
    for inputs in two_steps(config.vocab_size, seed=1):
        feeds = {n: t.numpy() for n, t in step_inputs(*inputs).items()} | engine.state
        want = engine.session.run(engine.outputs, feeds)
        got = engine._run(feeds)
        assert [w.dtype for w in want] == [g.dtype for g in got]
        assert all(np.array_equal(w.view(np.uint8), g.view(np.uint8)) for w, g in zip(want, got))
        engine.step(*inputs)


@pytest.mark.parametrize("case", list(CASES))
def test_onnx_runtime_runs_the_engine(root, case, tmp_path):
    """ONNX Runtime loads and computes the engine's standard nodes, the plugin nodes running as
    qkiln's registered ops on the caches in place (compile/onnx_ort.py): two steps give what onnx's
    reference evaluator gives up to float32 rounding, so the export writes nothing a production
    runtime refuses or reads otherwise; and every int4 linear runs as ONNX Runtime's packed
    MatMulNBits, not a dequantized weight."""
    pytest.importorskip("onnxruntime")
    import torch

    from qkiln.compile.onnx_check import LOGITS_FLOOR, ReferenceEngine, two_steps
    from qkiln.compile.onnx_ort import OrtEngine
    from qkiln.plugins import allocate_kv_cache, onnx_nodes

    artifact = _artifact(root, case)
    engine_dir = root / f"engine-{case}"
    if not engine_dir.exists():
        export_onnx(artifact, engine_dir, verify=False)
    manifest = read_manifest(artifact)
    a, kv = manifest.architecture, manifest.kv_cache or {"dtype": "bf16"}
    head_dim = a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]

    def caches():
        return allocate_kv_cache(a["num_hidden_layers"], 8, 4, a["num_key_value_heads"], head_dim, kv["dtype"],
                                 kv.get("group_size", 32))

    reference, ort_caches = ReferenceEngine(engine_dir, caches()), caches()
    engine = OrtEngine(engine_dir, ort_caches, accuracy_level=0, optimized_dir=tmp_path)
    for inputs in two_steps(a["vocab_size"], seed=0):
        want, got = reference.step(*inputs), engine.step(*inputs)
        assert float((got - want).abs().max() / want.abs().max()) < LOGITS_FLOOR
    fields = onnx_nodes.written_fields(kv["dtype"])
    written = [getattr(c, f).view(torch.uint8) for c in ort_caches for f in fields]
    expected = [getattr(c, f).view(torch.uint8) for c in reference.caches for f in fields]
    assert sum(int((x != y).sum()) for x, y in zip(written, expected)) <= 0.02 * sum(x.numel() for x in written)
    int4 = sum(e["format"] == "int4" for e in manifest.quantization["linears"].values())  # int8 stays Gemm
    assert engine.fused_op_counts().get("MatMulNBits", 0) == int4


def test_verify_engines_catches_an_engine_of_other_weights(root, tmp_path):
    """`qkiln verify --engines` holds the engine to the artifact's weights: an engine swapped in from
    another artifact, a graph swapped alone, an embedding row the numerical steps never read, or an
    edited engine.json, each with the manifest's hashes redone to match, passes the hash check and
    fails this one with a typed error."""
    import shutil

    import onnx
    from onnx import numpy_helper

    artifact = _artifact(root, "gptq-symmetric-kv-int4", engines=("onnx",))
    cmd = [sys.executable, "-m", "qkiln", "verify", "--engines"]
    done = subprocess.run(cmd + [str(artifact)], capture_output=True, text=True)
    assert done.returncode == 0 and "onnx engine checked: logits" in done.stdout, done.stderr
    other = _artifact(root, "w4a16-rtn")
    export_onnx(other, tmp_path / "other", verify=False)
    engine = artifact / "engines/onnx"
    model = onnx.load(str(engine / onnx_graph.MODEL_FILE))
    table = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    rows = numpy_helper.to_array(table).copy()
    rows[-1] = rows[-2]  # the last token's row: two short random steps almost never draw it
    table.CopyFrom(numpy_helper.from_array(rows, table.name))
    onnx.save_model(model, tmp_path / onnx_graph.MODEL_FILE, save_as_external_data=True,
                    location=onnx_graph.DATA_FILE, size_threshold=1024)
    contract = json.loads((engine / onnx_graph.CONTRACT_FILE).read_text()) | {"int4_zero_points": True}
    (tmp_path / onnx_graph.CONTRACT_FILE).write_text(json.dumps(contract | {"digest": manifest_digest(contract)}))
    cases = {"other": [tmp_path / "other" / n for n in (onnx_graph.MODEL_FILE, onnx_graph.DATA_FILE,
                                                         onnx_graph.CONTRACT_FILE)],
             "graph": [tmp_path / "other" / n for n in (onnx_graph.MODEL_FILE, onnx_graph.DATA_FILE)],
             "one-row": [tmp_path / onnx_graph.MODEL_FILE, tmp_path / onnx_graph.DATA_FILE],
             "contract": [tmp_path / onnx_graph.CONTRACT_FILE]}
    errors = {}
    for label, files in cases.items():
        swapped = tmp_path / f"swapped-{label}"
        shutil.copytree(artifact, swapped)
        manifest = json.loads((swapped / "manifest.json").read_text())
        for path in files:
            data = path.read_bytes()
            (swapped / "engines/onnx" / path.name).write_bytes(data)
            manifest["files"][f"engines/onnx/{path.name}"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                                               "size": len(data)}
        manifest["digest"] = manifest_digest(manifest)  # hashes redone, as a tamperer would
        (swapped / "manifest.json").write_text(json.dumps(manifest))
        assert subprocess.run([sys.executable, "-m", "qkiln", "verify", str(swapped)]).returncode == 0
        done = subprocess.run(cmd + [str(swapped)], capture_output=True, text=True)
        assert done.returncode != 0 and "is not the one this qkiln builds" in done.stderr, (label, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        errors[label] = done.stderr
    assert re.search(r"\(differing: 1 of \d+ initializers \(model.embed_tokens.weight\)\)", errors["one-row"])
    assert "(differing: engine.json content)" in errors["contract"], errors["contract"]


def test_an_edited_engine_json_or_a_foreign_file_fails_verify_on_its_own(root, tmp_path):
    """A registry storing engines alone: engine.json's digest covers the contract a runtime drives
    the engine by (max_positions and the EOS ids had been editable), and the folder holds the
    engine's files only."""
    from qkiln.compile.export_onnx import verify_engine_files

    export_onnx(_artifact(root, "w4a16-rtn"), tmp_path / "engine", verify=False)
    path = tmp_path / "engine" / onnx_graph.CONTRACT_FILE
    contract = json.loads(path.read_text())
    assert contract["contract_version"] == 4 and verify_engine_files(tmp_path / "engine") == contract
    by_bytes = subprocess.run(f"grep -v '^  \"digest\": ' {path} | head -c -1 | sha256sum", shell=True,
                              capture_output=True, text=True, check=True)  # README's recipe without Python
    assert by_bytes.stdout.split()[0] == contract["digest"]
    (tmp_path / "engine" / "notes.txt").write_text("x")
    with pytest.raises(ArtifactError, match="holds files an engine does not: notes.txt"):
        verify_engine_files(tmp_path / "engine")
    (tmp_path / "engine" / "notes.txt").unlink()
    path.write_text(json.dumps(contract | {"max_positions": 999999}))
    with pytest.raises(ArtifactError, match="do not match its digest"):
        verify_engine_files(tmp_path / "engine")
    path.write_text(json.dumps({k: v for k, v in contract.items() if k != "digest"} | {"max_positions": 999999}))
    with pytest.raises(ArtifactError, match="missing field 'digest'"):
        verify_engine_files(tmp_path / "engine")


def test_an_exported_engine_folder_is_verified_on_its_own_and_against_its_artifact(root, tmp_path):
    artifact, other = _artifact(root, "w4a16-rtn"), _artifact(root, "gptq-symmetric-kv-int4")
    export_onnx(artifact, tmp_path / "engine", verify=False)
    verify = [sys.executable, "-m", "qkiln", "verify", str(tmp_path / "engine")]
    done = subprocess.run(verify, capture_output=True, text=True)
    assert done.returncode == 0 and "2 files match engine.json's sha256" in done.stdout, done.stderr
    done = subprocess.run(verify + ["--artifact", str(artifact)], capture_output=True, text=True)
    assert done.returncode == 0 and "onnx engine checked: logits" in done.stdout, done.stderr
    done = subprocess.run(verify + ["--artifact", str(other)], capture_output=True, text=True)
    assert done.returncode != 0 and "is not the one this qkiln builds" in done.stderr, done.stderr
    data = tmp_path / "engine" / onnx_graph.DATA_FILE
    data.write_bytes(data.read_bytes()[:-1] + b"\x01")
    done = subprocess.run(verify, capture_output=True, text=True)
    assert done.returncode != 0 and "model.onnx.data: sha256 differs" in done.stderr, done.stderr


def test_builds_with_an_engine_are_byte_identical(root, tmp_path):
    """`build --engine onnx` keeps builds reproducible: the same inputs under the same name give the
    same bytes, engine included (the engine records the artifact's name, as the manifest does)."""
    first = _artifact(root, "gptq-symmetric-kv-int4", engines=("onnx",))
    model, recipe = _model_and_recipe(root, "gptq-symmetric-kv-int4")
    again = build(str(model), recipe, tmp_path / first.name, use_cache=False, progress=False,
                  log=lambda m: None, engines=("onnx",)).path
    files = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert any(f.startswith("engines/onnx/") for f in files)
    for f in files:
        assert (first / f).read_bytes() == (again / f).read_bytes(), f


@pytest.mark.parametrize("runner", ["onnx", "onnxruntime"])
def test_eval_scores_the_engine_as_the_simulation(root, tmp_path, runner):
    """`qkiln eval ARTIFACT --engine onnx|onnxruntime` scores the deployed graph (windows batched as
    sequences of one engine step over paged caches), under onnx's reference evaluator or ONNX
    Runtime with float activations: its perplexity is the simulation's, to float32 rounding."""
    if runner == "onnxruntime":
        pytest.importorskip("onnxruntime")
    from qkiln.compile.evaluate import evaluate
    from qkiln.compile.model_ref import open_model

    artifact = _artifact(root, "gptq-symmetric-kv-int4", engines=("onnx",))
    text = str(root / "calib.txt")
    cmd = [sys.executable, "-m", "qkiln", "eval", str(artifact), "--engine", runner, "--data", text,
           "--seq-len", "64", "--eval-tokens", "512", "--json", str(tmp_path / "engine.json")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "engine.json").read_text())
    simulated = open_model(str(artifact))
    expected = evaluate(simulated, simulated.tokenizer, text, 64, 512, progress=False)
    assert report["engine"] == runner and report["num_tokens"] == expected["num_tokens"]
    assert abs(report["perplexity"] / expected["perplexity"] - 1) < 1e-4
    if runner == "onnxruntime":  # ONNX Runtime's default: int8 activations in MatMulNBits, scored as such
        done = subprocess.run(cmd + ["--ort-accuracy-level", "4"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        coarse = json.loads((tmp_path / "engine.json").read_text())
        assert coarse["ort_accuracy_level"] == 4 and coarse["perplexity"] != report["perplexity"]
        return
    bare = _artifact(root, "w4a16-rtn")  # no engines/onnx/: a typed error, not a stack
    done = subprocess.run(cmd[:4] + [str(bare)] + cmd[5:], capture_output=True, text=True)
    assert done.returncode != 0 and "has no engines/onnx/" in done.stderr and "Traceback" not in done.stderr


def test_a_cache_without_groups_records_none_and_a_damaged_graph_is_a_typed_error(root, tmp_path):
    """An fp8 cache's engine had carried its scheme's unused default group size (16), which the
    contract defines for int4 caches only; an unreadable model.onnx had been a protobuf traceback."""
    import onnx

    from qkiln.compile.onnx_contract import read_engine_model

    export_onnx(_artifact(root, "awq-kv-fp8"), tmp_path / "fp8", verify=False)
    contract = json.loads((tmp_path / "fp8" / onnx_graph.CONTRACT_FILE).read_text())
    assert contract["kv_cache"]["group_size"] is None
    from qkiln.compile.onnx_check import check_contract

    older = {k: v for k, v in contract.items() if k != "digest"} | {"contract_version": 2}  # before digests
    (tmp_path / "fp8" / onnx_graph.CONTRACT_FILE).write_text(json.dumps(older))
    with pytest.raises(ArtifactError, match="written by another qkiln version .* re-export"):  # not "another model"
        check_contract(tmp_path / "fp8", contract["kv_cache"])
    from qkiln.compile.onnx_contract import rewrite_hint

    built_in = _artifact(root, "awq-kv-fp8", engines=("onnx",)) / "engines" / "onnx"  # part of the artifact
    assert rewrite_hint(built_in).startswith("rebuild the artifact") and "re-export" not in rewrite_hint(built_in)
    writes = [n for n in onnx.load(str(tmp_path / "fp8" / onnx_graph.MODEL_FILE)).graph.node if n.op_type == "CacheWrite"]
    assert writes and all(a.i == 0 for n in writes for a in n.attribute if a.name == "group_size")
    (tmp_path / "fp8" / onnx_graph.MODEL_FILE).write_bytes(b"\x08\x01garbage")
    with pytest.raises(ArtifactError, match="cannot be read"):
        read_engine_model(tmp_path / "fp8")
    artifact = _artifact(root, "awq-kv-fp8")  # an intact artifact is not an engine to replace (nor "damaged")
    with pytest.raises(ArtifactError, match="is a qkiln artifact, not an ONNX engine"):
        export_onnx(artifact, artifact, overwrite=True, verify=False)


def test_a_hard_linked_engine_reads_and_its_tensors_name_only_its_data_file(root, tmp_path):
    """onnx.load refuses a data file with more than one hard link; `cp -al` backups, `rsync
    --link-dest` and deduplicating stores make them, and had made the engine (the original too)
    unreadable. The engine's own reader takes the bytes by offset from model.onnx.data only."""
    import os
    import shutil

    from qkiln.compile.onnx_contract import read_engine_model

    engine = tmp_path / "engine"
    shutil.copytree(_artifact(root, "w4a16-rtn", engines=("onnx",)) / "engines/onnx", engine)
    before = onnx.load(str(engine / onnx_graph.MODEL_FILE))
    os.link(engine / onnx_graph.DATA_FILE, tmp_path / "backup.data")
    with pytest.raises(Exception, match="hard link"):  # what onnx itself says
        onnx.load(str(engine / onnx_graph.MODEL_FILE))
    read = read_engine_model(engine)
    assert [t.SerializeToString() for t in read.graph.initializer] == \
        [t.SerializeToString() for t in before.graph.initializer]
    # a tensor naming another file (outside the folder, say) is refused, as is a short data file
    model = onnx.load(str(engine / onnx_graph.MODEL_FILE), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    next(e for e in tensor.external_data if e.key == "location").value = "../backup.data"
    onnx.save(model, str(engine / onnx_graph.MODEL_FILE))
    with pytest.raises(ArtifactError, match="names data file '../backup.data'"):
        read_engine_model(engine)


def test_eval_refuses_an_engine_exported_from_another_artifact(root, tmp_path):
    """An engine copied in from another artifact with the manifest's hashes redone passes `verify`;
    `eval --engine` had scored it as this artifact's. Its report carries the artifact's digest."""
    import shutil

    from qkiln.compile.onnx_eval import open_engine

    artifact = _artifact(root, "gptq-symmetric-kv-int4", engines=("onnx",))
    scorer = open_engine(artifact)
    assert scorer.description["digest"] == read_manifest(artifact).digest
    swapped = tmp_path / "swapped"
    shutil.copytree(artifact, swapped)
    other = _artifact(root, "w4a16-rtn", engines=("onnx",)) / "engines/onnx"
    manifest = json.loads((swapped / "manifest.json").read_text())
    for path in other.iterdir():
        data = path.read_bytes()
        (swapped / "engines/onnx" / path.name).write_bytes(data)
        manifest["files"][f"engines/onnx/{path.name}"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest["digest"] = manifest_digest(manifest)
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    verify_artifact(swapped)  # the hashes agree
    with pytest.raises(ArtifactError, match=r"exported from another artifact \(name 'w4a16-rtn-engine', recipe "
                                            r"'w4a16-rtn'; this one's: name 'gptq-symmetric-kv-int4-engine'"):
        open_engine(swapped)


def test_the_build_lets_go_of_its_model_before_the_engine_check(root, monkeypatch):
    """The check simulates the model in float32 and float64; the build's fp32 source and its
    simulation held beside it made the check the build's peak (main job: 4.4 GiB, now 3.2)."""
    import gc
    import weakref

    from qkiln.compile import build as build_module

    load, alive = build_module.load_source, []

    def tracked_load(name, **kwargs):
        source = load(name, **kwargs)
        alive.append(weakref.ref(source.state_dict["model.embed_tokens.weight"]))
        return source

    def check(artifact, log):
        gc.collect()
        alive.append(alive[0]() is not None)
        return None

    monkeypatch.setattr(build_module, "load_source", tracked_load)
    monkeypatch.setattr(build_module, "check_artifact_engine", check)
    model, recipe = _model_and_recipe(root, "w4a16-rtn")
    build(str(model), recipe, root / "let-go", use_cache=False, progress=False, log=lambda m: None,
          engines=("onnx",))
    assert alive[1:] == [False]


def test_an_artifact_s_simulation_keeps_no_dense_copy_of_its_quantized_linears(root):
    """`qkiln eval ARTIFACT` and the engine check simulate the artifact: its decoder layers' linears
    are dequantized per call (SmolLM2 W4A16: +880 -> +403 MiB after loading, same perplexity)."""
    import copy

    import torch

    from qkiln.compile.artifact_model import load_artifact_model

    model = load_artifact_model(_artifact(root, "w4a16-rtn")).model
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")}
    assert linears and all(m.weight.numel() == 0 for m in linears.values())
    exact = copy.deepcopy(model).double()  # as the engine check runs it
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.allclose(model(ids).double(), exact(ids), atol=1e-4)
