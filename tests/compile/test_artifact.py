"""The artifact on real files: round trip, reproducibility, tamper detection, atomic writes, archives."""

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from qkiln.compile import artifact_writer
from qkiln.compile.artifact import (FORMAT_VERSION, Manifest, load_tensors, manifest_digest, read_manifest,
                                    read_tensor_index, serving_digest, toolchain_versions, verify_artifact)
from qkiln.compile.artifact_cli import inspect_cmd, summarize_artifact, verify_cmd
from qkiln.compile.artifact_archive import extract_archive, write_archive
from qkiln.compile.artifact_writer import write_artifact
from qkiln.errors import ArtifactError, TargetUnavailableError

SHARD_BYTES = 512  # small so the tensors below need several shards


def make_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(16, 24, generator=g)  # [out_features, in_features]
    tied = torch.randn(8, 8, generator=g)
    return {
        "model.layers.0.q.qweight": torch.randint(0, 256, (16, 12), dtype=torch.uint8, generator=g),
        "model.layers.0.q.scales": base[:, :3].to(torch.bfloat16),  # a non-contiguous view
        "model.layers.0.k.weight": torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.k.weight_scale": torch.tensor(0.02),
        "model.layers.0.v.qweight": torch.randint(-128, 128, (8, 40), dtype=torch.int8, generator=g),
        "embed.weight": tied,
        "lm_head.weight": tied,  # tied: the same storage under two names
        "norm.weight": base.t()[0].clone(),  # a transposed row, fp32
    }


# a valid config for `qkiln verify`'s check of the architecture (one layer: model.layers.0.*)
ARCHITECTURE = {"architecture": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}


def make_manifest(device="cpu", **kw):
    return Manifest(
        name="tiny-w4a16", architecture=ARCHITECTURE,
        target={"device": device, "min_compute_capability": None}, recipe={"preset": "w4a16-rtn", "fallbacks": {}},
        quantization={"model.layers.0.q": {"scheme": "w4a16", "group_size": 8, "tensors": ["qweight", "scales"]}},
        calibration={"source": "wikitext", "num_samples": 4, "seq_len": 32, "seed": 0, "token_sha256": "ab" * 32},
        source={"path": "tiny", "kind": "hf", "sha256": "cd" * 32}, toolchain={"python": "3.x"},
        accuracy={"ppl": 12.5, "kl": 0.01}, source_bytes_bf16=4096, **kw)


TOKENIZER = {"tokenizer.json": b'{"model": {}}', "tokenizer_config.json": b"{}"}
REPORTS = {"accuracy.json": {"ppl": 12.5, "kl": 0.01}, "build_log.json": b'{"steps": []}\n'}


def build(path, tensors=None, manifest=None, **kw):
    return write_artifact(path, manifest or make_manifest(), make_tensors() if tensors is None else tensors,
                          TOKENIZER, REPORTS, shard_bytes=SHARD_BYTES, **kw)


def as_bytes(t):
    return t.reshape(-1).contiguous().view(torch.uint8)  # bitwise comparison works for every dtype, fp8 included


def siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_round_trip(tmp_path):
    out = build(tmp_path / "a", engines={"onnx/model.onnx": b"onnx-bytes"})
    verified = verify_artifact(out)
    m = read_manifest(out)
    assert verified == sorted(m.files) and "engines/onnx/model.onnx" in verified
    assert len([r for r in verified if r.startswith("weights/")]) >= 3
    assert m.quantization == make_manifest().quantization and m.format_version == FORMAT_VERSION
    assert json.loads((out / "reports/accuracy.json").read_text()) == REPORTS["accuracy.json"]
    loaded, expected = load_tensors(out, m), make_tensors()
    assert sorted(loaded) == sorted(expected)
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(as_bytes(loaded[name]), as_bytes(t)), name
    index = read_tensor_index(out)
    assert index["model.layers.0.k.weight"].dtype == "F8_E4M3" and index["model.layers.0.q.scales"].shape == (16, 3)
    assert Manifest.from_json(m.to_json()) == m


def test_identical_inputs_give_identical_bytes(tmp_path):
    a = build(tmp_path / "a")
    reversed_tensors = dict(reversed(list(make_tensors().items())))  # insertion order must not matter
    b = build(tmp_path / "b", tensors=reversed_tensors)
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    script = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
             f"from test_artifact import build; build({str(tmp_path / 'p')!r})"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)  # another process, hash seed
    for rel in files:
        assert (a / rel).read_bytes() == (tmp_path / "p" / rel).read_bytes(), rel
    c = build(tmp_path / "c", tensors=make_tensors(seed=1))
    assert (a / "manifest.json").read_bytes() != (c / "manifest.json").read_bytes()


def test_one_flipped_byte_in_any_file_fails_verify_naming_it(tmp_path):
    out = build(tmp_path / "a")
    for rel in read_manifest(out).files:
        path = out / rel
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01  # last byte: tensor data for shards, content for the rest
        path.write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match="sha256 mismatch") as e:
            verify_artifact(out)
        assert str(e.value).startswith(f"{path}:")
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    verify_artifact(out)


def test_verify_racing_a_forced_rebuild_checks_the_new_artifact(tmp_path, monkeypatch):
    """A registry verifying while `build --force` replaced the folder read the old manifest and
    the new weights: a false "sha256 mismatch" (4 in 10,685 checks in a probe)."""
    from qkiln.compile import artifact

    out = build(tmp_path / "a")
    hashed, replaced = artifact.sha256_file, []

    def replace_then_hash(path):
        if not replaced:  # the other process's rename lands after the manifest was read
            replaced.append(build(out, tensors=make_tensors(seed=1), overwrite=True))
        return hashed(path)

    monkeypatch.setattr(artifact, "sha256_file", replace_then_hash)
    assert verify_artifact(out) == sorted(read_manifest(out).files) and replaced
    monkeypatch.setattr(artifact, "sha256_file", hashed)
    data = bytearray((out / "tokenizer/tokenizer.json").read_bytes())  # a damaged file still fails at once
    (out / "tokenizer/tokenizer.json").write_bytes(bytes(data[:-1]) + b"!")
    with pytest.raises(ArtifactError, match="tokenizer.json: size mismatch|tokenizer.json: sha256 mismatch"):
        verify_artifact(out)


def test_missing_file_and_extra_file(tmp_path):
    out = build(tmp_path / "a")
    shard = sorted((out / "weights").iterdir())[1]
    moved = shard.rename(tmp_path / "moved")
    with pytest.raises(ArtifactError, match=f"{shard}: listed in the manifest but missing"):
        verify_artifact(out)
    moved.rename(shard)
    (out / "weights/model-00099-of-00099.safetensors").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="model-00099-of-00099.safetensors: not listed"):
        verify_artifact(out)
    (out / "weights/model-00099-of-00099.safetensors").unlink()
    (out / "tokenizer/extra.json").symlink_to(out / "tokenizer/tokenizer.json")
    with pytest.raises(ArtifactError, match="symbolic link"):
        verify_artifact(out)


def edit_manifest(out, restamp=True, **changes):
    """Change manifest fields; restamp: as a writer would (a new digest), else as a hand edit."""
    d = json.loads((out / "manifest.json").read_text())
    d.update(changes)
    if restamp:
        d["digest"] = manifest_digest(d)
    (out / "manifest.json").write_text(json.dumps(d))


def test_an_edited_manifest_is_refused(tmp_path):
    out = build(tmp_path / "a")
    assert read_manifest(out).digest == manifest_digest(json.loads((out / "manifest.json").read_text()))
    architecture = read_manifest(out).architecture | {"rms_norm_eps": 0.5}
    edit_manifest(out, restamp=False, architecture=architecture)  # valid JSON, valid schema, other numbers
    with pytest.raises(ArtifactError, match="do not match its digest"):
        verify_artifact(out)
    edit_manifest(out, restamp=False, digest=None)
    with pytest.raises(ArtifactError, match="'digest' must be str"):
        read_manifest(out)
    d = json.loads((out / "manifest.json").read_text())
    del d["digest"]
    (out / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ArtifactError, match="missing field 'digest'"):
        read_manifest(out)
    d["format_version"] = "1.0"  # written before manifests carried a digest: still read
    (out / "manifest.json").write_text(json.dumps(d))
    assert read_manifest(out).architecture["rms_norm_eps"] == 0.5


def test_a_key_twice_in_the_manifest_is_refused(tmp_path):
    """Python keeps the last of two equal keys, a strict or first-wins parser the other: a registry
    indexing the file could read another name than qkiln serves under."""
    out = build(tmp_path / "a")
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text.replace('"name": "tiny-w4a16"', '"name": "evil", "name": "tiny-w4a16"', 1))
    with pytest.raises(ArtifactError, match="the key 'name' appears twice"):
        verify_artifact(out)


def test_unknown_major_refused_newer_minor_accepted(tmp_path):
    out = build(tmp_path / "a")
    edit_manifest(out, format_version="2.0")
    with pytest.raises(ArtifactError, match="unknown major format version 2.0"):
        verify_artifact(out)
    edit_manifest(out, format_version="1.7", adapters={"lora": []})  # a field a newer minor added
    assert verify_artifact(out)
    m = read_manifest(out)
    assert m.extra == {"adapters": {"lora": []}} and '"adapters"' in m.to_json()
    edit_manifest(out, format_version="1.0")  # same minor with an unknown field: edited by hand
    with pytest.raises(ArtifactError, match=r"unknown field\(s\) \['adapters'\]"):
        read_manifest(out)


@pytest.mark.parametrize("change, needle", [
    ({"format_version": "one"}, "not MAJOR.MINOR"),
    ({"target": {"device": "tpu"}}, "target.device"),
    ({"files": {"weights/x": {"sha256": "00", "size": 1}}}, "64 hex"),
    ({"files": {"../x": {"sha256": "0" * 64, "size": 1}}}, "plain relative path"),
    ({"name": 3}, "field 'name' must be str"),
])
def test_manifest_validation_names_the_problem(change, needle):
    d = json.loads(make_manifest().to_json())
    d.update(change)
    with pytest.raises(ArtifactError, match=needle):
        Manifest.from_json(json.dumps(d))
    d = json.loads(make_manifest().to_json())
    del d["recipe"]
    with pytest.raises(ArtifactError, match="missing field 'recipe'"):
        Manifest.from_json(json.dumps(d))


def test_failure_mid_write_leaves_nothing_and_rerun_succeeds(tmp_path, monkeypatch):
    real_write_shard, calls = artifact_writer.write_shard, []

    def write_then_fail(path, tensors):  # a real write, then a real failure (disk full, say)
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_write_shard(path, tensors)

    monkeypatch.setattr(artifact_writer, "write_shard", write_then_fail)
    with pytest.raises(ArtifactError, match="writing failed \\(No space left on device\\); nothing was written"):
        build(tmp_path / "a")  # the CLI's `error:` line, exit 6 (was an OSError traceback)
    assert not (tmp_path / "a").exists() and siblings(tmp_path / "a") == []
    monkeypatch.setattr(artifact_writer, "write_shard", real_write_shard)
    verify_artifact(build(tmp_path / "a"))


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_artifact import build
    from qkiln import cli
    from qkiln.compile import artifact_writer
    signal.signal(signal.SIGTERM, cli._terminated)  # as `qkiln` installs it
    real = artifact_writer.write_shard
    def write_then_die(path, tensors):
        real(path, tensors)
        os.kill(os.getpid(), signal.{signal})  # after the first shard hit the disk
    artifact_writer.write_shard = write_then_die
    build({out!r})
""")


def test_sigterm_mid_write_leaves_nothing(tmp_path):
    """CI cancelling a job and docker stop send SIGTERM: the partial output was left behind."""
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "a"), signal="SIGTERM")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_killed_build_leaves_only_a_partial_that_verify_refuses(tmp_path):
    out = tmp_path / "a"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), signal="SIGKILL")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert not out.exists()
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".a.partial-")]
    assert any((partial / "weights").iterdir())
    with pytest.raises(ArtifactError, match="unfinished build"):
        verify_artifact(partial)
    with pytest.raises(ArtifactError, match="unfinished build"):
        summarize_artifact(partial)  # inspect too
    verify_artifact(build(out))
    assert siblings(out) == []  # the rerun removed the dead process's partial dir


def test_a_build_of_another_name_removes_a_dead_build_s_partial(tmp_path):
    out = tmp_path / "a"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), signal="SIGKILL")
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode == -9
    assert [p for p in siblings(out) if p.startswith(".a.partial-")]
    live = tmp_path / f".c.partial-{artifact_writer.HOST_TAG}-{os.getpid()}-x"  # a running build's: kept
    live.mkdir()
    verify_artifact(build(tmp_path / "b"))
    assert siblings(out) == sorted(["b", live.name])


def test_a_replace_that_loses_a_race_says_so_and_leaves_the_winner(tmp_path, monkeypatch):
    """Two `build --force` to one path: the other writer's rename came between this one's two (old
    away, new in). That failed as 'writing failed (Directory not empty) ... free space' and left the
    old artifact in a .trash folder for good (probe s48)."""
    out = build(tmp_path / "a")
    winner = build(tmp_path / "w", tensors=make_tensors(seed=1))
    real_rename = os.rename

    def racing_rename(src, dst):
        if Path(dst) == out and Path(src).name.startswith(".a.partial-"):  # ours, new in: the other one first
            real_rename(winner, out)
        real_rename(src, dst)

    monkeypatch.setattr(artifact_writer.os, "rename", racing_rename)
    with pytest.raises(ArtifactError, match="another process wrote there while this one was replacing it .*; "
                                            "its output stays and this one's was discarded"):
        build(out, overwrite=True)
    monkeypatch.setattr(artifact_writer.os, "rename", real_rename)
    verify_artifact(out)
    assert torch.equal(load_tensors(out)["norm.weight"], make_tensors(seed=1)["norm.weight"])  # the winner's
    assert siblings(out) == []  # no partial, no trash holding the old one

    def failing_rename(src, dst):  # the new one cannot go in (no race): the old one goes back
        if Path(dst) == out and Path(src).name.startswith(".a.partial-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_rename(src, dst)

    monkeypatch.setattr(artifact_writer.os, "rename", failing_rename)
    with pytest.raises(ArtifactError, match=r"writing failed \(Input/output error\)"):
        build(out, overwrite=True)
    monkeypatch.setattr(artifact_writer.os, "rename", real_rename)
    assert torch.equal(load_tensors(out)["norm.weight"], make_tensors(seed=1)["norm.weight"]) and siblings(out) == []


def test_a_copy_taken_while_the_writer_checks_never_verifies(tmp_path):
    """A build killed during its engine check left a partial whose manifest was complete: copied or
    renamed, it verified, though its check never finished."""
    def copy_then_die(partial):
        shutil.copytree(partial, tmp_path / "copy")  # what a SIGKILL here would leave, under a new name
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "a", check=copy_then_die)
    with pytest.raises(ArtifactError, match="stopped while checking it"):
        verify_artifact(tmp_path / "copy")
    with pytest.raises(ArtifactError, match="stopped while checking it"):  # inspect printed its digest (s48)
        summarize_artifact(tmp_path / "copy")
    verify_artifact(build(tmp_path / "copy", overwrite=True))  # the remedy it names: --force replaces it
    checked = []
    out = build(tmp_path / "a", check=checked.append)
    assert checked and verify_artifact(out)  # a check that passes leaves no marker


def test_overwrite_semantics(tmp_path):
    out = build(tmp_path / "a")
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        build(out, tensors=make_tensors(seed=1))
    assert torch.equal(load_tensors(out)["norm.weight"], make_tensors()["norm.weight"])
    build(out, tensors=make_tensors(seed=1), overwrite=True)
    assert torch.equal(load_tensors(out)["norm.weight"], make_tensors(seed=1)["norm.weight"])
    assert siblings(out) == []
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a qkiln artifact, refusing"):
        build(precious, overwrite=True)
    assert (precious / "notes.txt").read_text() == "keep me"
    with pytest.raises(ArtifactError, match="inside the artifact"):
        build(out / "weights" / "nested")
    verify_artifact(out)
    for foreign in ('{"name": "a web app"}', '{"format_version": "1.0", "terraform_version": "1.5.0"}'):
        (precious / "manifest.json").write_text(foreign)  # a manifest.json, but not ours
        with pytest.raises(ArtifactError, match="not a qkiln artifact, refusing"):
            build(precious, overwrite=True)
        assert (precious / "notes.txt").read_text() == "keep me"


def test_force_never_deletes_files_added_to_an_artifact(tmp_path):
    """--force replaces what qkiln wrote; deploy notes or a .git put beside it were deleted."""
    out = build(tmp_path / "a")
    (out / "DEPLOY_NOTES.md").write_text("keep me")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: main")
    with pytest.raises(ArtifactError, match=r"holds files qkiln did not write \(.git/HEAD, DEPLOY_NOTES.md\)"):
        build(out, tensors=make_tensors(seed=1), overwrite=True)
    assert (out / "DEPLOY_NOTES.md").read_text() == "keep me" and (out / ".git" / "HEAD").is_file()
    (out / "DEPLOY_NOTES.md").unlink()
    shutil.rmtree(out / ".git")
    build(out, tensors=make_tensors(seed=1), overwrite=True)  # only qkiln's files: replaced


def test_a_damaged_artifact_is_named_as_one_when_force_cannot_replace_it(tmp_path):
    out = build(tmp_path / "a")
    (out / "manifest.json").write_text('{"format_version": ')  # cut short: its file list is gone
    with pytest.raises(ArtifactError, match="looks like a damaged qkiln artifact"):
        build(out, overwrite=True)
    assert (out / "weights").is_dir()


def test_inspect_says_the_accuracy_in_words():
    from qkiln.compile.artifact_cli import _accuracy_line

    acc = {"perplexity": 36.5721, "reference_perplexity": 30.0746, "perplexity_change": 0.21605,
           "bits_per_byte": 1.24037, "kl_divergence": 0.22929, "top1_agreement": 0.73288, "num_tokens": 4088,
           "protocol": {"data": "../shared/data/wikitext-2-raw/wiki.test.raw"}}
    assert _accuracy_line(acc) == ("perplexity 36.572 (+21.61% vs the source's 30.075), bits/byte 1.2404, "
                                   "KL 0.2293 nats/token, top-1 73.3%, 4088 tokens of wiki.test.raw")
    assert _accuracy_line({"skipped": "no data"}) == '{"skipped": "no data"}'


def test_inspect_names_the_linears_that_fell_back(tmp_path):
    """A GPTQ layer that fell back to RTN was only in --json's recipe; the text now says so."""
    from qkiln.compile.artifact_cli import _format_summary, summarize_artifact

    assert "fell back" not in "\n".join(_format_summary(summarize_artifact(build(tmp_path / "a"))))
    fallbacks = {f"model.layers.{i}.mlp.down_proj": "rtn" for i in range(5)}
    manifest = make_manifest()
    manifest.recipe["fallbacks"] = fallbacks
    summary = summarize_artifact(build(tmp_path / "b", manifest=manifest))
    assert summary["quantization"]["fallbacks"] == fallbacks
    (line,) = [s for s in _format_summary(summary) if s.startswith("quantization:")]
    assert line.endswith("; 5 fell back: model.layers.0.mlp.down_proj (rtn), model.layers.1.mlp.down_proj (rtn), "
                         "model.layers.2.mlp.down_proj (rtn), ... (2 more, inspect --json)")


def test_writes_in_other_pid_namespaces_keep_their_partials(tmp_path):
    """Each container's build is pid 1: a partial named by pid alone was taken for this process's
    own (or, across hosts, for a dead one's) and deleted while the other build wrote it."""
    from qkiln.compile.artifact_writer import HOST_TAG

    live_elsewhere = tmp_path / f".a.partial-0badc0de-{os.getpid()}-x1"  # another host: its pid means nothing here
    same_pid_here = tmp_path / f".a.partial-{HOST_TAG}-{os.getpid()}-x2"  # this pid is alive: never ours to delete
    dead_here = tmp_path / f".a.partial-{HOST_TAG}-999999999-x3"
    legacy_dead = tmp_path / ".a.trash-999999999"
    for d in (live_elsewhere, same_pid_here, dead_here, legacy_dead):
        d.mkdir()
    verify_artifact(build(tmp_path / "a"))
    assert siblings(tmp_path / "a") == sorted([live_elsewhere.name, same_pid_here.name])
    for d in (live_elsewhere, same_pid_here):
        with pytest.raises(ArtifactError, match="unfinished build"):
            verify_artifact(d)


def test_a_build_in_another_pid_namespace_of_this_host_keeps_its_partial(tmp_path):
    """Two containers sharing a hostname (docker --network host) and a volume: the other one's live
    build (pid 82 there, no such pid here) looked dead, and its partial was deleted mid-write."""
    import shutil
    import subprocess
    import sys

    from qkiln.compile.artifact_writer import HOST_TAG

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    other = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                            "from qkiln.compile.artifact_writer import HOST_TAG; print(HOST_TAG)"],
                           capture_output=True, text=True)
    if other.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {other.stderr.strip()[-200:]}")
    other_tag = other.stdout.strip()
    assert len(other_tag) == 8 and other_tag != HOST_TAG
    theirs = tmp_path / f".b.partial-{other_tag}-999999999-x1"
    theirs.mkdir()
    verify_artifact(build(tmp_path / "a"))
    assert theirs.is_dir()


def test_a_staging_folder_deleted_by_another_process_is_said(tmp_path):
    """Another build's cleanup took our partial for a dead one's: the check then failed as a source
    model without a tokenizer (exit 3, "copy the tokenizer files there")."""
    from qkiln.runtime.tokenizer import Tokenizer

    def deleted_meanwhile(tmp):
        shutil.rmtree(tmp)
        Tokenizer.from_dir(tmp / "tokenizer")

    with pytest.raises(ArtifactError, match="staging folder .* was deleted while it was being written"):
        build(tmp_path / "a", check=deleted_meanwhile)
    assert siblings(tmp_path / "a") == [] and not (tmp_path / "a").exists()

    def fails(tmp):
        raise ArtifactError("the engine does not match")

    with pytest.raises(ArtifactError, match="^the engine does not match$"):  # a failure of its own stays itself
        build(tmp_path / "a", check=fails)


def test_an_output_that_appears_while_writing_is_not_replaced(tmp_path):
    from qkiln.compile.artifact_writer import check_replaceable, staged_directory

    out = tmp_path / "export"
    with pytest.raises(ArtifactError, match="already exists"):
        with staged_directory(out, lambda: check_replaceable(out, False, "an export", lambda d: None)) as tmp:
            (tmp / "model.onnx").write_bytes(b"new")
            out.mkdir()  # another program, meanwhile
            (out / "mine.txt").write_text("user data")
    assert (out / "mine.txt").read_text() == "user data" and siblings(out) == []


def test_unwritable_destinations_fail_before_any_work(tmp_path):
    from qkiln.compile.artifact_archive import check_archive_path
    from qkiln.compile.artifact_writer import check_destination

    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="cannot write there"):
        check_destination(Path("/proc/qkiln-test"), overwrite=False)
    # a path under a file says so (it was "cannot write there (File exists)": probe s48)
    with pytest.raises(ArtifactError, match="file is a file, so the folder .*file/a cannot be made"):
        check_destination(tmp_path / "file" / "a" / "b", overwrite=False)
    (tmp_path / "d.tar").mkdir()  # an existing directory is not an archive's file name
    with pytest.raises(ArtifactError, match="is a directory"):
        check_archive_path(tmp_path / "d.tar")
    with pytest.raises(ArtifactError, match="file is a file, not a folder"):
        check_archive_path(tmp_path / "file" / "a.tar")
    (tmp_path / "old.tar").write_bytes(b"a registry's copy")
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        check_archive_path(tmp_path / "old.tar")
    check_archive_path(tmp_path / "old.tar", overwrite=True)


def test_the_working_directory_is_not_an_output(tmp_path, monkeypatch):
    """`-o .` or `-o ""` named the artifact "" (refused after the whole build) and --force would
    have replaced the folder the shell stands in."""
    from qkiln.compile.artifact_writer import check_destination

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    for out, where in ((Path(""), "the current directory"), (Path("a/.."), "the current directory"),
                       (Path(".."), "holding the current directory")):
        with pytest.raises(ArtifactError, match=where):
            check_destination(out, overwrite=True)


def test_an_archive_write_clears_what_killed_writes_left(tmp_path):
    out = build(tmp_path / "a")
    dead = tmp_path / ".a.tar.partial-999999999"  # no such process
    dead.write_bytes(b"half an archive")
    write_archive(out, tmp_path / "a.tar")
    assert not dead.exists() and (tmp_path / "a.tar").is_file()


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_archive_is_reproducible_and_extracts_to_a_valid_artifact(tmp_path, suffix):
    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    os.utime(b / "manifest.json", (1, 1))  # file times must not reach the archive
    first = write_archive(a, tmp_path / f"one{suffix}")
    second = write_archive(b, tmp_path / f"two{suffix}")
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(first) as tar:
        names = tar.getnames()
        assert names[0] == "manifest.json" and names[1:] == sorted(names[1:])
        assert {(m.mtime, m.uid, m.gid, m.mode) for m in tar} == {(0, 0, 0, 0o644)}
    out = extract_archive(first, tmp_path / "x")
    assert verify_artifact(out) == verify_artifact(a)
    assert torch.equal(as_bytes(load_tensors(out)["model.layers.0.k.weight"]),
                       as_bytes(make_tensors()["model.layers.0.k.weight"]))


def test_archive_packed_by_other_tools_extracts(tmp_path):
    out = build(tmp_path / "a")
    with tarfile.open(tmp_path / "repacked.tgz", "w:gz") as tar:  # like `tar -C a -czf repacked.tgz .`
        tar.add(out, arcname=".")
    assert verify_artifact(extract_archive(tmp_path / "repacked.tgz", tmp_path / "x")) == verify_artifact(out)


def make_tar(path, entries):
    with tarfile.open(path, "w") as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


@pytest.mark.parametrize("bad", ["../evil.txt", "/tmp/evil.txt", "weights/../../evil.txt", "link"])
def test_archive_with_path_traversal_or_links_is_refused(tmp_path, bad):
    archive = tmp_path / "bad.tar"
    info = tarfile.TarInfo(bad)
    if bad == "link":
        info.type, info.linkname, data = tarfile.SYMTYPE, "../../etc/passwd", None
    else:
        data = b"pwned"
        info.size = len(data)
    make_tar(archive, [(info, data)])
    (tmp_path / "deep").mkdir()
    with pytest.raises(ArtifactError, match="refusing entry"):
        extract_archive(archive, tmp_path / "deep/x")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "deep/x").exists()
    assert siblings(tmp_path / "deep/x") == []


def test_tampered_archive_fails_to_extract(tmp_path):
    archive = write_archive(build(tmp_path / "a"), tmp_path / "a.tar")
    data = bytearray(archive.read_bytes())
    with tarfile.open(archive) as tar:
        member = [m for m in tar if m.name.startswith("weights/")][0]
    data[member.offset_data + member.size - 1] ^= 0x01
    archive.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{archive}: {member.name}: sha256 mismatch"):
        extract_archive(archive, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_data_after_the_end_of_an_archive_is_refused(tmp_path, suffix):
    """tar never reads past its end blocks: a second archive joined on, or a damaged tail, verified."""
    a = build(tmp_path / "a")
    archive = write_archive(a, tmp_path / f"a{suffix}")
    raw = archive.read_bytes()
    archive.write_bytes(raw + bytes(10240))  # more zero padding, as some tools write: still the same archive
    assert verify_artifact(extract_archive(archive, tmp_path / "padded")) == verify_artifact(a)
    joined = tmp_path / f"joined{suffix}"
    joined.write_bytes(raw + write_archive(build(tmp_path / "b", tensors=make_tensors(seed=1)),
                                           tmp_path / f"b{suffix}").read_bytes())
    with pytest.raises(ArtifactError, match="after the end of its tar archive|cannot read archive"):
        extract_archive(joined, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    if suffix == ".tar":  # junk where the end blocks belong: tar took it for the end too
        with tarfile.open(archive) as tar:
            last = tar.getmembers()[-1]
        end = last.offset_data + -(-last.size // 512) * 512
        archive.write_bytes(raw[:end] + b"junk" * 256)
        with pytest.raises(ArtifactError, match="after the end of its tar archive"):
            extract_archive(archive, tmp_path / "x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_artifact_refused_without_cuda(tmp_path):
    out = build(tmp_path / "a", manifest=make_manifest(device="cuda"))
    with pytest.raises(TargetUnavailableError, match="built for target cuda but CUDA is not available"):
        verify_artifact(out)
    assert verify_artifact(out, check_target=False)  # a registry may still check the bytes
    shard = sorted((out / "weights").iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    with pytest.raises(ArtifactError, match="mismatch") as damaged:  # exit 6, not 7: do not send it elsewhere
        verify_artifact(out)
    assert not isinstance(damaged.value, TargetUnavailableError)


def test_artifact_module_imports_without_torch():
    code = "import sys, qkiln.compile.artifact; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert {"python", "torch", "safetensors"} <= set(toolchain_versions())


def cli():
    app = typer.Typer()
    app.command("verify")(verify_cmd)
    app.command("inspect")(inspect_cmd)
    return app


def test_cli_verify_and_inspect(tmp_path):
    out = build(tmp_path / "a")
    runner = CliRunner()
    ok = runner.invoke(cli(), ["verify", str(out)])
    m = read_manifest(out)
    assert ok.exit_code == 0 and ok.stdout.strip() == f"ok: {len(m.files)} files verified (artifact {m.name!r}, " \
                                                      f"digest {m.digest})"
    # one JSON object for a pipeline: what it verified, or why not, with the exit status as ever
    result = json.loads(runner.invoke(cli(), ["verify", str(out), "--json"]).stdout)
    assert result == {"ok": True, "kind": "artifact", "name": m.name, "digest": m.digest, "files": len(m.files),
                      "serving_digest": serving_digest(m), "engines": None}
    archive = write_archive(out, tmp_path / "a.tar.gz")
    assert runner.invoke(cli(), ["verify", str(archive)]).stdout.startswith("ok: ")
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "reports" / "accuracy.json").write_text("{}")
    failed = runner.invoke(cli(), ["verify", str(damaged), "--json"])
    assert failed.exit_code != 0 and json.loads(failed.stdout.splitlines()[0])["ok"] is False
    assert "accuracy.json" in json.loads(failed.stdout.splitlines()[0])["error"]
    summary = json.loads(runner.invoke(cli(), ["inspect", str(out), "--json"]).stdout)
    weights = sum(p.stat().st_size for p in (out / "weights").iterdir())
    assert summary["sizes"]["weights_bytes"] == weights
    assert summary["sizes"]["compression_ratio"] == round(4096 / weights, 3)
    assert set(summary["sizes"]["tensor_bytes_by_dtype"]) == {"BF16", "F32", "F8_E4M3", "I8", "U8"}
    assert summary["accuracy"] == {"kl": 0.01, "ppl": 12.5}
    # what a registry keys on, and the recipe whole (long fields were "<N entries>" strings)
    manifest = read_manifest(out)
    assert summary["digest"] == manifest.digest and summary["files"] == manifest.files
    assert summary["recipe"] == manifest.recipe and summary["architecture"] == manifest.architecture
    assert "compression:" in runner.invoke(cli(), ["inspect", str(out)]).stdout
    shard = sorted((out / "weights").iterdir())[1]
    moved = shard.rename(shard.with_name("renamed.safetensors"))
    renamed = runner.invoke(cli(), ["inspect", str(out)])  # was a FileNotFoundError traceback
    assert renamed.exit_code == 6 and renamed.stderr.startswith(f"error: {shard}: cannot read it")
    moved.rename(shard)
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    bad = runner.invoke(cli(), ["verify", str(out)])
    assert bad.exit_code == 6 and bad.stdout == ""
    (line,) = bad.stderr.splitlines()
    assert line.startswith(f"error: {shard}: ") and "mismatch" in line
    shutil.rmtree(out)
    missing = runner.invoke(cli(), ["verify", str(out)])
    assert missing.exit_code == 6 and missing.stderr.startswith("error: ")


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [4]}, [1, 2], {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}])
def test_a_malformed_shard_header_is_an_artifact_error(tmp_path, entry):
    """`inspect` reads headers only: a header that is JSON but not safetensors' must not be a KeyError."""
    import struct

    out = build(tmp_path / "a")
    shard = next((out / "weights").glob("*.safetensors"))
    header = json.dumps({"norm.weight": entry}).encode()
    shard.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ArtifactError, match="header"):
        read_tensor_index(out)


def test_a_tar_of_something_else_says_so_without_naming_temp_folders(tmp_path):
    (tmp_path / "notes.txt").write_text("not an artifact")
    with tarfile.open(tmp_path / "other.tar", "w") as tar:
        tar.add(tmp_path / "notes.txt", arcname="notes.txt")
    with pytest.raises(ArtifactError, match="not a qkiln artifact archive") as e:
        extract_archive(tmp_path / "other.tar", tmp_path / "x")
    assert "partial" not in str(e.value) and not (tmp_path / "x").exists()


def test_a_tar_of_the_folder_itself_says_how_to_pack_it(tmp_path):
    out = build(tmp_path / "a1")
    with tarfile.open(tmp_path / "a1.tar", "w") as tar:  # `tar -cf a1.tar a1`, the common way
        tar.add(out, arcname="a1")
    with pytest.raises(ArtifactError, match=r"inside a folder a1/; pack its contents \(tar -C a1 -cf a1.tar \.\)"):
        extract_archive(tmp_path / "a1.tar", tmp_path / "x")
    with pytest.raises(ArtifactError, match="no such file or directory"):
        verify_artifact(tmp_path / "typo")


def test_a_killed_process_s_unpacked_archive_is_removed_by_the_next(tmp_path, monkeypatch):
    """`serve ARCHIVE` killed with SIGKILL leaves its unpacked copy (the artifact's size) in the temp dir."""
    import tempfile

    from qkiln.compile.artifact_archive import unpacked
    from qkiln.compile.artifact_writer import HOST_TAG

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    dead = temp / f"qkiln-unpacked-{HOST_TAG}-999999999-abc"
    alive = temp / f"qkiln-unpacked-{HOST_TAG}-{os.getpid()}-def"
    elsewhere = temp / "qkiln-unpacked-0badc0de-999999999-ghi"
    for d in (dead, alive, elsewhere):
        (d / "a").mkdir(parents=True)
    archive = write_archive(build(tmp_path / "a"), tmp_path / "a.tar")
    with unpacked(str(archive)) as path:
        verify_artifact(path)
        assert sorted(p.name for p in temp.iterdir()) == sorted([alive.name, elsewhere.name, Path(path).parent.name])
    assert sorted(p.name for p in temp.iterdir()) == sorted([alive.name, elsewhere.name])


def test_an_error_inside_an_unpacked_archive_names_the_archive(tmp_path):
    """A remedy such as `qkiln export FOLDER` had named the temporary folder the archive was
    unpacked into, which is gone when the command ends."""
    from qkiln.compile.artifact_archive import unpacked
    from qkiln.compile.onnx_contract import rewrite_hint

    archive = write_archive(build(tmp_path / "a"), tmp_path / "a.tar")
    with pytest.raises(ArtifactError) as e, unpacked(str(archive)) as path:
        raise ArtifactError(f"{path}/engines/onnx is from an older qkiln; {rewrite_hint(Path(path) / 'engines' / 'onnx')}")
    assert str(e.value) == (f"{archive}/engines/onnx is from an older qkiln; rebuild the artifact (qkiln build ... "
                            f"--engine onnx --force), or export an engine beside it (qkiln export {archive} --format "
                            "onnx -o DIR)")


_UNPACK_WITH_SMALL_FILES = textwrap.dedent("""
    import resource, signal, sys
    from qkiln.compile.artifact_archive import extract_archive
    from qkiln.errors import ArtifactError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # as a full disk: no file may hold more
    try:
        extract_archive(sys.argv[1], sys.argv[2])
    except ArtifactError as e:
        print(e)
""")


def test_unpacking_onto_a_full_disk_says_to_free_space_not_to_re_fetch(tmp_path):
    """A full temp disk while unpacking (serve / eval / verify ARCHIVE unpack into TMPDIR, often a
    small tmpfs) was reported as 'cannot read archive; re-fetch it': a good multi-GB download again."""
    archive = write_archive(build(tmp_path / "a"), tmp_path / "a.tar")
    run = subprocess.run([sys.executable, "-c", _UNPACK_WITH_SMALL_FILES, str(archive), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"cannot unpack it into {tmp_path}" in run.stdout and "free space there" in run.stdout, run.stdout
    assert "re-fetch" not in run.stdout and not (tmp_path / "x").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".x.")] == []  # nothing left behind


def test_an_export_that_cannot_read_its_input_does_not_blame_the_output(tmp_path):
    from qkiln.compile.artifact_writer import writing

    with pytest.raises(ArtifactError, match=r"missing.bin: cannot be read \(No such file or directory\); "
                                            r"nothing was written to .*out$"):
        with writing(tmp_path / "out"):
            (tmp_path / "missing.bin").read_bytes()
    # free space is the remedy only where the error is a full disk or quota (probe s48: a lost
    # rename race and a read-only folder were worded as full disks too)
    with pytest.raises(ArtifactError, match=r"out: writing failed \(No such file or directory\); nothing was "
                                            "written there: choose another output path$"):
        with writing(tmp_path / "out"):
            (tmp_path / ".out.partial-1" / "f").write_bytes(b"")
    with pytest.raises(ArtifactError, match=r"out: writing failed \(Disk quota exceeded\); nothing was "
                                            "written there: free space or choose another output path$"):
        with writing(tmp_path / "out"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(tmp_path / ".out.partial-1" / "f"))


def test_the_digest_is_checked_on_the_manifest_s_bytes_without_python(tmp_path):
    """README's recipe for a registry in another language (whose JSON writer formats floats
    otherwise): the file less its digest line, less its final newline, hashes to the digest."""
    out = build(tmp_path / "a")
    text = (out / "manifest.json").read_bytes()
    run = subprocess.run(f"grep -v '^  \"digest\": ' {out / 'manifest.json'} | head -c -1 | sha256sum",
                         shell=True, capture_output=True, text=True, check=True)
    assert run.stdout.split()[0] == json.loads(text)["digest"] == read_manifest(out).digest


def test_another_user_s_leftover_partial_does_not_fail_my_build(other_user):
    """A SIGKILLed build of one user leaves its partial in a shared folder; every other user's
    build there then failed with a traceback (PermissionError), after its whole calibration."""
    import subprocess
    import sys

    from qkiln.compile.artifact_writer import HOST_TAG

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    leftover = other_user.folder / f".theirs.partial-{HOST_TAG}-{gone}-x1"
    (leftover / "weights").mkdir(parents=True)
    (leftover / "weights" / "model-00001-of-00001.safetensors").write_bytes(b"half")
    mine = ("from pathlib import Path; from qkiln.compile.artifact_writer import fresh_partial_dir\n"
            "print(fresh_partial_dir(Path(sys.argv[1])).is_dir())")
    out = other_user.python(mine, other_user.folder / "mine")
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    assert leftover.is_dir()  # theirs to clean: a build of their own removes it
    build(other_user.folder / "rebuilt")  # and the owner's next build does
    assert not leftover.exists()


def test_an_artifact_written_under_a_private_umask_is_readable_by_other_users(other_user):
    """Only the weight shards were made 0644: under umask 077 the manifest, tokenizer and reports
    were owner-only and another user's verify ended in a traceback. What it cannot read is an
    ArtifactError naming the file, not a traceback, and not a file said to be missing."""
    old_umask = os.umask(0o077)
    try:
        out = build(other_user.folder / "a", engines={"onnx/model.onnx": b"onnx-bytes"})
    finally:
        os.umask(old_umask)
    assert all(p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644) for p in [out, *out.rglob("*")])
    verify = ("from qkiln.compile.artifact import verify_artifact; from qkiln.errors import ArtifactError\n"
              "try: print(len(verify_artifact(sys.argv[1])))\n"
              "except ArtifactError as e: print('ArtifactError', e)")
    ok = other_user.python(verify, out)
    assert ok.returncode == 0 and ok.stdout.strip() == str(len(read_manifest(out).files)), ok.stderr
    for private in (out / "tokenizer" / "tokenizer.json", out / "reports", out / "manifest.json"):
        private.chmod(0o700 if private.is_dir() else 0o600)
        said = other_user.python(verify, out)
        private.chmod(0o755 if private.is_dir() else 0o644)
        assert said.returncode == 0 and said.stdout.startswith("ArtifactError"), said.stderr
        assert f"{private}: cannot be read (Permission denied)" in said.stdout and "chmod -R a+rX" in said.stdout
