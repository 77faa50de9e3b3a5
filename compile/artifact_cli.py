"""`qkiln verify` and `qkiln inspect`: artifact checks a deploy script or registry can call.

Owns the two typer command functions (registered by qkiln/cli.py) and `summarize_artifact`,
the dict `inspect` prints. Neither loads weights: verify hashes files, inspect reads the
manifest and the safetensors headers. Failures are one `error: <file>: <what>` line, exit 2.
"""

import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkiln.errors import QkilnError, exit_with, permission_error

from .artifact import (MANIFEST_NAME, check_finished_name, check_not_unchecked, read_manifest,
                       read_tensor_index, serving_digest, verify_artifact, weight_shards)
from .artifact_archive import is_archive, unpacked


def verify_cmd(
    path: Annotated[Path, typer.Argument(help="artifact directory, or an archive (.tar, .tar.gz), or an ONNX engine "
                                              "folder (qkiln export --format onnx)")],
    check_target: Annotated[bool, typer.Option(help="also refuse an artifact this machine cannot run")] = True,
    engines: Annotated[bool, typer.Option("--engines",
                                          help="also check engines/onnx/ against the artifact's weights")] = False,
    artifact: Annotated[Optional[Path],
                        typer.Option(help="for an engine folder: also check it is this artifact's engine")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as one JSON object on stdout (ok, "
                                                         "kind, name, digest, files; or ok false and error)")] = False,
):
    """Check the manifest version, target and every file's size and sha256 (no weights loaded),
    the weights' headers and the architecture against them;
    with --engines, also that engines/onnx/ is the engine this qkiln builds from the weights and
    computes what they compute (two paged steps). An engine folder on its own: its files against
    engine.json's sha256 and digest, and with --artifact, as --engines checks an artifact's."""
    try:
        if _is_engine_folder(path):
            result = _verify_engine_folder(path, artifact)
        elif artifact is not None:
            raise QkilnError(f"--artifact is for an ONNX engine folder; {path} is not one (use --engines for an "
                             "artifact's own engine)")
        else:
            from qkiln.runtime.config import artifact_config  # no torch

            with ExitStack() as stack:
                verified, num_files = _verified(stack, path, check_target)
                m = read_manifest(verified)
                artifact_config(verified, m)  # the architecture against the weights, as a loader checks it
                result = {"ok": True, "kind": "artifact", "name": m.name, "digest": m.digest,
                          "serving_digest": serving_digest(m), "files": num_files,
                          "engines": _check_onnx_engine(verified) if engines else None}
    except (QkilnError, PermissionError) as e:
        error = permission_error(e) if isinstance(e, PermissionError) else e
        if as_json:  # the one object a pipeline parses, then the usual error line and exit status
            print(json.dumps({"ok": False, "error": str(error)}))
        exit_with(error)
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    engines = result["engines"]
    checked = "" if engines is None else \
        f"; onnx engine {engines}" if engines == _NOT_CHECKED else f"; onnx engine checked: {engines}"
    if result["kind"] == "artifact":
        print(f"ok: {result['files']} files verified (artifact {result['name']!r}, digest {result['digest']}){checked}")
    else:
        made_from = result["exported_from"]
        print(f"ok: ONNX engine, {result['files']} files match engine.json's sha256 (exported from artifact "
              f"{made_from.get('name')!r}, recipe {made_from.get('recipe')})"
              + (checked or "; --artifact ARTIFACT also checks it is that artifact's engine"))


_NOT_CHECKED = "not checked"  # the two-step check did not fit this machine's memory (it said why)


def _verified(stack: ExitStack, path: Path, check_target: bool) -> tuple[Path, int]:
    """An artifact directory verified, or an archive unpacked (for as long as `stack` lives), which
    verifies it as it unpacks: (its directory, its number of files)."""
    if is_archive(path):
        artifact = Path(stack.enter_context(unpacked(str(path), check_target=check_target)))
        return artifact, len(read_manifest(artifact).files)
    return Path(path), len(verify_artifact(path, check_target=check_target))


def _is_engine_folder(path: Path) -> bool:
    from .onnx_contract import CONTRACT_FILE

    return path.is_dir() and (path / CONTRACT_FILE).is_file() and not (path / MANIFEST_NAME).exists()


def _verify_engine_folder(path: Path, artifact: Path | None) -> dict:
    from .export_onnx import verify_engine_files

    contract = verify_engine_files(path)
    checked = None
    if artifact is not None:
        with ExitStack() as stack:
            verified, _ = _verified(stack, artifact, check_target=False)  # an engine may be checked anywhere
            checked = _check_onnx_engine(verified, path)
    return {"ok": True, "kind": "onnx_engine", "files": len(contract["files"]), "digest": contract.get("digest"),
            "exported_from": contract.get("artifact", {}), "engines": checked}


def _check_onnx_engine(artifact: Path, engine_dir: Path | None = None) -> str:
    """The two-step check's summary, or _NOT_CHECKED."""
    from .export_onnx import check_artifact_engine

    check = check_artifact_engine(artifact, log=lambda msg: print(msg, file=sys.stderr), engine_dir=engine_dir)
    return check.summary() if check else _NOT_CHECKED


def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="artifact directory, or an archive (.tar, .tar.gz)")],
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
):
    """Name, recipe, sizes, compression ratio, accuracy, provenance and toolchain (no weights loaded)."""
    try:
        with unpacked(str(path)) as artifact:
            summary = summarize_artifact(Path(artifact))
    except QkilnError as e:
        exit_with(e)
    if as_json:  # whole: a registry keys on digest / files and reads the recipe as written
        print(json.dumps(summary, indent=2, sort_keys=True))
        return
    for line in _format_summary(summary):
        print(line)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _short(d: dict | None, max_chars: int = 100) -> dict | None:
    """Scalars and small containers as they are; long ones (per-layer tables) as a count."""
    if d is None:
        return None
    return {k: v if len(json.dumps(v)) <= max_chars else f"<{len(v)} entries>" for k, v in sorted(d.items())}


def summarize_artifact(path) -> dict:
    """What `inspect` shows. Sizes come from the manifest and the shard headers; the bf16 size of
    the source is read from whichever of these the build recorded: `source_bytes_bf16`,
    `source.bytes_bf16` / `source.source_bytes_bf16`, or 2 x `num_parameters`."""
    root = Path(path)
    check_finished_name(root)
    check_not_unchecked(root, {p.name for p in root.iterdir()} if root.is_dir() else ())  # copied mid-check
    m = read_manifest(root)
    index = read_tensor_index(root, m)
    by_dtype = Counter()
    for info in index.values():
        by_dtype[info.dtype] += info.nbytes
    weights_bytes = sum(m.files[rel]["size"] for rel in weight_shards(m))
    num_parameters = _first(m.num_parameters, m.source.get("num_parameters"), m.architecture.get("num_parameters"))
    source_bf16 = _first(m.source_bytes_bf16, m.source.get("bytes_bf16"), m.source.get("source_bytes_bf16"),
                         2 * num_parameters if isinstance(num_parameters, int) else None)
    linears = m.quantization.get("linears", {})  # per-linear entries, see compile/artifact_tensors.py
    schemes = Counter(str(v.get("scheme")) for v in linears.values() if isinstance(v, dict) and "scheme" in v)
    engines: dict[str, int] = {}  # engines/<name>/...: bytes per engine
    for rel, entry in m.files.items():
        if rel.startswith("engines/") and rel.count("/") >= 2:
            name = rel.split("/")[1]
            engines[name] = engines.get(name, 0) + entry["size"]
    return {
        "name": m.name,
        "format_version": m.format_version,
        "architecture": m.architecture,  # what a registry filters on: family, sizes, context, sampling defaults
        "target": m.target,
        "recipe": m.recipe,
        "quantization": {"num_entries": len(linears), "schemes": dict(sorted(schemes.items())),
                         # linears whose algorithm could not run (GPTQ on a singular Hessian: RTN)
                         "fallbacks": dict(sorted((m.recipe.get("fallbacks") or {}).items()))},
        "kv_cache": m.kv_cache,
        "sizes": {
            "weights_bytes": weights_bytes,
            "num_shards": len(weight_shards(m)),
            "num_tensors": len(index),
            "tensor_bytes_by_dtype": dict(sorted(by_dtype.items())),
            "total_bytes": sum(e["size"] for e in m.files.values()),
            "num_parameters": num_parameters,
            "source_bytes_bf16": source_bf16,
            "compression_ratio": round(source_bf16 / weights_bytes, 3) if source_bf16 and weights_bytes else None,
        },
        "engines": dict(sorted(engines.items())),
        "accuracy": m.accuracy,
        "calibration": m.calibration,
        "source": m.source,
        "toolchain": m.toolchain,
        "created": m.created,
        "digest": m.digest,  # sha256 of the manifest, which holds every file's sha256
        "serving_digest": serving_digest(m),  # the same for builds that differ only in names and reports
        "files": m.files,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def _accuracy_line(acc: dict | None) -> str:
    """The headline numbers in words; whatever else the report holds is in `inspect --json`."""
    if not acc or "perplexity" not in acc:
        return json.dumps(acc, sort_keys=True)
    words = [f"perplexity {acc['perplexity']:.3f}"]
    if "perplexity_change" in acc and "reference_perplexity" in acc:
        words[0] += f" ({acc['perplexity_change']:+.2%} vs the source's {acc['reference_perplexity']:.3f})"
    if "bits_per_byte" in acc:
        words.append(f"bits/byte {acc['bits_per_byte']:.4f}")
    if "kl_divergence" in acc:
        words.append(f"KL {acc['kl_divergence']:.4f} nats/token")
    if "top1_agreement" in acc:
        words.append(f"top-1 {acc['top1_agreement']:.1%}")
    protocol = acc.get("protocol") or {}
    if "num_tokens" in acc:
        words.append(f"{acc['num_tokens']} tokens of {Path(str(protocol.get('data', '?'))).name}")
    return ", ".join(words)


def _target_words(target: dict) -> str:
    cc = target.get("min_compute_capability")
    return str(target.get("device")) + (f", compute capability >= {cc}" if cc else "")


def _scheme_words(scheme: dict) -> str:
    """A recipe's scheme as a reader says it: `int4 asym g128 (gptq), lm_head int8 per-channel, ...`."""
    def numbers(q: dict | None, what: str) -> str:
        if not q:
            return f"{what} unquantized"
        kind = f"{'fp' if q.get('type') == 'float' else 'int'}{q.get('num_bits')}"
        sym = "" if q.get("type") == "float" else (" sym" if q.get("symmetric") else " asym")
        group = f" g{q['group_size']}" if q.get("group_size") else " per-channel"
        return f"{what} {kind}{sym}{group}"

    weights = numbers(scheme.get("weights"), "weights")
    if scheme.get("weights"):
        weights += f" ({scheme.get('algorithm')})"
    acts = scheme.get("activations")
    acts = (f"activations fp{acts.get('num_bits')} {'dynamic per token' if acts.get('dynamic') else 'static'}"
            if acts else "activations 16-bit")
    kv = scheme.get("kv_cache")
    kv = f"KV {kv['dtype']}" + (f" g{kv['group_size']}" if kv["dtype"] == "int4" else "") if kv else "KV 16-bit"
    return ", ".join([weights, numbers(scheme.get("lm_head"), "lm_head"), acts, kv])


def _architecture_words(a: dict) -> str:
    """The model in words: family, layers, sizes, context; the sampling values it recommends."""
    get = lambda key: a.get(key, "?")  # noqa: E731  a manifest of a newer minor may lack a field
    words = (f"{get('architecture')}, {get('num_hidden_layers')} layers, hidden {get('hidden_size')}, "
             f"{get('num_attention_heads')} / {get('num_key_value_heads')} heads, vocabulary {get('vocab_size')}, "
             f"context {get('max_position_embeddings')}")
    defaults = a.get("sampling_defaults")
    return words + (f"; recommends {json.dumps(defaults, sort_keys=True)}" if defaults else "")


def _fallback_words(fallbacks: dict[str, str], max_names: int = 3) -> str:
    """`; 2 fell back: model.layers.3.mlp.down_proj (rtn), ...` or nothing."""
    if not fallbacks:
        return ""
    names = [f"{name} ({how})" for name, how in list(fallbacks.items())[:max_names]]
    more = f", ... ({len(fallbacks) - max_names} more, inspect --json)" if len(fallbacks) > max_names else ""
    return f"; {len(fallbacks)} fell back: {', '.join(names)}{more}"


def _format_summary(s: dict) -> list[str]:
    sizes = s["sizes"]
    dtypes = ", ".join(f"{k} {_size(v)}" for k, v in sizes["tensor_bytes_by_dtype"].items()) or "none"
    ratio = f"{sizes['compression_ratio']}x vs bf16 source ({_size(sizes['source_bytes_bf16'])})" \
        if sizes["compression_ratio"] else "unknown (manifest records no source size)"
    lines = [
        f"name:         {s['name']} (format {s['format_version']})",
        f"model:        {_architecture_words(s['architecture'])}",
        f"target:       {_target_words(s['target'])}",
        f"recipe:       {s['recipe'].get('name') or 'unnamed'}: {_scheme_words(s['recipe'].get('scheme') or {})} "
        f"(inspect --json: all of it)",
        f"quantization: {s['quantization']['num_entries']} linears {json.dumps(s['quantization']['schemes'])}"
        + _fallback_words(s["quantization"]["fallbacks"]),
        f"kv cache:     {json.dumps(_short(s['kv_cache']), sort_keys=True)}",
        f"weights:      {_size(sizes['weights_bytes'])} in {sizes['num_shards']} shard(s), "
        f"{sizes['num_tensors']} tensors ({dtypes})",
        f"compression:  {ratio}",
        f"engines:      {', '.join(f'{k} ({_size(v)})' for k, v in s['engines'].items()) or 'none'}",
        f"accuracy:     {_accuracy_line(s['accuracy'])}",
        f"calibration:  {json.dumps(s['calibration'], sort_keys=True)}",
        f"source:       {json.dumps(s['source'], sort_keys=True)}",
        f"toolchain:    {json.dumps(s['toolchain'], sort_keys=True)}",
        f"digest:       {s['digest']} ({len(s['files'])} files)",
        f"serving:      {s['serving_digest']} (weights, tokenizer and layout; names and reports left out)",
    ]
    return lines
