"""Artifacts from a registry cross a trust boundary. The manifest's digest has no key, so anyone can
edit an artifact and restamp its hashes: verify then passes by design, and what follows must still
be a typed error (exit 6, one line) before anything large is allocated, never a traceback, a
multi-gigabyte allocation or a loop over 10^9 layers (hostile-artifact probe, session 48)."""

import json
import struct
import sys

import pytest

from qkiln.compile.artifact import manifest_digest, read_manifest, sha256_file, verify_artifact
from qkiln.errors import ArtifactError
from qkiln.runtime.loader import load_for_serving
from tiny_models import write_tiny_hf_model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("hostile")
    source = write_tiny_hf_model(tmp / "m", "llama")
    return build(str(source), load_recipe("w4a16-rtn"), tmp / "a", use_cache=False, progress=False,
                 log=lambda m: None).path


def _copy(artifact, tmp_path):
    import shutil

    return shutil.copytree(artifact, tmp_path / "a")


def _restamp(out, manifest: dict | None = None):
    """Hashes and digest recomputed, as anyone can."""
    d = manifest if manifest is not None else json.loads((out / "manifest.json").read_text())
    for rel, entry in d["files"].items():
        entry["size"], entry["sha256"] = (out / rel).stat().st_size, sha256_file(out / rel)
    d["digest"] = manifest_digest(d)
    (out / "manifest.json").write_text(json.dumps(d))


@pytest.mark.parametrize("text,reason", [
    ('{"a": NaN}', "NaN is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' + "9" * 5000 + "}", "digits"),
])
def test_a_manifest_that_is_not_json_is_an_artifact_error(tmp_path, text, reason):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text(text)
    with pytest.raises(ArtifactError, match=f"not valid JSON .*{reason}"):
        read_manifest(tmp_path / "a")


def _rewrite_header(shard, edit):
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def _overlap(entry):
    """The tensor's span moved 2 bytes back, into the one before it (its size unchanged)."""
    entry["data_offsets"] = [entry["data_offsets"][0] - 2, entry["data_offsets"][1] - 2]


def _first_two(header):
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])
    return header[names[0]], header[names[1]]


@pytest.mark.parametrize("edit,match", [
    (lambda h: _first_two(h)[0].update(dtype="F128"), "malformed header entry"),
    (lambda h: _first_two(h)[0].update(shape=[-1, 4]), "malformed header entry"),
    (lambda h: _first_two(h)[0].update(shape=[10 ** 9, 10 ** 9]), "malformed header entry"),
    (lambda h: _overlap(_first_two(h)[1]), "starts at byte"),
])
def test_a_hostile_safetensors_header_is_refused_by_verify_and_the_loader(artifact, tmp_path, edit, match):
    out = _copy(artifact, tmp_path)
    [shard] = sorted((out / "weights").glob("*.safetensors"))
    _rewrite_header(shard, edit)
    _restamp(out)
    with pytest.raises(ArtifactError, match=match):
        verify_artifact(out)
    with pytest.raises(ArtifactError, match=match):
        load_for_serving(str(out))


@pytest.mark.parametrize("change,match", [
    ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers is 1000000000, not a whole number from 1 to 1024"),
    ({"num_hidden_layers": 3}, "the manifest says 3 layers, the weights hold 2"),
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0"),
    ({"max_position_embeddings": 10 ** 12}, "max_position_embeddings is 1000000000000"),
    ({"vocab_size": -5}, "vocab_size is -5"),
    ({"vocab_size": 300}, r"the embedding is \[260, 128\], the manifest says vocab_size 300"),
    ({"rope_theta": "abc"}, "rope_theta is 'abc', not a positive number"),
    ({"head_dim": 33}, "head_dim"),
    ({"architecture": "evil"}, "architecture 'evil' is not supported"),
    ({"eos_token_ids": "abc"}, "bos / eos token ids"),
])
def test_a_hostile_architecture_is_refused_before_anything_is_allocated(artifact, tmp_path, change, match):
    out = _copy(artifact, tmp_path)
    d = json.loads((out / "manifest.json").read_text())
    d["architecture"].update(change)
    _restamp(out, d)
    verify_artifact(out)  # the container is sound: hashes and digest match
    with pytest.raises(ArtifactError, match=match):
        load_for_serving(str(out))


def test_qkiln_verify_refuses_what_cannot_load(artifact, tmp_path):
    """A registry admits what `qkiln verify` passes: an architecture the weights contradict is
    refused there too (exit 6), not first at serve time."""
    import subprocess

    out = _copy(artifact, tmp_path)
    d = json.loads((out / "manifest.json").read_text())
    d["architecture"]["num_hidden_layers"] = 3
    _restamp(out, d)
    run = subprocess.run([sys.executable, "-m", "qkiln", "verify", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 6 and "Traceback" not in run.stderr, run.stderr
    assert "the manifest says 3 layers, the weights hold 2" in run.stderr


def _archive_of(path, entries, gz: bool = False):
    """A tar (.tar.gz) of (name, bytes) entries, in order."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_an_archive_entry_the_manifest_does_not_list_is_refused_before_it_is_written(artifact, tmp_path):
    """After manifest.json (written first) every entry must be a file it lists, of its size: a
    4 MB .tar.gz had written 4 GB of zeros into TMPDIR before verify looked."""
    from qkiln.compile.artifact_archive import extract_archive

    manifest = (artifact / "manifest.json").read_bytes()
    listed = sorted(read_manifest(artifact).files)
    for entries, match in (
        ([("manifest.json", manifest), ("zeros.bin", bytes(1 << 20))], "'zeros.bin': not in the archive's manifest"),
        ([("manifest.json", manifest), (listed[0], (artifact / listed[0]).read_bytes() + b"x")],
         "its size differs from the archive's manifest"),
    ):
        archive = _archive_of(tmp_path / "a.tar", entries)
        with pytest.raises(ArtifactError, match=match):
            extract_archive(archive, tmp_path / "x")
        assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.tar"]


def test_an_archive_that_unpacks_far_past_its_size_is_refused(tmp_path):
    """Before the manifest: a .tar.gz may unpack to at most 32x its size (a gzip of zeros: ~1000x),
    and at most 10,000 entries."""
    from qkiln.compile import artifact_archive
    from qkiln.compile.artifact_archive import extract_archive

    bomb = _archive_of(tmp_path / "b.tar.gz", [("weights/zeros.bin", bytes(64 << 20))], gz=True)
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(ArtifactError, match="unpacks to 67108864 bytes, more than an artifact archive of this size"):
        extract_archive(bomb, tmp_path / "x")
    many = _archive_of(tmp_path / "m.tar", [(f"f{i}", b"") for i in range(artifact_archive._MAX_ENTRIES_BEFORE_MANIFEST + 1)])
    with pytest.raises(ArtifactError, match="more than 10000 entries before manifest.json"):
        extract_archive(many, tmp_path / "x")
    conflict = _archive_of(tmp_path / "c.tar", [("zz", b"a"), ("zz/b", b"b")])
    with pytest.raises(ArtifactError, match=r"\(File exists\); the archive is corrupt or malicious"):
        extract_archive(conflict, tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz", "c.tar", "m.tar"]


def test_a_special_token_that_is_not_text_names_no_token(artifact, tmp_path):
    """tokenizer_config.json's eos_token as a list failed the load with a TypeError traceback."""
    out = _copy(artifact, tmp_path)
    config_file = out / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(eos_token=["x"], bos_token=7)
    config_file.write_text(json.dumps(config))
    _restamp(out)
    loaded = load_for_serving(str(out))
    assert loaded.tokenizer.eos_token_id is None or isinstance(loaded.tokenizer.eos_token_id, int)


def test_an_archive_with_a_huge_extended_header_is_refused_unread(tmp_path):
    """tarfile reads a pax header whole before it yields its entry: a 2 GiB one took 2.35 GB."""
    import io
    import tarfile

    from qkiln.compile.artifact_archive import extract_archive

    for name, pax in (("manifest.json", {"comment": "x" * (2 << 20)}), ("a" * (2 << 20), {})):
        archive = tmp_path / "p.tar"
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT) as tar:
            info = tarfile.TarInfo(name)
            info.pax_headers, info.size = pax, 2
            tar.addfile(info, io.BytesIO(b"{}"))
        with pytest.raises(ArtifactError, match="cannot read archive .*an extended header of .* bytes"):
            extract_archive(archive, tmp_path / "x")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["p.tar"]
