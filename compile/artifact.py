"""The qkiln artifact format: the manifest schema, reading and verification.

Owns `Manifest` (what manifest.json holds), `read_manifest`, `verify_artifact`,
`read_tensor_index` (tensor -> shard, dtype, shape from safetensors headers; no weights read),
`load_tensors` and `toolchain_versions`. Writing lives in `artifact_writer.py`, archives in
`artifact_archive.py`.

This is the leaf the runtime imports: only the stdlib and qkiln.errors at module level; torch
and safetensors are imported inside the functions that need them. Nothing is ever unpickled.

An artifact directory:
    manifest.json                               written last; hashes every other file
    weights/model-00001-of-0000N.safetensors    packed tensors, names sorted across shards
    tokenizer/   reports/   engines/<target>/   (engines optional)

Invariants: a directory is an artifact iff manifest.json parses, its MAJOR version is ours and
`files` lists every other file with its size and sha256 (no more, no less, no symlinks).
A newer MINOR only adds fields: they are kept in `Manifest.extra` and written back unchanged.
"""

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field, fields
from pathlib import Path

from qkiln.errors import ArtifactError, TargetUnavailableError

# 1.1: manifest.json carries `digest`, the sha256 of its own canonical JSON (1.0 manifests have none)
FORMAT_VERSION = "1.1"
_MAJOR, _MINOR = (int(p) for p in FORMAT_VERSION.split("."))
MANIFEST_NAME = "manifest.json"
# an artifact packed into one file (write_archive / extract_archive): its name's ending -> compression
ARCHIVE_SUFFIXES = {".tar.gz": "gz", ".tgz": "gz", ".tar": "tar"}
WEIGHTS_DIR = "weights"
# sibling dirs a writer uses while building or replacing; never an artifact
# what artifact_writer names a write in progress: .NAME.partial-HOST-PID-RANDOM (.NAME.partial-PID before)
UNFINISHED_SUFFIX = r"(partial|trash)-(?:(?P<host>[0-9a-f]{8})-)?(?P<pid>\d+)(?:-[A-Za-z0-9_]+)?"
UNFINISHED_RE = re.compile(rf"\..+\.{UNFINISHED_SUFFIX}")
# in a writer's folder while it checks what it wrote (the manifest is complete by then, as the check
# loads the folder): a build killed mid-check leaves it, so a copy or rename of that folder never verifies
UNCHECKED_MARKER = "UNCHECKED"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DEVICES = ("cpu", "cuda")


@dataclass
class Manifest:
    """manifest.json. Dicts are free-form JSON owned by the build (see DESIGN.md "The artifact")."""

    name: str
    architecture: dict  # the model config
    target: dict  # {"device": "cpu" | "cuda", "min_compute_capability": "8.9" | None}
    recipe: dict = field(default_factory=dict)  # as applied, with per-layer results/fallbacks/errors
    quantization: dict = field(default_factory=dict)  # per-linear layout the runtime builds from
    kv_cache: dict | None = None
    calibration: dict | None = None  # source, num_samples, seq_len, seed, num_source_tokens, text_sha256, token_sha256
    source: dict = field(default_factory=dict)  # path, kind, sha256
    toolchain: dict = field(default_factory=dict)  # see toolchain_versions()
    accuracy: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # relpath -> {"sha256", "size"}; not manifest.json
    num_parameters: int | None = None
    source_bytes_bf16: int | None = None
    created: int | None = None  # only a fixed epoch (SOURCE_DATE_EPOCH), never "now"
    format_version: str = FORMAT_VERSION
    digest: str | None = None  # set by to_json: manifest_digest() of everything else
    extra: dict = field(default_factory=dict)  # fields from a newer minor version, kept verbatim

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        clash = set(self.extra) & set(d)
        assert not clash, f"Manifest.extra shadows fields {clash}"
        return {**self.extra, **d}

    def to_json(self) -> str:
        """Deterministic text: sorted keys, indent 2, trailing newline. Validates first."""
        d = self.to_dict()
        d.pop("digest")  # recomputed below from what is written now
        is_newer = _is_newer_minor(d, "manifest")
        _validate(d, "manifest", allow_unknown=is_newer or bool(self.extra))
        try:
            d["digest"] = manifest_digest(d)
            return json.dumps(d, sort_keys=True, indent=2, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"manifest: not plain JSON ({e}); store numbers, strings, lists, dicts, "
                                "and NaN/inf as null") from None

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_NAME) -> "Manifest":
        try:
            d = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:  # also: NaN / Infinity, a 5000-digit number, deep nesting
            reason = "nested too deeply" if isinstance(e, RecursionError) else e
            raise ArtifactError(f"{where}: not valid JSON ({reason}); the artifact is corrupt, rebuild it") from None
        except _DuplicateKey as e:  # parsers disagree on which one counts: a registry may read the other
            raise ArtifactError(f"{where}: the key {e.args[0]!r} appears twice in one object, which qkiln never "
                                "writes: the manifest was edited; rebuild the artifact") from None
        if not isinstance(d, dict):
            raise ArtifactError(f"{where}: expected a JSON object; the artifact is corrupt, rebuild it")
        newer = _is_newer_minor(d, where)
        _validate(d, where, allow_unknown=newer)
        _check_digest(d, where)
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known},
                   extra={k: v for k, v in d.items() if k not in known})


class _DuplicateKey(Exception):
    pass


def _no_constant(name: str):
    """NaN / Infinity / -Infinity, which JSON does not have and qkiln never writes (it stores null)."""
    raise ValueError(f"{name} is not JSON")


def _no_duplicate_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _DuplicateKey(next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])))
    return d


# field -> (allowed types, required when reading)
_SCHEMA = {
    "format_version": ((str,), True), "name": ((str,), True), "architecture": ((dict,), True),
    "recipe": ((dict,), True), "quantization": ((dict,), True), "kv_cache": ((dict, type(None)), False),
    "calibration": ((dict, type(None)), True), "source": ((dict,), True), "toolchain": ((dict,), True),
    "target": ((dict,), True), "accuracy": ((dict,), True), "files": ((dict,), True),
    "num_parameters": ((int, type(None)), False), "source_bytes_bf16": ((int, type(None)), False),
    "created": ((int, type(None)), False), "digest": ((str,), False),
}


def is_artifact_dir(path) -> bool:
    """Whether `path` is an artifact folder (finished or damaged: read_manifest / verify_artifact
    say which), as opposed to a source model, an archive or an engine folder."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def manifest_digest(d: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, indent 2) without its `digest`. The
    files are hashed in `files`; this covers the rest (architecture, recipe, quantization, ...),
    so an edited manifest is refused rather than served with, say, another rms_norm_eps."""
    text = json.dumps({k: v for k, v in d.items() if k != "digest"}, sort_keys=True, indent=2, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


SERVED_FILES = ("weights/", "tokenizer/")


def serving_digest(manifest: "Manifest") -> str:
    """sha256 of what a runtime serves: the architecture, target, quantization and KV cache layout,
    and the sha256 of the weights and tokenizer files. The manifest's digest also covers names (the
    output's, the source folder's, the calibration file's, the recipe file's), provenance and the
    accuracy report, whose last digits follow the thread count: builds that differ only there
    serve the same model under one serving digest, which a registry can dedupe on. Engines are
    left out: they are made from these weights and name their artifact."""
    served = {"architecture": manifest.architecture, "target": manifest.target,
              "quantization": manifest.quantization, "kv_cache": manifest.kv_cache,
              "files": {rel: entry["sha256"] for rel, entry in manifest.files.items() if rel.startswith(SERVED_FILES)}}
    return hashlib.sha256(json.dumps(served, sort_keys=True, indent=2, allow_nan=False).encode()).hexdigest()


def _check_digest(d: dict, where: str) -> None:
    if "digest" not in d:
        if d["format_version"] != "1.0":  # 1.0 manifests were written before the digest
            raise ArtifactError(f"{where}: missing field 'digest'; the manifest was edited or is corrupt, "
                                "rebuild the artifact")
        return
    if d["digest"] != manifest_digest(d):
        raise ArtifactError(f"{where}: its contents do not match its digest: the manifest was edited after the "
                            "build; restore it from the artifact's archive or rebuild the artifact")


def _is_newer_minor(d: dict, where: str) -> bool:
    """Refuse another MAJOR (before reading anything else: its fields may mean other things)."""
    v = d.get("format_version")
    m = re.fullmatch(r"(\d+)\.(\d+)", v) if isinstance(v, str) else None
    if m is None:
        raise ArtifactError(f"{where}: format_version {v!r} is not MAJOR.MINOR; the artifact is corrupt, rebuild it")
    if int(m[1]) != _MAJOR:
        raise ArtifactError(f"{where}: unknown major format version {v} (this qkiln reads {_MAJOR}.x); "
                            "use a qkiln release that reads it, or rebuild the artifact")
    return int(m[2]) > _MINOR


def _validate(d: dict, where: str, allow_unknown: bool) -> None:
    for key, (types, required) in _SCHEMA.items():
        if key not in d:
            if required:
                raise ArtifactError(f"{where}: missing field '{key}'; the artifact is corrupt, rebuild it")
            continue
        v = d[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ArtifactError(f"{where}: field '{key}' must be {names}, got {type(v).__name__}")
    unknown = sorted(set(d) - set(_SCHEMA))
    if unknown and not allow_unknown:
        raise ArtifactError(f"{where}: unknown field(s) {unknown} in format {d['format_version']}; "
                            "the manifest was edited or is corrupt, rebuild the artifact")
    if not d["name"]:
        raise ArtifactError(f"{where}: field 'name' is empty")
    if d["target"].get("device") not in _DEVICES:
        raise ArtifactError(f"{where}: target.device must be one of {list(_DEVICES)}, "
                            f"got {d['target'].get('device')!r}")
    for rel, entry in d["files"].items():
        _check_file_entry(rel, entry, where)


def _check_file_entry(rel, entry, where: str) -> None:
    parts = rel.split("/") if isinstance(rel, str) else []
    if (not parts or rel.startswith("/") or "\\" in rel or rel == MANIFEST_NAME
            or any(p in ("", ".", "..") for p in parts)):
        raise ArtifactError(f"{where}: files entry {rel!r} is not a plain relative path inside the artifact")
    ok = (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _HEX64.fullmatch(entry["sha256"])
          and isinstance(entry.get("size"), int) and not isinstance(entry["size"], bool) and entry["size"] >= 0)
    if not ok:
        raise ArtifactError(f"{where}: files[{rel!r}] must be {{'sha256': 64 hex chars, 'size': int >= 0}}")


def quantization_method(hf_config) -> str | None:
    """A Hugging Face config.json's quantization method ("gptq", "compressed-tensors", ...) when its
    tensors are codes and scales, else None. Build refuses such a source, import takes it."""
    if not isinstance(hf_config, dict) or "quantization_config" not in hf_config:
        return None
    qc = hf_config["quantization_config"]
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if isinstance(method, str) and method else "quantized"


def read_manifest(path) -> Manifest:
    """The manifest of the artifact at `path`, validated; no weights are read."""
    root = Path(path)
    mpath = root / MANIFEST_NAME
    if not root.exists():
        raise ArtifactError(f"{root}: no such file or directory; pass the directory that qkiln build wrote "
                            "(or its archive: .tar, .tar.gz, .tgz)")
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a directory; pass the directory that qkiln build wrote, or its archive "
                            "named .tar, .tar.gz or .tgz")
    if not mpath.is_file():
        if (root / "config.json").is_file():
            try:
                quantized = quantization_method(json.loads((root / "config.json").read_text())) is not None
            except (OSError, ValueError):
                quantized = False
            raise ArtifactError(f"{root}: a Hugging Face {'quantized checkpoint' if quantized else 'model'}, not a "
                                f"qkiln artifact (no {MANIFEST_NAME}); "
                                + (f"`qkiln import {root} -o ARTIFACT` turns it into one" if quantized else
                                   f"`qkiln build {root} --recipe RECIPE -o ARTIFACT` makes one"))
        raise ArtifactError(f"{root}: not a finished artifact (no {MANIFEST_NAME}); "
                            "the build did not complete or this is the wrong directory, rerun qkiln build")
    try:
        text = mpath.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ArtifactError(f"{mpath}: not UTF-8 text; the artifact is corrupt, rebuild it") from None
    except PermissionError as e:
        raise unreadable(mpath, e) from None
    return Manifest.from_json(text, where=str(mpath))


def unreadable(path, error: OSError) -> ArtifactError:
    """An artifact's file or folder this user may not read (written by another user under a
    private umask): said as such, not as a traceback or a missing file."""
    return ArtifactError(f"{path}: cannot be read ({error.strerror}); the artifact's files must be readable by "
                         "whoever loads it: `chmod -R a+rX` the artifact, or ask its owner to")


def sha256_file(path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):  # 1 MiB: shards are GBs, never read whole
                h.update(chunk)
    except PermissionError as e:
        raise unreadable(path, e) from None
    return h.hexdigest()


def _raise_unreadable(error: OSError):
    if isinstance(error, PermissionError):
        raise unreadable(error.filename, error) from None
    raise error


def list_artifact_files(root: Path) -> set[str]:
    """Every file under `root` as a posix relpath, manifest.json excepted; refuses links and
    folders it cannot read (os.walk skips those without a word: their files looked missing)."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise_unreadable):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise ArtifactError(f"{p}: symbolic link inside an artifact; artifacts hold plain files only")
            if name in filenames and not p.is_file():
                raise ArtifactError(f"{p}: not a regular file; artifacts hold plain files only")
            if name in filenames and rel != MANIFEST_NAME:
                out.add(rel)
    return out


def check_target_available(manifest: Manifest, where="artifact") -> None:
    """Refuse a cuda artifact without CUDA or on a GPU older than its min compute capability."""
    if manifest.target["device"] == "cpu":
        return
    try:
        import torch  # lazy: the artifact module stays importable without torch

        is_available = torch.cuda.is_available()
    except ImportError:
        is_available = False
    if not is_available:
        raise TargetUnavailableError(f"{where}: built for target cuda but CUDA is not available on this machine; "
                            "run it on a CUDA machine or rebuild with --target cpu")
    need = manifest.target.get("min_compute_capability")
    if need is not None:
        need_cc = tuple(int(x) for x in (need if isinstance(need, list) else str(need).split(".")))
        have_cc = tuple(torch.cuda.get_device_capability())
        if have_cc < need_cc:
            raise TargetUnavailableError(f"{where}: needs compute capability {need}, this GPU has "
                                f"{'.'.join(map(str, have_cc))}; serve on a newer GPU or rebuild for this one")


def verify_artifact(path, check_target: bool = True) -> list[str]:
    """Check schema, version, target and every file's size and sha256; returns the verified relpaths.

    Raises ArtifactError whose message starts with the offending path, then what is wrong.
    """
    root = Path(path)
    check_finished_name(root)
    retries = _REPLACED_RETRIES
    while True:
        before = _folder_identity(root)
        try:
            return verify_contents(root, check_target)
        except ArtifactError:
            # a `build --force` replaced the folder while it was read (the old manifest against the
            # new weights): check the new one, as a reader arriving a moment later would
            if retries == 0 or _folder_identity(root) == before:
                raise
            retries -= 1


_REPLACED_RETRIES = 3


def _folder_identity(root: Path) -> tuple[int, int] | None:
    """Which directory `root` names now: a replace renames another one into its place."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_finished_name(root: Path) -> None:
    """A writer's `.NAME.partial-*` / `.NAME.trash-*` directory is never an artifact, even
    with a manifest in it (a build killed between writing it and the rename)."""
    if UNFINISHED_RE.fullmatch(root.name):
        raise ArtifactError(f"{root}: leftover of an unfinished build, not an artifact; rerun qkiln build")


def check_not_unchecked(root: Path, present) -> None:
    if UNCHECKED_MARKER in present:
        raise ArtifactError(f"{root}: its writer stopped while checking it ({UNCHECKED_MARKER} is still there), so "
                            "it was never finished; rerun the qkiln command that wrote it (with --force)")


def verify_contents(root: Path, check_target: bool = True) -> list[str]:
    """verify_artifact without the directory-name check (the writer verifies its own temp dirs)."""
    manifest = read_manifest(root)
    present = list_artifact_files(root)
    check_not_unchecked(root, present)
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise ArtifactError(f"{root / missing[0]}: listed in the manifest but missing"
                            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; re-fetch or rebuild")
    unlisted = sorted(present - set(manifest.files))
    if unlisted:
        raise ArtifactError(f"{root / unlisted[0]}: not listed in the manifest"
                            f"{f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}; "
                            "remove it or rebuild the artifact")
    for rel in sorted(manifest.files):
        expected = manifest.files[rel]
        size = (root / rel).stat().st_size
        if size != expected["size"]:
            raise ArtifactError(f"{root / rel}: size mismatch: manifest says {expected['size']} bytes, "
                                f"file has {size}; the file was changed, re-fetch or rebuild")
        actual = sha256_file(root / rel)
        if actual != expected["sha256"]:
            raise ArtifactError(f"{root / rel}: sha256 mismatch: manifest says {expected['sha256'][:16]}..., "
                                f"file has {actual[:16]}...; the file was changed, re-fetch or rebuild")
    read_tensor_index(root, manifest)  # the shards' headers: dtypes, shapes, offsets that tile the data
    if check_target:  # last: TargetUnavailableError (exit 7) says the artifact itself is sound
        check_target_available(manifest, where=str(root))
    return sorted(manifest.files)


def weight_shards(manifest: Manifest) -> list[str]:
    return sorted(r for r in manifest.files if r.startswith(WEIGHTS_DIR + "/") and r.endswith(".safetensors"))


@dataclass(frozen=True)
class TensorInfo:
    shard: str  # relpath of the safetensors file
    dtype: str  # safetensors name: "BF16", "U8", "F8_E4M3", ...
    shape: tuple[int, ...]
    nbytes: int


def _read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header (u64 little-endian length, then JSON) without reading tensor bytes, and the
    number of data bytes after it."""
    try:
        f = open(path, "rb")
    except OSError as e:  # a listed shard missing or renamed: what verify says, not a traceback
        raise ArtifactError(f"{path}: cannot read it ({e.strerror}); `qkiln verify` checks every file") from None
    with f:
        raw = f.read(8)
        (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
        if not 0 < length <= 100 << 20 or length + 8 > path.stat().st_size:
            raise ArtifactError(f"{path}: not a safetensors file (bad header length); rebuild the artifact")
        try:
            header = json.loads(f.read(length), parse_constant=_no_constant)
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
            raise ArtifactError(f"{path}: unreadable safetensors header; rebuild the artifact")
        return header, path.stat().st_size - 8 - length


# safetensors dtype -> bytes per element (the names its format defines)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def _tensor_entry(info: dict) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of a header entry, or ValueError: a known dtype, a shape of
    whole numbers >= 0, offsets whose span holds exactly that many elements."""
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if dtype not in _DTYPE_BYTES or not isinstance(shape, list) or not all(whole(d) for d in shape) or \
            not isinstance(offsets, list) or len(offsets) != 2 or not all(whole(o) for o in offsets):
        raise ValueError("malformed")
    begin, end = offsets
    if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ValueError("size")
    return dtype, tuple(shape), begin, end


def read_tensor_index(path, manifest: Manifest | None = None) -> dict[str, TensorInfo]:
    """Tensor name -> where it lives, its dtype and shape, from the shard headers alone."""
    root = Path(path)
    manifest = manifest or read_manifest(root)
    index = {}
    for rel in weight_shards(manifest):
        header, data_bytes = _read_safetensors_header(root / rel)
        spans = []
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            if name in index:
                raise ArtifactError(f"{root / rel}: tensor {name!r} also in {index[name].shard}; rebuild the artifact")
            try:
                dtype, shape, begin, end = _tensor_entry(info)
            except (KeyError, TypeError, ValueError):
                raise ArtifactError(f"{root / rel}: tensor {name!r} has a malformed header entry (dtype, shape, "
                                    "data_offsets, or a size they disagree on); the artifact is corrupt, rebuild "
                                    "it") from None
            index[name] = TensorInfo(rel, dtype, shape, end - begin)
            spans.append((begin, end, name))
        # the tensors tile the data: no overlap, none past the file's end (safetensors' own rule)
        position = 0
        for begin, end, name in sorted(spans):
            if begin != position:
                raise ArtifactError(f"{root / rel}: tensor {name!r} starts at byte {begin} of the data, not at "
                                    f"{position} where the one before ends; the artifact is corrupt, rebuild it")
            position = end
        if position != data_bytes:
            raise ArtifactError(f"{root / rel}: its tensors cover {position} bytes of its {data_bytes} data bytes; "
                                "the artifact is corrupt, rebuild it")
    return index


def load_tensors(path, manifest: Manifest | None = None, *, verify: bool = True, device: str = "cpu") -> dict:
    """Every tensor of the artifact (safetensors, never pickle), after `verify_artifact` unless told not to.

    The target check is left to the caller (the runtime verifies before it serves); loading to
    CPU memory is fine for inspection of an artifact built for cuda. CPU tensors are copies, not
    views of the file's memory map: one the loader keeps as stored (the embedding) would read the
    file for as long as the model is served, and a file rewritten under a running server (cp over
    it, rsync --inplace, a truncate) then killed it with SIGBUS or changed its weights after
    verify_artifact had checked them (probe, session 48).
    """
    from safetensors.torch import load_file  # lazy: imports torch

    root = Path(path)
    if verify:
        verify_artifact(root, check_target=False)
        on_disk = read_manifest(root)
        if manifest is not None and manifest.files != on_disk.files:
            raise ArtifactError(f"{root}: the manifest passed in differs from {MANIFEST_NAME} on disk; reread it")
        manifest = on_disk
    manifest = manifest or read_manifest(root)
    tensors = {}
    for rel in weight_shards(manifest):
        try:
            shard = load_file(root / rel, device=device)
        except Exception as e:  # SafetensorError and its kin: a damaged or hostile header (verify checks them)
            raise ArtifactError(f"{root / rel}: cannot be read as safetensors ({e}); the artifact is corrupt, "
                                "rebuild it") from None
        if str(device) == "cpu":
            shard = {name: tensor.clone() for name, tensor in shard.items()}
        for name in shard.keys() & tensors.keys():
            raise ArtifactError(f"{root / rel}: tensor {name!r} appears in two shards; rebuild the artifact")
        tensors.update(shard)
    return tensors


def code_revision() -> dict:
    """{revision, is_dirty} of the git checkout qkiln runs from, both None for an install (qkiln's
    package version stays 0.1.0 from commit to commit: this is what tells two builders apart)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def run(*args):
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    toplevel = run("rev-parse", "--show-toplevel")
    if toplevel is None or Path(toplevel).resolve() != root:  # an install inside some other repository
        return {"revision": None, "is_dirty": None}
    # --no-optional-locks: a status that refreshed .git/index under a build fought the user's git for its lock
    status = run("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    return {"revision": run("rev-parse", "HEAD"), "is_dirty": bool(status) if status is not None else None}


def toolchain_versions() -> dict:
    """Versions that decide the bytes of a build: recorded so a mismatch can be explained later,
    and qkiln's own commit when it runs from a checkout (`qkiln_revision`, "+dirty" when the
    checkout has uncommitted changes), so a registry can find the builds made before a fix."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version(), "platform": f"{platform.system()}-{platform.machine()}"}
    git = code_revision()
    if git["revision"]:
        out["qkiln_revision"] = git["revision"] + ("+dirty" if git["is_dirty"] else "")
    for pkg in ("qkiln", "torch", "safetensors", "numpy", "tokenizers", "triton", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    try:
        import torch

        out["torch"] = torch.__version__  # keeps the local tag (+cpu / +cu128) that metadata drops
        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out
