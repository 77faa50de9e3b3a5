"""What a registry and a deploy script read to tell which build is which: an artifact's `created`
(SOURCE_DATE_EPOCH), the name it is served under through a symlink, the artifact the server
reports (GET /v1/models, /metrics), and a folder replaced while it loads."""

import json
import os
import shutil

import httpx
import pytest

from qkiln.compile.artifact import read_manifest
from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.errors import ArtifactError
from qkiln.runtime import loader
from qkiln.runtime.llm import LLM
from loopback import serving_model
from tiny_models import write_tiny_hf_model

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
        assert card["artifact"] == {"name": "a", "digest": read_manifest(a).digest}
        metrics = client.get("/metrics").text
        assert f'qkiln_artifact_info{{digest="{read_manifest(a).digest}",model_name="tiny",name="a"}} 1.0' in metrics
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
