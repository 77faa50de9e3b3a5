"""What a registry and a deploy script read to tell which build is which: an artifact's `created`
(SOURCE_DATE_EPOCH), its serving digest, the name it is served under through a symlink, the
artifact the server reports (GET /v1/models, /metrics), and a folder replaced while it loads."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from qkiln.compile.artifact import read_manifest, serving_digest
from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.errors import ArtifactError
from qkiln.runtime import loader
from qkiln.runtime.llm import LLM
from loopback import serving_model
from tiny_models import write_tiny_hf_model, write_tiny_model_and_text

ENGINE_KW = dict(num_kv_blocks=16, max_model_len=64)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two data-free builds of a tiny model: `a` with SOURCE_DATE_EPOCH set, `b` another recipe."""
    root = tmp_path_factory.mktemp("identity")
    model = write_tiny_hf_model(root / "model", "llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QKILN_CACHE_DIR", str(root / "cache"))
        mp.setenv("SOURCE_DATE_EPOCH", "1700000000")
        a = build(str(model), preset("fp8-w8a8-rtn"), root / "releases" / "a", progress=False, log=lambda m: None).path
        mp.delenv("SOURCE_DATE_EPOCH")
        b = build(str(model), preset("w4a16-rtn"), root / "b", progress=False, log=lambda m: None).path
    return root, a, b


def test_created_records_source_date_epoch(built):
    _, a, b = built
    assert read_manifest(a).created == 1700000000 and read_manifest(b).created is None


def test_a_symlinked_artifact_is_served_under_the_link_s_name_and_reports_its_build(built):
    root, a, _ = built
    current = root / "current"
    current.symlink_to(a, target_is_directory=True)
    with serving_model(current, dtype="fp32", **ENGINE_KW) as (engine, server), \
            httpx.Client(base_url=server.url, timeout=60) as client:
        card = client.get("/v1/models").json()["data"][0]
        m = read_manifest(a)
        assert card["artifact"] == {"name": "a", "digest": m.digest, "serving_digest": serving_digest(m)}
        metrics = client.get("/metrics").text
        assert (f'qkiln_artifact_info{{digest="{m.digest}",model_name="tiny",name="a",'
                f'serving_digest="{serving_digest(m)}"}} 1.0') in metrics
    assert LLM(str(current), **ENGINE_KW).name == "current"  # a `current -> releases/<id>` layout keeps its name


def test_a_folder_replaced_while_it_loads_is_refused(built, monkeypatch):
    """`build --force` renames a new artifact into place: weights read before and a tokenizer after
    would mix two builds, under one manifest."""
    root, a, b = built
    served = root / "served"
    shutil.copytree(a, served)
    spare = root / "spare"
    shutil.copytree(b, spare)
    real_from_dir = loader.Tokenizer.from_dir

    def swap_then_read(path):  # a rebuild lands between the weights and the tokenizer
        shutil.rmtree(served)
        os.rename(spare, served)
        return real_from_dir(path)

    monkeypatch.setattr(loader.Tokenizer, "from_dir", staticmethod(swap_then_read))
    with pytest.raises(ArtifactError, match="was replaced while it loaded"):
        LLM(str(served), **ENGINE_KW)
    monkeypatch.undo()
    assert json.loads((served / "manifest.json").read_text())["recipe"]["name"] == "w4a16-rtn"
    assert LLM(str(served), **ENGINE_KW).name == "served"  # loaded again, it is whole


def test_a_mix_that_fails_to_load_is_said_to_be_a_replaced_folder(built, monkeypatch):
    """A rebuild landing between the manifest and the weights (fp8 manifest, int4 tensors) failed the
    load as a recipe error (exit 4: 'fix the recipe'); a deploy script retrying on 6 gave up."""
    root, a, b = built
    served, spare = root / "served2", root / "spare2"
    shutil.copytree(a, served)
    shutil.copytree(b, spare)
    real_load_tensors = loader.load_tensors

    def swap_then_load(path, manifest, **kw):
        shutil.rmtree(served)
        os.rename(spare, served)
        return real_load_tensors(path, manifest, **kw)

    monkeypatch.setattr(loader, "load_tensors", swap_then_load)
    with pytest.raises(ArtifactError, match="was replaced while it loaded .*, which failed it") as failed:
        LLM(str(served), **ENGINE_KW)
    assert failed.value.exit_code == 6
    monkeypatch.undo()
    assert LLM(str(served), **ENGINE_KW).name == "served2"


def test_builds_that_differ_only_in_names_and_reports_share_a_serving_digest(tmp_path, monkeypatch):
    """A registry dedupes on what is served: the manifest's digest also covers the output's, the
    source folder's, the calibration file's and the recipe's names and the accuracy report (whose
    last digits follow the thread count), so identical weights were stored as distinct builds."""
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = write_tiny_model_and_text(tmp_path)
    shutil.copytree(model, tmp_path / "model_copy")
    shutil.copy(calib, tmp_path / "other.txt")

    def recipe(name, text):
        r = preset("w4a16-gptq")
        return dataclasses.replace(
            r, name=name, calibration=dataclasses.replace(r.calibration, source=str(text), num_samples=2, seq_len=32),
            evaluation=dataclasses.replace(r.evaluation, data=str(text), seq_len=32, max_tokens=64))

    first = build(str(model), recipe("w4a16-gptq", calib), tmp_path / "x", progress=False, log=lambda m: None)
    renamed = build(str(tmp_path / "model_copy"), recipe("mine", tmp_path / "other.txt"), tmp_path / "y",
                    progress=False, log=lambda m: None)
    a, b = read_manifest(first.path), read_manifest(renamed.path)
    assert (a.name, a.source["name"], a.recipe["name"]) != (b.name, b.source["name"], b.recipe["name"])
    assert a.digest != b.digest and serving_digest(a) == serving_digest(b)
    rtn = build(str(model), preset("w4a16-rtn"), tmp_path / "z", progress=False, log=lambda m: None)
    assert serving_digest(read_manifest(rtn.path)) != serving_digest(a)  # other codes
    out = subprocess.run([sys.executable, "-m", "qkiln", "verify", str(first.path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert json.loads(out.stdout)["serving_digest"] == serving_digest(a), out.stderr


def test_an_artifact_from_before_manifests_had_a_digest_is_served(built, tmp_path):
    # format 1.0 (manifests without a digest) still loads everywhere; `qkiln serve` had exited on it
    _, a, _ = built
    old = tmp_path / "old"
    shutil.copytree(a, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["digest"]
    (old / "manifest.json").write_text(json.dumps(manifest | {"format_version": "1.0"}, indent=2))
    with serving_model(old, dtype="fp32", **ENGINE_KW) as (engine, server), \
            httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/v1/models").json()["data"][0]["artifact"]["digest"] == ""
        assert 'qkiln_artifact_info{digest="",model_name="tiny",name="a"' in client.get("/metrics").text
        done = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
