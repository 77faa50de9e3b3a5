"""Export an artifact as an ONNX engine directory (`qkiln export --format onnx`), or give the
engine files a build puts under the artifact's engines/onnx/ (`qkiln build --engine onnx`).

The graph comes from onnx_graph.py and is checked by onnx_check.py: written, then run for two
serving steps and held to the artifact's own numerics before the directory appears. The `onnx`
package is an optional extra (`pip install 'qkiln[onnx]'`); nothing else imports it.
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

from qkiln.errors import ArtifactError, QkilnError
from qkiln.plugins import onnx_nodes

from .artifact import Manifest, load_tensors, read_manifest, verify_artifact
from .artifact_writer import check_replaceable, read_json_field, staged_directory
from .onnx_check import OnnxCheck, check_fits_in_memory, require_engine_matches
from .onnx_graph import CONTRACT_FILE, DATA_FILE, MODEL_FILE, build_onnx_engine, write_onnx_engine

INSTALL_HINT = "pip install 'qkiln[onnx]' (or: pip install onnx==1.23.2)"
ENGINE_DIR = "onnx"  # under the artifact's engines/
ENGINES = ("onnx",)  # what `qkiln build --engine` writes


@dataclass
class OnnxExportResult:
    path: Path
    num_nodes: int
    bytes: int
    check: OnnxCheck | None


def require_onnx() -> None:
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise QkilnError(f"the onnx package is not installed: {INSTALL_HINT}") from None


def export_onnx(artifact, out_dir, *, overwrite: bool = False, verify: bool = True, log=print) -> OnnxExportResult:
    """Write the artifact's ONNX engine into `out_dir`: complete and checked, or not at all.
    A check that would not fit in memory is skipped and said so (`log`); verify=False skips it."""
    require_onnx()
    out = Path(out_dir).absolute()
    recheck = lambda: check_replaceable(out, overwrite, "an ONNX engine qkiln exported", _engine_files)  # noqa: E731
    recheck()
    verify_artifact(artifact, check_target=False)  # an engine may be built anywhere
    manifest = read_manifest(artifact)
    verify = verify and _check_fits(manifest, log)
    engine = build_onnx_engine(manifest, load_tensors(artifact, manifest, verify=False))
    with staged_directory(out, recheck) as tmp:
        size = sum(f.stat().st_size for f in write_onnx_engine(engine, tmp))
        check = require_engine_matches(Path(artifact), tmp) if verify else None
    return OnnxExportResult(out, len(engine.model.graph.node), size, check)


def _engine_files(directory: Path) -> set[str] | None:
    """What an ONNX engine qkiln exported holds, or None when `directory` is not one."""
    if read_json_field(directory / CONTRACT_FILE, "plugin_domain") != onnx_nodes.DOMAIN:
        return None
    return {MODEL_FILE, DATA_FILE, CONTRACT_FILE}


def onnx_engine_files(manifest: Manifest, tensors: dict) -> dict[str, bytes]:
    """The engine as {"onnx/model.onnx": bytes, ...} for write_artifact's `engines` (the build's
    `--engine onnx`); the manifest then hashes them with the weights."""
    require_onnx()
    engine = build_onnx_engine(manifest, tensors)
    with tempfile.TemporaryDirectory(prefix="qkiln-onnx-") as tmp:
        return {f"{ENGINE_DIR}/{p.name}": p.read_bytes() for p in write_onnx_engine(engine, Path(tmp))}


def artifact_engine_dir(artifact: Path, purpose: str) -> Path:
    """An artifact's engines/onnx/, or an ArtifactError saying it has none to `purpose`."""
    engine_dir = Path(artifact) / "engines" / ENGINE_DIR
    if not engine_dir.is_dir():
        raise ArtifactError(f"{artifact}: has no engines/{ENGINE_DIR}/ to {purpose}; build with --engine onnx")
    return engine_dir


def check_artifact_engine(artifact: Path, log=print) -> OnnxCheck | None:
    """Hold an artifact's engines/onnx/ to the artifact (onnx_check.py); ArtifactError if it misses,
    None when the check would not fit in memory (said through `log`)."""
    engine_dir = artifact_engine_dir(artifact, "check")
    require_onnx()
    if not _check_fits(read_manifest(artifact), log):
        return None
    return require_engine_matches(Path(artifact), engine_dir)


def _check_fits(manifest: Manifest, log) -> bool:
    reason = check_fits_in_memory(manifest.num_parameters)
    if reason:
        log(f"onnx engine not checked: {reason}; the graph builder is checked on small models by the tests")
    return reason is None
