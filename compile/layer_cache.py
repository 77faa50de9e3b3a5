"""Content-addressed build cache: one entry per quantized decoder layer.

Key = sha256 over (source files' sha256, weight/activation scheme + algorithm options + ignore
list, calibration token sha256, layer index, and the code that computes a layer: the cache
format, torch's version and a hash of quant/ and the modules of _LAYER_CODE). Sequential calibration makes
layer i depend on layers < i, and those are fixed by the same inputs. A layer calibrated on data
also keys on the thread count and the CPU's SIMD level (calibration_numerics), which change its
codes: a hit is what a cold build on this host computes, never a mix of two hosts' layers that no
clean build reproduces (a team cache is shared by hosts alike in both). The KV scheme, target and
evaluation are *not* in the key: changing them reuses every layer.
Entries are safetensors files written atomically (temp file, fsync, rename) with their key and the
sha256 of their tensors and report, checked on every read: a corrupt entry (bit rot, a torn write,
an edit in a shared cache, an entry copied under another key's name) is a miss and is deleted,
never an error and never data in an artifact. The folder is bounded (QKILN_CACHE_MAX_GB, default
8): past it, the least recently used entries go, and temp files a killed build left go after a day. The cache only saves time: one that cannot be written (a
read-only home, a full disk, another user's private folder) is said once and switched off for the
build, which goes on. Folders it creates are 0755 and entries 0644 whatever the umask, so a cache
on a team's volume serves every user.
"""

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qkiln.errors import QkilnError

from .artifact_writer import is_full_disk

CACHE_FORMAT = 4  # 3: entries carry their payload's sha256; 4: and their key
DEFAULT_MAX_GB = 8.0
STALE_TMP_SECONDS = 24 * 3600


def default_cache_dir() -> Path:
    # empty is unset: a deploy template's `QKILN_CACHE_DIR=${UNSET}` had cached into ./layers
    return Path(os.environ.get("QKILN_CACHE_DIR") or Path.home() / ".cache" / "qkiln") / "layers"


def max_cache_bytes() -> int:
    """QKILN_CACHE_MAX_GB (GiB, default 8) in bytes."""
    value = os.environ.get("QKILN_CACHE_MAX_GB") or str(DEFAULT_MAX_GB)  # empty is unset, as QKILN_CACHE_DIR
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # also NaN
        raise QkilnError(f"QKILN_CACHE_MAX_GB={value!r} is not a number of GiB (e.g. 8 or 0.5); fix or unset it")
    return int(gib * (1 << 30))


def write_cache_file(path: Path, write, warn=None) -> bool:
    """Write `path` atomically through `write(temp_path)` (temp file, fsync, rename), so a killed
    build leaves no torn entry. False, said through `warn` (default: stderr), when it cannot be
    written: a cache only saves time, so the build goes on without it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _make_shared_dirs(path.parent)
        write(tmp)
        os.chmod(tmp, 0o644)  # safetensors creates 0600; a cache shared by a team's users must be readable
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except (OSError, SafetensorError) as e:
        _say_unwritable(path.parent, e, warn)
        return False
    finally:  # also when Ctrl-C or SIGTERM (KeyboardInterrupt, SystemExit) cuts the write short
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _nearest_existing(path: Path) -> Path:
    """`path` or the nearest folder above it that exists (a cache or output not made yet)."""
    path = Path(path).absolute()
    return next(p for p in (path, *path.parents) if p.exists())


def _make_shared_dirs(directory: Path) -> None:
    """mkdir -p, each folder it creates 0755 (the umask would make a team's cache owner-only under
    077, and every other user's build then missed)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()][::-1]
    for d in missing:
        d.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            d.chmod(0o755)


def _say_unwritable(directory: Path, error: BaseException, warn, doing: str = "written") -> None:
    if isinstance(error, PermissionError):
        remedy = "ask its owner for access, or point QKILN_CACHE_DIR elsewhere"
    elif is_full_disk(error):
        remedy = "free space there, or point QKILN_CACHE_DIR elsewhere"
    else:  # a read-only file system, a file in the way, ...: free space would not help
        remedy = "point QKILN_CACHE_DIR elsewhere"
    (warn or (lambda msg: print(msg, file=sys.stderr)))(
        f"warning: the build cache {directory} cannot be {doing} ({error}); this build goes on without it "
        f"({remedy})")


# Beside quant/: the modules that compute a layer's inputs and outputs during calibration (the
# model forward and the simulation of the layers before it), and those that turn a source file into
# weights (a fix to GGUF dequantization or Q/K unpermutation changes them under the same file
# sha256). Only quant/ and calibrate.py were hashed, so a change to the forward reused layers the
# old code had computed.
_LAYER_CODE = ("compile/calibrate.py", "compile/simulate.py", "compile/quantized_model.py", "runtime/model.py",
               "runtime/attention.py", "runtime/rope.py", "runtime/config.py", "plugins/reference.py",
               "runtime/source.py", "runtime/gguf_reader.py")


@functools.cache
def code_version() -> str:
    """What computes a cached layer: torch's version and the sources of quant/ and _LAYER_CODE, so
    an upgrade that changes results misses instead of reusing layers."""
    import qkiln.quant

    package = Path(qkiln.quant.__file__).parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    h.update(_gguf_version().encode())  # a GGUF's tensors are dequantized by the gguf package
    for path in [*sorted(Path(qkiln.quant.__file__).parent.glob("*.py")), *(package / p for p in _LAYER_CODE)]:
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "none"


def calibration_numerics() -> dict:
    """What, besides the inputs, decides a calibrated layer's bytes on this host: float reductions
    round differently with the thread count and the SIMD level, and GPTQ's error feedback and AWQ's
    grid search turn last-bit differences into other codes (16% of SmolLM2's GPTQ codes moved
    between 1 and 2 threads, most by one step)."""
    return {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def layer_key(source_sha256: str, scheme_dict: dict, token_sha256: str | None, layer_id: int,
              numerics: dict | None = None) -> str:
    """numerics: calibration_numerics() for layers calibrated on data, so a hit is exactly what this
    host computes cold (data-free layers are the same on every host and leave it None)."""
    key = {"source": source_sha256, "scheme": scheme_dict, "tokens": token_sha256, "layer": layer_id,
           "format": CACHE_FORMAT, "code": code_version()}
    if numerics is not None:
        key["numerics"] = numerics
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def payload_sha256(tensors: dict[str, torch.Tensor], report_json: str) -> str:
    """sha256 over the report and every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(report_json.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


class LayerCache:
    def __init__(self, directory: Path | None, max_bytes: int | None = None, warn=None,
                 reserve: tuple[Path, int] | None = None, before_write: Callable[[], None] | None = None):
        """warn: says that the cache cannot be written (default: print to stderr).
        reserve (output path, bytes): free space an entry may not take when the cache shares the
        output's disk (what the build's artifact will need: entries that took it failed the build at
        its last step, and every rerun).
        before_write: called before an entry is written, to raise if what it was computed from
        changed (the build's source: an entry of other weights under its sha256 poisoned reruns)."""
        self.directory = directory
        self.max_bytes = max_bytes if max_bytes is not None else max_cache_bytes()
        self.reserve = reserve
        self.before_write = before_write
        self._warn = warn
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.safetensors"
        try:
            from safetensors import safe_open

            # safetensors says "No such file or directory" for a folder this user may not read
            if path.parent.is_dir() and not os.access(path.parent, os.R_OK | os.X_OK):
                raise PermissionError(13, "Permission denied", str(path.parent))
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata()
            tensors = load_file(str(path))
            if metadata.get("key") != key or payload_sha256(tensors, metadata["report"]) != metadata["sha256"]:
                with contextlib.suppress(OSError):  # another user's entry stays: still a miss
                    path.unlink(missing_ok=True)  # damaged or misfiled: recomputed and stored again
                raise ValueError("payload does not match its key and sha256")
            meta = json.loads(metadata["report"])
            with contextlib.suppress(OSError):  # only the owner may touch it: another user's entry is still a hit
                os.utime(path)  # recently used: evicted last
        except PermissionError as e:  # another user's private folder: said once, then no cache
            _say_unwritable(self.directory, e, self._warn, doing="read")
            self.directory = None
            self.num_misses += 1
            return None
        except Exception:  # missing or corrupt: recompute
            self.num_misses += 1
            return None
        self.num_hits += 1
        return tensors, meta

    def put(self, key: str, tensors: dict[str, torch.Tensor], report: dict) -> None:
        if self.directory is None:
            return
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        report_json = json.dumps(report, sort_keys=True)
        metadata = {"key": key, "report": report_json, "sha256": payload_sha256(tensors, report_json)}
        if self.before_write is not None:
            self.before_write()
        if not self._leaves_reserve(sum(t.numel() * t.element_size() for t in tensors.values())):
            return
        if not write_cache_file(self.directory / f"{key}.safetensors",
                                lambda tmp: save_file(tensors, str(tmp), metadata=metadata), self._warn):
            self.directory = None  # said once; the rest of the build runs without it
            return
        try:
            self._evict(keep=key)
        except OSError as e:  # evicting from a shared cache (another user's entries)
            _say_unwritable(self.directory, e, self._warn)
            self.directory = None

    def _leaves_reserve(self, entry_bytes: int) -> bool:
        """Whether writing an entry leaves the reserve free; said once, and the cache left, if not."""
        if self.reserve is None:
            return True
        output, reserve_bytes = self.reserve
        try:
            here = _nearest_existing(self.directory)
            if here.stat().st_dev != _nearest_existing(output).stat().st_dev:
                return True  # another disk: the artifact needs none of this one's space
            free = shutil.disk_usage(here).free
        except OSError:
            return True  # unreadable: write_cache_file says what is wrong
        if free - entry_bytes >= reserve_bytes:
            return True
        (self._warn or (lambda msg: print(msg, file=sys.stderr)))(
            f"warning: the build cache {self.directory} is not written: its disk, the output's, has "
            f"{free / 2**20:.0f} MiB free and this build keeps {reserve_bytes / 2**20:.0f} MiB of it for the "
            "artifact; this build goes on without the cache (free space there, or point QKILN_CACHE_DIR at "
            "another disk)")
        self.directory = None
        return False

    def _evict(self, keep: str) -> None:
        """Delete the least recently used entries while the folder exceeds max_bytes."""
        entries = []
        for path in self.directory.glob("*.safetensors"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another build evicted it meanwhile
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        for path in self.directory.glob(".*.tmp"):  # a killed build's; a live one's is seconds old
            try:
                if time.time() - path.stat().st_mtime > STALE_TMP_SECONDS:
                    path.unlink()
            except FileNotFoundError:
                continue
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path.stem != keep:
                path.unlink(missing_ok=True)
                total -= size
