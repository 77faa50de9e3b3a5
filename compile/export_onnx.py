"""Export an artifact as an ONNX engine directory (`qkiln export --format onnx`), or give the
engine files a build puts under the artifact's engines/onnx/ (`qkiln build --engine onnx`).

The graph comes from onnx_graph.py and is checked by onnx_check.py: written, then run for two
serving steps and held to the artifact's own numerics before the directory appears. The `onnx`
package is an optional extra (`pip install 'qkiln[onnx]'`); nothing else imports it.
"""

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkiln.errors import ArtifactError, QkilnError
from qkiln.plugins import onnx_nodes

from .artifact import (UNCHECKED_MARKER, Manifest, check_not_unchecked, load_tensors, read_manifest, sha256_file,
                       verify_artifact)
from .artifact_writer import (check_replaceable, mark_checked, mark_unchecked, output_path, read_json_field,
                              staged_directory)
from .onnx_check import (OnnxCheck, check_contract_version, check_fits_in_memory, read_engine_contract,
                         require_engine_matches)
from .onnx_contract import read_engine_model, rewrite_hint
from .onnx_graph import CONTRACT_FILE, DATA_FILE, MODEL_FILE, build_onnx_engine, write_onnx_engine

INSTALL_HINT = "pip install 'qkiln[onnx]' (in qkiln's checkout: pip install -e '.[onnx]')"
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
    out = output_path(out_dir)
    recheck = lambda: check_replaceable(out, overwrite, "an ONNX engine qkiln exported", _engine_files)  # noqa: E731
    recheck()
    verify_artifact(artifact, check_target=False)  # an engine may be built anywhere
    manifest = read_manifest(artifact)
    verify = verify and _check_fits(manifest, log)
    engine = build_onnx_engine(manifest, load_tensors(artifact, manifest, verify=False))
    with staged_directory(out, recheck) as tmp:
        if verify:
            mark_unchecked(tmp)
        size = sum(f.stat().st_size for f in write_onnx_engine(engine, tmp))
        check = require_engine_matches(Path(artifact), tmp) if verify else None
        if verify:
            mark_checked(tmp)
    return OnnxExportResult(out, len(engine.model.graph.node), size, check)


def _engine_files(directory: Path) -> set[str] | None:
    """What an ONNX engine qkiln exported holds, or None when `directory` is not one."""
    if read_json_field(directory / CONTRACT_FILE, "plugin_domain") != onnx_nodes.DOMAIN:
        return None
    return {MODEL_FILE, DATA_FILE, CONTRACT_FILE, UNCHECKED_MARKER}  # the marker: left by a killed check


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


def check_artifact_engine(artifact: Path, log=print, engine_dir: Path | None = None) -> OnnxCheck | None:
    """Hold an artifact's engines/onnx/ (or `engine_dir`) to the artifact: it must be the engine
    this qkiln builds from the artifact (require_engine_as_built), then compute what the artifact
    computes (onnx_check.py). ArtifactError if it misses; None when the numerical check would not
    fit in memory (said through `log`)."""
    engine_dir = engine_dir or artifact_engine_dir(artifact, "check")
    require_onnx()
    require_engine_as_built(Path(artifact), engine_dir)
    if not _check_fits(read_manifest(artifact), log):
        return None
    return require_engine_matches(Path(artifact), engine_dir)


def require_engine_as_built(artifact: Path, engine_dir: Path) -> None:
    """The engine in `engine_dir` must be the one this qkiln builds from the artifact: the same
    nodes, graph inputs and outputs, engine.json, and every initializer the same bytes, except the
    RoPE tables, computed with the platform's sin / cos, which must agree to 1e-6. Two numerical
    steps cannot see a weight they never read (an embedding row, a far RoPE position); this covers
    them all."""
    from onnx import numpy_helper

    manifest = read_manifest(artifact)
    expected = build_onnx_engine(manifest, load_tensors(artifact, manifest, verify=False))
    contract = read_engine_contract(engine_dir)
    check_contract_version(contract, engine_dir)  # an older engine differs in its contract: say why
    actual = read_engine_model(engine_dir)
    want, have = expected.model.graph, actual.graph
    differs = [what for what, a, b in (
        ("engine.json content", json.loads(json.dumps(expected.contract)),
         {k: v for k, v in contract.items() if k not in ("files", "digest")}),
        ("nodes", _serialized(want.node), _serialized(have.node)),
        ("graph inputs", _serialized(want.input), _serialized(have.input)),
        ("graph outputs", _serialized(want.output), _serialized(have.output)),
        ("opsets", _serialized(expected.model.opset_import), _serialized(actual.opset_import))) if a != b]
    theirs = {t.name: t for t in have.initializer}
    weights = [t.name for t in want.initializer if t.name not in theirs or not _same_values(
        numpy_helper.to_array(t), numpy_helper.to_array(theirs[t.name]), computed=t.name.startswith("rope."))]
    weights += sorted(set(theirs) - {t.name for t in want.initializer})
    if weights:
        names = ", ".join(weights[:3]) + (", ..." if len(weights) > 3 else "")
        differs.append(f"{len(weights)} of {len(want.initializer)} initializers ({names})")
    if differs:
        versions = (actual.producer_version or "?", expected.model.producer_version)
        raise ArtifactError(f"the ONNX engine in {engine_dir} is not the one this qkiln builds from this artifact "
                            f"(differing: {'; '.join(differs)}); {rewrite_hint(engine_dir)}"
                            + (f" (it was written by qkiln {versions[0]}, this is {versions[1]})"
                               if versions[0] != versions[1] else ""))


def _serialized(protos) -> list[bytes]:
    return [p.SerializeToString(deterministic=True) for p in protos]


def _same_values(a, b, computed: bool) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if computed:  # torch's sin / cos differ by an ulp across CPUs
        return bool(np.allclose(a, b, rtol=0.0, atol=1e-6))
    return a.tobytes() == b.tobytes()


def verify_engine_files(engine_dir: Path) -> dict:
    """An engine folder on its own (qkiln export --format onnx): its files against engine.json's
    sha256; returns engine.json. ArtifactError naming what differs. An intact engine of another
    contract version is refused too, as every other command that reads it refuses it."""
    contract = read_engine_contract(engine_dir)
    check_contract_version(contract, engine_dir)
    files = contract.get("files")
    if not isinstance(files, dict) or set(files) != {MODEL_FILE, DATA_FILE}:
        raise ArtifactError(f"{engine_dir / CONTRACT_FILE} lists no sha256 for {MODEL_FILE} and {DATA_FILE} "
                            "(written before qkiln recorded them); re-export the engine")
    present = {p.name for p in Path(engine_dir).iterdir()}
    check_not_unchecked(Path(engine_dir), present)
    foreign = sorted(present - {MODEL_FILE, DATA_FILE, CONTRACT_FILE})
    if foreign:  # as an artifact's verify refuses files its manifest does not list
        raise ArtifactError(f"{engine_dir} holds files an engine does not: {', '.join(foreign[:5])}; remove them, "
                            "or re-export the engine into an empty folder")
    for name, digest in sorted(files.items()):
        if not (engine_dir / name).is_file():
            raise ArtifactError(f"{engine_dir}: {name} is missing; re-export the engine")
        if sha256_file(engine_dir / name) != digest:
            raise ArtifactError(f"{engine_dir / name}: sha256 differs from engine.json's; the file was changed or "
                                "damaged: re-export the engine")
    return contract


def _check_fits(manifest: Manifest, log) -> bool:
    reason = check_fits_in_memory(manifest.num_parameters)
    if reason:
        log(f"onnx engine not checked: {reason}; the graph builder is checked on small models by the tests")
    return reason is None
