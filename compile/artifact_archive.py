"""A qkiln artifact as one .tar / .tar.gz file, for registries that store files, not folders.

Owns `write_archive`, `check_archive_path`, `extract_archive` and `unpacked` (an archive given where
an artifact is read: the command line and `LLM`). Packing verifies the folder first; unpacking is as
atomic as `write_artifact` (a partial folder, verified, then renamed).

Invariants:
- Reproducible: manifest.json first (a registry reads it without scanning), the rest sorted, a
  fixed mtime (SOURCE_DATE_EPOCH, else 0), uid/gid 0, mode 0644 and a gzip header without a name
  or time: the same artifact gives byte-identical archives.
- Only regular files with plain relative names unpack: absolute paths, '..', links, devices and
  duplicate entries are refused as corrupt or malicious.
- A failure names the archive and what to do (re-fetch it, free space), never the temp folder.
"""

import gzip
import os
import shutil
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from qkiln.errors import ArtifactError, QkilnError

from .artifact import ARCHIVE_SUFFIXES, MANIFEST_NAME, read_manifest, verify_artifact, verify_contents
from .artifact_writer import (HOST_TAG, check_destination, check_writable_dir, fresh_partial_dir, fsync_dirs,
                              is_full_disk, move_into_place, output_path, remove_left_by_gone_processes,
                              remove_stale_partials, source_date_epoch, unfinished_prefix)


def _archive_mode(path: Path) -> str:
    for suffix, mode in ARCHIVE_SUFFIXES.items():
        if path.name.endswith(suffix):
            return mode
    raise ArtifactError(f"{path}: archive name must end in {', '.join(sorted(ARCHIVE_SUFFIXES))}")


def check_archive_path(path, overwrite: bool = False) -> None:
    """Raise ArtifactError now for an archive path write_archive would refuse (after a whole build),
    or one that holds a file `overwrite` does not allow replacing."""
    path = output_path(path)
    _archive_mode(path)
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory; give the archive a file name")
    if path.exists() and not overwrite:
        raise ArtifactError(f"{path}: already exists; pass --force to replace it")
    check_writable_dir(path.parent)


def write_archive(artifact_dir, archive_path, mtime: int | None = None) -> Path:
    """Verify, then pack manifest.json first (a registry can read it without scanning) and the
    rest sorted, with fixed metadata. `mtime` defaults to $SOURCE_DATE_EPOCH, else 0."""
    root, archive = Path(artifact_dir), output_path(archive_path)
    mode = _archive_mode(archive)
    rels = verify_artifact(root, check_target=False)
    if mtime is None:
        mtime = source_date_epoch() or 0
    archive.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(archive)  # what killed writes of this archive left
    fd, name = tempfile.mkstemp(prefix=unfinished_prefix(archive, "partial"), dir=archive.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with open(tmp, "wb") as raw:
            # gzip header: no file name, fixed mtime, fixed level -> same bytes for the same tar
            stream = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=mtime, compresslevel=6) \
                if mode == "gz" else raw
            with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for rel in [MANIFEST_NAME, *rels]:
                    info = tarfile.TarInfo(rel)
                    info.size, info.mtime, info.mode = (root / rel).stat().st_size, mtime, 0o644
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    with open(root / rel, "rb") as f:
                        tar.addfile(info, f)
            if mode == "gz":
                stream.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, archive)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"{archive}: writing the archive failed ({e.strerror or e}); free space or choose "
                            "another path") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return archive


def extract_archive(archive_path, dest, overwrite: bool = False, check_target: bool = False) -> Path:
    """Unpack into `dest` (atomically, like write_artifact) and verify. Only regular files with
    plain relative names are accepted: absolute paths, '..', links and devices are refused."""
    archive, out = Path(archive_path), output_path(dest)
    _archive_mode(archive)
    if not archive.is_file():
        raise ArtifactError(f"{archive}: archive not found")
    check_destination(out, overwrite)
    tmp = fresh_partial_dir(out)
    try:
        _extract_members(archive, tmp)
        if not (tmp / MANIFEST_NAME).is_file():
            top = list(tmp.iterdir())
            if len(top) == 1 and (top[0] / MANIFEST_NAME).is_file():  # `tar -cf x.tar a1` packs the folder too
                raise ArtifactError(f"{archive}: the artifact is inside a folder {top[0].name}/; pack its contents "
                                    f"(tar -C {top[0].name} -cf {archive.name} .) or use `qkiln build --archive`")
            raise ArtifactError(f"{archive}: no {MANIFEST_NAME} at its top level: not a qkiln artifact archive "
                                "(`qkiln build --archive` writes one)")
        try:
            verify_contents(tmp, check_target=check_target)
        except ArtifactError as e:  # name the entry inside the archive, not our temp dir; the same type
            raise type(e)(f"{archive}: {str(e).replace(str(tmp) + '/', '').replace(str(tmp), 'its contents')}") \
                from None
        fsync_dirs(tmp)
        move_into_place(tmp, out, lambda: check_destination(out, overwrite))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class _UnpackWriteError(Exception):
    """Writing an archive's member failed (a full temp disk): the archive itself may be sound."""


# Bounds on what an archive may unpack to, checked before each entry is written (a bomb filled the
# temp disk, or made 100k files, before verify looked: probe s48). Once manifest.json is unpacked
# (write_archive puts it first) every later entry must be a file it lists, of the size it lists;
# before it, at most this many entries, and a .tar.gz at most this many times its own size (quantized
# weights compress ~1.0-1.3x; a gzip of zeros ~1000x), plus 16 MiB for a small one's manifest and
# tokenizer. A plain tar holds its bytes (sparse entries, which could claim any size, are refused).
_MAX_ENTRIES_BEFORE_MANIFEST = 10_000
_MAX_GZIP_EXPANSION = 32
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_EXTENDED_HEADER = 1 << 20  # a pax header or GNU long name: a path and a few fields


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads an extended header (pax, GNU long name) whole into memory before it yields the
    entry it describes: a 2 GiB pax header took 2.35 GB (probe s48). Refused past 1 MiB, unread."""

    def _proc_pax(self, tar):
        _check_extended_header(self)
        return super()._proc_pax(tar)

    def _proc_gnulong(self, tar):
        _check_extended_header(self)
        return super()._proc_gnulong(tar)


def _check_extended_header(info: tarfile.TarInfo) -> None:
    if info.size > _MAX_EXTENDED_HEADER:  # tarfile.next() says it as a ReadError: "cannot read archive"
        raise tarfile.SubsequentHeaderError(f"an extended header of {info.size} bytes, past the "
                                            f"{_MAX_EXTENDED_HEADER} an artifact's entries need")


def _extract_members(archive: Path, into: Path) -> None:
    budget = archive.stat().st_size * _MAX_GZIP_EXPANSION + (16 << 20)  # plain tar: never reached
    try:
        with _decompressed(archive) as stream, \
                tarfile.open(fileobj=stream, mode="r:", tarinfo=_BoundedTarInfo) as tar:
            seen, listed = set(), None  # listed: the manifest's files, once it is unpacked
            for m in tar:
                parts = PurePosixPath(m.name).parts
                bad_name = (not parts or m.name.startswith("/") or "\\" in m.name
                            or any(p in ("", ".", "..") for p in parts))
                if m.isdir() and (m.name in (".", "./") or not bad_name):
                    continue  # archives made with `tar -C DIR .` list directories; files create their own
                rel = "/".join(parts)
                if bad_name or not m.isfile() or m.issparse() or rel in seen:
                    raise ArtifactError(f"{archive}: refusing entry {m.name!r} (only regular files with plain "
                                        "relative paths, each once); the archive is corrupt or malicious")
                _check_entry_bounds(archive, m, rel, listed, len(seen), budget)
                budget -= m.size
                seen.add(rel)
                target = into.joinpath(*parts)
                with tar.extractfile(m) as src, _created(target) as dst:
                    while chunk := src.read(1 << 20):
                        _write_all(dst, chunk)
                if rel == MANIFEST_NAME:
                    try:
                        listed = read_manifest(into).files
                    except ArtifactError as e:  # named as in the archive, not in our temp folder
                        raise ArtifactError(f"{archive}: {str(e).replace(str(into) + '/', '')}") from None
            _check_nothing_after_the_end(archive, tar, stream)
    except _UnpackWriteError as e:
        reason = e.args[0].strerror or e.args[0]
        remedy = "free space there, or unpack it elsewhere (TMPDIR, for a command given the archive)" \
            if is_full_disk(e.args[0]) else "the archive is corrupt or malicious (an entry where another's folder " \
            "goes?), or unpack it elsewhere (TMPDIR)"
        raise ArtifactError(f"{archive}: cannot unpack it into {into.parent} ({reason}); {remedy}") from None
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as e:
        raise ArtifactError(f"{archive}: cannot read archive ({e}); re-fetch it") from None


def _check_entry_bounds(archive: Path, m: tarfile.TarInfo, rel: str, listed: dict | None, entries: int,
                        budget: int) -> None:
    """Refuse entry `m` before it is written: unlisted or resized once the manifest is known, past
    the entry count before it, or more bytes than the archive's `budget` has left."""
    refuse = f"{archive}: refusing entry {m.name!r}"
    if listed is not None and (rel not in listed or listed[rel].get("size") != m.size):
        raise ArtifactError(f"{refuse}: {'its size differs from' if rel in listed else 'not in'} the archive's "
                            "manifest; the archive is corrupt or malicious")
    if listed is None and entries >= _MAX_ENTRIES_BEFORE_MANIFEST:
        raise ArtifactError(f"{refuse}: more than {_MAX_ENTRIES_BEFORE_MANIFEST} entries before manifest.json; the "
                            "archive is corrupt or malicious")
    if rel == MANIFEST_NAME and m.size > _MAX_MANIFEST_BYTES or m.size > budget:
        raise ArtifactError(f"{refuse}: it unpacks to {m.size} bytes, more than an artifact archive of this size "
                            "holds (a decompression bomb?); the archive is corrupt or malicious")


class _Stream:
    """The tar bytes (a .tar.gz decompressed), remembering where the last read began and what it
    returned: tar stops at the block that ends the archive, and a gzip stream cannot seek back to
    it without decompressing everything again."""

    def __init__(self, raw):
        self.raw, self.last_read = raw, (0, b"")

    def read(self, size=-1) -> bytes:
        start = self.raw.tell()
        data = self.raw.read(size)
        self.last_read = start, data
        return data

    def seek(self, offset, whence=0):
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


@contextmanager
def _decompressed(archive: Path):
    with open(archive, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    with (gzip.open(archive, "rb") if gzipped else open(archive, "rb")) as raw:
        yield _Stream(raw)


def _check_nothing_after_the_end(archive: Path, tar: tarfile.TarFile, stream: _Stream) -> None:
    """tar stops at the first block that is not a member's header (its end-of-archive zeros) and
    never reads what follows: a second archive joined on (`cat a.tar b.tar`), or a damaged tail,
    passed unseen. Only zeros, the end blocks and record padding, may follow the last member (in a
    .tar.gz, gzip refuses a damaged tail itself)."""
    start, block = stream.last_read
    if start != tar.offset:  # tar stopped at the end of the file, reading nothing
        return
    while block:
        if block.count(0) != len(block):
            raise ArtifactError(f"{archive}: holds data after the end of its tar archive (a damaged tail, or "
                                "two files joined); re-fetch it")
        block = stream.read(1 << 20)


def _write_all(dst, chunk: bytes) -> None:
    view = memoryview(chunk)
    try:
        while view:
            view = view[dst.write(view):]
    except OSError as e:
        raise _UnpackWriteError(e) from None


def _created(target: Path):
    """Unbuffered, so that every write error surfaces in _write_all: a buffered file's close
    retried a failed write and raised again, as a read error."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return open(target, "xb", buffering=0)
    except OSError as e:
        raise _UnpackWriteError(e) from None


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.endswith(tuple(ARCHIVE_SUFFIXES))


@contextmanager
def unpacked(model: str, check_target: bool = False):
    """An artifact archive (.tar, .tar.gz, .tgz) unpacked and verified into a temporary directory
    that lives as long as the `with` block, named like the archive without its suffix (the served
    model name; check_target: also refuse one this machine cannot run); any other path or model
    name as it is."""
    path = Path(model).expanduser()
    if not is_archive(path):
        yield model
        return
    name = next(path.name[: -len(s)] for s in ARCHIVE_SUFFIXES if path.name.endswith(s)) or "artifact"
    remove_dead_unpacked()
    with tempfile.TemporaryDirectory(prefix=f"{_UNPACKED_PREFIX}{HOST_TAG}-{os.getpid()}-") as tmp:
        folder = str(Path(tmp) / name)
        try:
            yield str(extract_archive(path, Path(folder), check_target=check_target))
        except QkilnError as e:  # the folder is gone when the command ends: a remedy names the archive given
            e.args = tuple(a.replace(folder, model) if isinstance(a, str) else a for a in e.args)
            raise


_UNPACKED_PREFIX = "qkiln-unpacked-"


def remove_dead_unpacked() -> list[Path]:
    """Delete archives unpacked by processes of this host that are gone: a SIGKILLed `serve
    ARCHIVE` cannot clean up after itself, and each copy is the artifact's size."""
    unpacked = (p for p in Path(tempfile.gettempdir()).glob(f"{_UNPACKED_PREFIX}*") if p.is_dir())
    return remove_left_by_gone_processes(unpacked, rf"{_UNPACKED_PREFIX}(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-\w+")
