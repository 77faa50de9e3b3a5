"""Writing a qkiln artifact: atomically and reproducibly.

Owns `write_artifact` and the staging every output shares (partial folders, --force checks,
fsync-then-rename). The format itself (schema, verify, read) is `artifact.py`; one-file archives
for registries are `artifact_archive.py`; this module only produces what artifact.py accepts.

Invariants:
- Atomic: everything goes into a sibling `.{name}.partial-{host}-{pid}-{random}` directory,
  manifest.json last, fsynced, then renamed to its name. A build killed at any point leaves only a
  partial dir that `verify_artifact` refuses; the next write to the same name deletes partials of
  dead processes on this host. While a build checks its engine (which loads the finished folder),
  an UNCHECKED file sits beside the manifest: a copy or rename of a partial killed then never
  verifies either. The host-and-PID-namespace hash and the random part keep builds in other PID
  namespaces (containers sharing a volume, even with one hostname) or on other hosts (NFS) from
  taking or deleting each other's partials: a pid alone collided (each container's build is pid
  1). The price: a killed container's partial is left for a person to delete.
- `--force` replaces only what qkiln wrote: an earlier output whose own record (the manifest's file
  list) covers every file in the folder; a file added beside it is never deleted.
- Reproducible: same inputs give byte-identical files. Tensors are sorted by name, made
  contiguous and written with fixed safetensors metadata; JSON has sorted keys.
- Never pickle: weights are safetensors, reports JSON or bytes given by the caller.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path, PurePosixPath

from qkiln.errors import ArtifactError

from .artifact import (MANIFEST_NAME, UNCHECKED_MARKER, UNFINISHED_SUFFIX, WEIGHTS_DIR, Manifest, list_artifact_files,
                       sha256_file)

GiB = 1 << 30
# one key only: safetensors keeps metadata in a hash map, so more keys could be written in any order
_SAFETENSORS_METADATA = {"format": "pt"}


def write_artifact(out_dir, manifest: Manifest, tensors: dict, tokenizer_files: dict[str, bytes],
                   reports: dict[str, bytes | dict], engines: dict[str, bytes] | None = None,
                   shard_bytes: int = 2 * GiB, overwrite: bool = False, check=None) -> Path:
    """Write a complete artifact at `out_dir` or nothing there; `manifest.files` is filled in here.

    `engines` maps paths relative to engines/ ("onnx/model.onnx") to bytes. `check(path)` runs on
    the complete artifact before it takes `out_dir`'s name; what it raises aborts the write.
    Returns the path.
    """
    out = output_path(out_dir)
    check_destination(out, overwrite)
    replace(manifest, files={}).to_json()  # schema errors before any work
    blobs = _collect_blobs(tokenizer_files, reports, engines or {})
    tmp = fresh_partial_dir(out)
    try:
        with writing(out):
            write_weights(tmp / WEIGHTS_DIR, tensors, shard_bytes)
            for rel, data in sorted(blobs.items()):
                _write_file(tmp / rel, data)
            files = {rel: {"sha256": sha256_file(tmp / rel), "size": (tmp / rel).stat().st_size}
                     for rel in sorted(list_artifact_files(tmp))}  # hashed from disk: what verify will see
            if check is not None:
                mark_unchecked(tmp)
            _write_file(tmp / MANIFEST_NAME, replace(manifest, files=files).to_json().encode())
            make_shareable(tmp)
            fsync_dirs(tmp)
        if check is not None:
            check(tmp)
        with writing(out):
            if check is not None:
                mark_checked(tmp)
            move_into_place(tmp, out, lambda: check_destination(out, overwrite))
    except BaseException as e:  # a Python-level failure cleans up; a kill leaves it
        _discard_partial(tmp, out, e)
        raise
    return out


def _discard_partial(tmp: Path, out: Path, error: BaseException) -> None:
    """Remove a failed write's staging folder. A failure caused by another process deleting it
    first (a missing tokenizer, a write error) is raised as that, not as a fault in the source or
    the disk."""
    vanished = not tmp.is_dir()
    shutil.rmtree(tmp, ignore_errors=True)
    if vanished and isinstance(error, Exception):
        raise ArtifactError(f"{out}: its staging folder {tmp.name} was deleted while it was being written (by "
                            "another process cleaning that folder?); nothing was written there: rerun") from error


def is_full_disk(e: BaseException) -> bool:
    """A full disk, a quota or a file size limit: what free space (or a smaller output) fixes. A
    SafetensorError carries no errno, only the Rust io error's text."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
        word in str(e) for word in ("No space left", "StorageFull", "Disk quota", "QuotaExceeded", "FileTooLarge",
                                    "File too large"))


@contextmanager
def writing(out: Path):
    """An OSError while writing `out` (a full disk, a quota, a vanished mount) as an ArtifactError
    naming the output; safetensors reports its own write errors as SafetensorError. One that names
    a file elsewhere was reading an input (an export reads its artifact), which free space won't fix."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        read = getattr(e, "filename", None)
        if read is not None and not _is_under_output(Path(os.fsdecode(read)), out):
            raise ArtifactError(f"{read}: cannot be read ({reason}); nothing was written to {out}") from None
        remedy = "free space or choose another output path" if is_full_disk(e) else "choose another output path"
        raise ArtifactError(f"{out}: writing failed ({reason}); nothing was written there: {remedy}") from None


def _is_under_output(path: Path, out: Path) -> bool:
    """Whether `path` is in `out` or one of its partial / trash siblings."""
    out = out.absolute()
    try:
        top = path.absolute().relative_to(out.parent).parts[0]
    except (ValueError, IndexError):
        return False
    return top == out.name or top.startswith(f".{out.name}.")


def check_destination(out: Path, overwrite: bool) -> None:
    """Raise ArtifactError unless `out` may be written (absent, or a qkiln artifact and `overwrite`).
    build() calls it before any work too, so a taken path fails in a second, not after calibration."""
    check_replaceable(out, overwrite, "a qkiln artifact", _artifact_files)


def check_replaceable(out: Path, overwrite: bool, kind: str, files_written) -> None:
    """Raise ArtifactError unless `out` may be written: absent, or with `overwrite` an empty
    directory or an earlier output of this kind holding nothing else. `files_written(out)` is the
    set of files (posix relpaths) such an output records writing, or None when `out` is not one.
    --force replaces what qkiln wrote: never a folder that merely has a file of the same name (a
    web project's manifest.json, a Hugging Face checkpoint's config.json), nor an output a user
    added files to (deploy notes, a .git). The parent must be writable: found out now, not after
    minutes of calibration."""
    _check_not_working_directory(out)
    inside = next((p for p in out.parents if _has_qkiln_manifest(p)), None)
    if inside is not None:  # its verify would then fail on files the manifest does not list
        raise ArtifactError(f"{out}: is inside the artifact {inside}; choose an output path outside it")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise ArtifactError(f"{out}: exists and is not a directory; choose another output path")
        if not overwrite:
            raise ArtifactError(f"{out}: already exists; pass --force to replace {kind}")
        present = _files_under(out)
        if present:
            written = files_written(out)
            if written is None and _artifact_files(out) is not None:  # another kind of output: export -o ARTIFACT
                raise ArtifactError(f"{out}: is a qkiln artifact, not {kind}; refusing to replace it: choose "
                                    "another output path")
            if written is None and (out / WEIGHTS_DIR).is_dir():  # an artifact's layout, its record unreadable
                raise ArtifactError(f"{out}: looks like a damaged qkiln artifact (no readable manifest lists its "
                                    "files), so what qkiln wrote there cannot be told apart; delete it by hand or "
                                    "choose another output path")
            if written is None:
                raise ArtifactError(f"{out}: exists and is not {kind}, refusing to replace it; choose another "
                                    "output path")
            extra = sorted(present - written)
            if extra:
                raise ArtifactError(f"{out}: holds files qkiln did not write ({', '.join(extra[:3])}"
                                    f"{', ...' if len(extra) > 3 else ''}); --force replaces only what qkiln "
                                    "wrote: move them out or choose another output path")
    check_writable_dir(out.parent)


def _check_not_working_directory(out: Path) -> None:
    """`-o .` (or `-o ""`, which is the same path) names no new folder: the output would be named
    after nothing, and --force would delete the folder a shell stands in. Refused before any work."""
    try:
        here = Path.cwd()
    except OSError:  # the shell's folder was deleted: no output can be it
        return
    target = output_path(out)
    if target == here or target in here.parents:
        where = "the current directory" if target == here else "a folder holding the current directory"
        raise ArtifactError(f"output path {str(out)!r} is {where}; give the path of a new directory "
                            "(e.g. -o ./my-artifact)")


def _files_under(root: Path) -> set[str]:
    """Every file (and link) below `root` as a posix relpath; directories alone do not count."""
    return {(Path(d) / n).relative_to(root).as_posix() for d, dirs, files in os.walk(root)
            for n in files + [x for x in dirs if (Path(d) / x).is_symlink()]}


def output_path(path) -> Path:
    """An output path made absolute and without `..`: `-o b/x/..` means b (the OS would need b/x to
    exist, and the folder would be named "..")."""
    return Path(os.path.abspath(path))


def check_writable_dir(directory: Path) -> None:
    """Create `directory` if needed and prove a file can be made in it, or raise ArtifactError."""
    existing = next((d for d in (directory, *directory.parents) if d.exists()), None)
    if existing is not None and not existing.is_dir():  # mkdir says only "File exists"
        where = "not a folder" if existing == directory else f"so the folder {directory} cannot be made"
        raise ArtifactError(f"{existing} is a file, {where}; choose another output path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".qkiln-write-test-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ArtifactError(f"{directory}: cannot write there ({e.strerror or e}); "
                            "choose another output path") from None


def check_output_file(path: Path, option: str) -> None:
    """Before minutes of work (an evaluation, a benchmark): a report file can be written at `path`."""
    if path.is_dir():
        raise ArtifactError(f"{option} {path} is a directory: the output path is taken; give a file name")
    check_writable_dir(path.absolute().parent)


def _has_qkiln_manifest(path: Path) -> bool:
    """A manifest.json of qkiln's (with a format_version), not any file of that name (a web project's):
    stricter than artifact.is_artifact_dir, as refusing to write inside a folder must not misfire."""
    return read_json_field(path / MANIFEST_NAME, "format_version") is not None


def _artifact_files(path: Path) -> set[str] | None:
    """The files an artifact's manifest lists (and the manifest), or None when it has no readable one."""
    manifest = read_json_object(path / MANIFEST_NAME)
    files = manifest.get("files")
    if manifest.get("format_version") is None or not isinstance(files, dict):
        return None
    return set(files) | {MANIFEST_NAME, UNCHECKED_MARKER}  # the marker: qkiln's own, left by a killed check


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`, or {} when the file is absent, not JSON or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_json_field(path: Path, key: str):
    """`key` of the JSON object in `path`, or None when the file is absent, not JSON or lacks it."""
    return read_json_object(path).get(key)


def _pid_namespace() -> str:
    try:  # two containers may share a hostname (docker --network host) but never a PID namespace
        st = os.stat("/proc/self/ns/pid")
        return f"{st.st_dev}:{st.st_ino}"
    except OSError:  # not Linux
        return ""


# this host and PID namespace, in the names of partial outputs: a pid says whether a writer is
# alive only there (another namespace's live build had looked dead, and its partial was deleted)
HOST_TAG = hashlib.sha256(f"{socket.gethostname()}|{_pid_namespace()}".encode()).hexdigest()[:8]


def unfinished_prefix(out: Path, kind: str) -> str:
    return f".{out.name}.{kind}-{HOST_TAG}-{os.getpid()}-"


def fresh_partial_dir(out: Path) -> Path:
    """A new empty `.NAME.partial-HOST-PID-RANDOM` sibling of `out` to build in, after clearing dead
    builds' leftovers."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=unfinished_prefix(out, "partial"), dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; an artifact is meant to be shared
    return tmp


def mark_unchecked(folder: Path) -> None:
    """Put UNCHECKED_MARKER in `folder` before its last file is written: verify refuses the folder
    until mark_checked, so a writer killed while checking leaves nothing that passes for finished."""
    _write_file(folder / UNCHECKED_MARKER, b"qkiln was checking what it wrote here when it stopped; "
                b"this folder is unfinished: rerun the command that wrote it (with --force)\n")


def mark_checked(folder: Path) -> None:
    (folder / UNCHECKED_MARKER).unlink()
    _fsync_dir(folder)


@contextmanager
def staged_directory(out: Path, recheck):
    """Yield an empty partial sibling of `out` to write into. When the block ends without error it
    takes `out`'s name, after `recheck()` (which raises) has agreed again to replace what is there
    now (something may have appeared while writing); when the block raises, it is removed. Exports
    use it; artifacts go through write_artifact."""
    tmp = fresh_partial_dir(out)
    try:
        with writing(out):
            yield tmp
            make_shareable(tmp)
            move_into_place(tmp, out, recheck)
    except BaseException as e:
        _discard_partial(tmp, out, e)
        raise


def make_shareable(folder: Path) -> None:
    """Files 0644 and folders 0755 under `folder`, whatever the umask or the writer (safetensors
    creates 0600): an artifact or an export is meant to be read by other users, a server running
    as another one or a team's registry (under umask 077 another user's verify had ended in a
    traceback). Who may reach it is the parent folder's say."""
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the `.NAME.partial-*` / `.NAME.trash-*` entries beside `out` (directories, or an
    archive's files), whatever their NAME, written on this host by a process that is gone (the
    untagged names earlier versions wrote count as this host's). Any name: a SIGKILLed build of
    another name left one the size of an artifact, which only a build of that name removed.
    What resists is left (another user's, in a shared folder: a traceback had failed every other
    user's build there, after its calibration)."""
    return remove_left_by_gone_processes(out.parent.iterdir(), rf"\..+\.{UNFINISHED_SUFFIX}")


def remove_left_by_gone_processes(paths, pattern: str) -> list[Path]:
    """Delete the `paths` (directories, or files) whose names match `pattern` (groups `pid` and an
    optional `host` tag) that a process of this host wrote and that is gone: a pid says whether a
    writer lives only on its own host, so another host's are never touched (an untagged name counts
    as this host's). Best effort: in a shared folder another user's may resist, and stays."""
    regex, removed = re.compile(pattern), []
    for p in sorted(paths):
        m = regex.fullmatch(p.name)
        if m and not p.is_symlink() and m["host"] in (None, HOST_TAG) and not pid_alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
            if not os.path.lexists(p):
                removed.append(p)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _collect_blobs(tokenizer_files, reports, engines) -> dict[str, bytes]:
    """relpath -> bytes for everything but weights; reports given as dicts become sorted JSON."""
    blobs = {}
    for folder, items in (("tokenizer", tokenizer_files), ("reports", reports), ("engines", engines)):
        for name, data in items.items():
            rel = _safe_relpath(folder, name)
            if isinstance(data, dict) and folder == "reports":
                data = (json.dumps(data, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()
            if not isinstance(data, (bytes, bytearray)):
                raise ArtifactError(f"{rel}: expected bytes{' or a dict' if folder == 'reports' else ''}, "
                                    f"got {type(data).__name__}")
            blobs[rel] = bytes(data)
    return blobs


def _safe_relpath(folder: str, name: str) -> str:
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name.startswith("/") or "\\" in name or any(p in (".", "..") for p in parts):
        raise ArtifactError(f"{folder}/{name}: not a plain relative file name; use names like 'tokenizer.json'")
    return f"{folder}/{'/'.join(parts)}"


def plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Greedy over sorted names: a shard closes before it would pass `shard_bytes` (a larger
    tensor gets a shard of its own). Sorted order makes the plan a function of the inputs."""
    shards, current, current_bytes = [], [], 0
    for name in sorted(sizes):
        if current and current_bytes + sizes[name] > shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += sizes[name]
    return shards + ([current] if current else [])


def write_weights(weights_dir: Path, tensors: dict, shard_bytes: int) -> list[Path]:
    """weights/model-0000i-of-0000N.safetensors; N is known before the first shard is written."""
    import torch  # lazy like the rest: only a build writes weights

    for name, t in tensors.items():
        if not isinstance(name, str) or not name or not isinstance(t, torch.Tensor):
            raise ArtifactError(f"tensor {name!r}: expected a non-empty name and a torch.Tensor")
        if t.layout != torch.strided or t.is_meta:
            raise ArtifactError(f"tensor {name!r}: only dense tensors with data can be stored")
    plan = plan_shards({n: t.numel() * t.element_size() for n, t in tensors.items()}, shard_bytes)
    weights_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, names in enumerate(plan, 1):
        path = weights_dir / f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        write_shard(path, {n: tensors[n] for n in names})
        paths.append(path)
    return paths


def write_shard(path: Path, tensors: dict) -> None:
    """One safetensors file: CPU, contiguous, no shared storage (safetensors refuses aliases)."""
    from safetensors.torch import save_file

    prepared, seen = {}, set()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.nbytes() != t.nbytes or storage.data_ptr() in seen:  # a view or a tied tensor
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        prepared[name] = t
    save_file(prepared, str(path), metadata=dict(_SAFETENSORS_METADATA))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(root: Path) -> None:
    """Directory entries are durable only once their directory is fsynced (files were already)."""
    for dirpath, _, _ in os.walk(root, topdown=False):
        _fsync_dir(Path(dirpath))


def move_into_place(tmp: Path, out: Path, recheck) -> None:
    """rename(2) is atomic; replacing takes two renames (old away, new in), then the old is deleted.
    A kill between the two leaves no artifact under the name and the rerun cleans both siblings; a
    failed second rename puts the old one back, unless another writer's output took the name.
    `recheck()` raises unless what is at `out` now may be replaced (it may have appeared, or been
    added to, while we were building)."""
    if out.exists() or out.is_symlink():
        recheck()
        trash = Path(tempfile.mkdtemp(prefix=unfinished_prefix(out, "trash"), dir=out.parent))
        os.rename(out, trash / "old")
        try:
            os.rename(tmp, out)
        except OSError as e:
            if not (out.exists() or out.is_symlink()):  # not a race: the old one goes back
                with contextlib.suppress(OSError):
                    os.rename(trash / "old", out)
                    os.rmdir(trash)
                raise
            # another writer's rename came between ours: its output stays, ours is discarded, and
            # the old one, which both were replacing, goes
            shutil.rmtree(trash, ignore_errors=True)
            raise ArtifactError(f"{out}: another process wrote there while this one was replacing it ({e.strerror}); "
                                "its output stays and this one's was discarded: run one writer per output path "
                                "at a time") from None
        _fsync_dir(out.parent)
        shutil.rmtree(trash, ignore_errors=True)  # what stays is a dead writer's: the next one removes it
    else:
        os.rename(tmp, out)
        _fsync_dir(out.parent)


# ---------------------------------------------------------------------------------------------
# Archive: the same content as one file. Entries are relative to the artifact root.


def source_date_epoch() -> int | None:
    """$SOURCE_DATE_EPOCH (reproducible builds' fixed time: an artifact's `created`, an archive's
    mtimes), or None when unset."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        return None
    if not epoch.isdigit():
        raise ArtifactError(f"SOURCE_DATE_EPOCH={epoch!r} is not a whole number of seconds; fix or unset it")
    return int(epoch)
