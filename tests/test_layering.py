"""DESIGN.md's layering table, enforced: parse every import and fail on an edge it doesn't allow."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> qkiln subpackages it may import (qkiln.errors is allowed everywhere)
ALLOWED = {
    "quant": set(),
    "calib_data": set(),
    "plugins": set(),
    # compile.artifact: the artifact's format, with its archive form (artifact_archive, which imports
    # only compile.artifact and its writer: test_the_artifact_format_is_a_leaf)
    "runtime": {"quant", "plugins", "compile.artifact", "compile.artifact_archive"},
    "compile": {"quant", "calib_data", "runtime", "plugins"},
    "bench": {"quant", "calib_data", "runtime", "plugins", "compile"},
    # the command line (and the shared errors / host helpers): every layer, and bench's commands
    # only through BENCH_ENTRY
    "qkiln": {"quant", "calib_data", "runtime", "plugins", "compile", "bench.cli"},
}
# The one edge into bench: the CLI mounts `qkiln bench ...` from it.
BENCH_ENTRY = ("qkiln/cli.py", "qkiln.bench.cli")
# calib_data is text and token ids ("tokenizer, stdlib"): no tensors (the build makes them); its
# hf: source reads through the optional `datasets`
THIRD_PARTY_FORBIDDEN = {"runtime": {"transformers"}, "quant": {"transformers"}, "plugins": {"transformers"},
                         "calib_data": {"transformers", "torch", "numpy"}}


def _imports(path: Path, package: str):
    """Every module `path` imports, relative imports resolved (`from ..runtime import x` from a
    file in quant/ is qkiln.runtime) and `from qkiln import runtime` read as qkiln.runtime."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = ["qkiln", package, *path.relative_to(ROOT / package).parent.parts]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this file's package, each more goes one up
                module = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module
            yield module
            if module == "qkiln":
                yield from (f"qkiln.{alias.name}" for alias in node.names)


def test_imports_respect_the_layering_table():
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path, folder):
                top = name.split(".")[0]
                if top in THIRD_PARTY_FORBIDDEN.get(folder, ()):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
                if top != "qkiln" or name in ("qkiln", "qkiln.errors"):
                    continue
                target = name.removeprefix("qkiln.")
                if target.split(".")[0] == folder or (folder == "qkiln" and (ROOT / folder / f"{target}.py").is_file()):
                    continue  # its own modules (qkiln/'s are qkiln.cli, qkiln.host_threads, ...)
                if not any(target == a or target.startswith(a + ".") for a in allowed):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "imports outside DESIGN.md's layering table:\n" + "\n".join(bad)


def test_nothing_imports_bench():
    for folder in ("quant", "calib_data", "plugins", "runtime", "compile", "qkiln"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path, folder):
                edge = (str(path.relative_to(ROOT)), name)
                assert not name.startswith("qkiln.bench") or edge == BENCH_ENTRY, f"{path} imports {name}"


def test_the_artifact_format_is_a_leaf():
    """What the runtime reads of compile/ (the artifact, its archive) imports no more of qkiln than
    the artifact's own modules: the runtime never depends on the build."""
    own = {"qkiln.errors", "qkiln.compile.artifact", "qkiln.compile.artifact_writer", "qkiln.compile.artifact_archive"}
    for name in ("artifact", "artifact_writer", "artifact_archive"):
        path = ROOT / "compile" / f"{name}.py"
        bad = [m for m in _imports(path, "compile") if m.startswith("qkiln") and m not in own]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
