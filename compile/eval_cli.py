"""`qkiln eval`: perplexity, bits per byte and KL / top-1 agreement from the command line.

Owns the typer command function (registered by qkiln/cli.py) and the checks it makes before a
model loads; the scoring itself is compile/evaluate.py. The report is written whole or not at all
(--json), then printed.
"""

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkiln.errors import CalibrationDataError, QkilnError, exit_with

from .artifact_archive import unpacked


def eval_cmd(
    model: Annotated[str, typer.Argument(help="source model (alias, HF dir, .gguf), artifact dir or artifact archive (.tar, .tar.gz)")],
    data: Annotated[str, typer.Option(help="text file scored exactly as stored (UTF-8); or a JSONL file's documents joined by a blank line: FILE.jsonl (field text) or jsonl:FILE#FIELD")],
    seq_len: Annotated[int, typer.Option(help="window length in tokens")] = 512,
    max_tokens: Annotated[int, typer.Option("--eval-tokens", "--max-tokens", help="score the first T tokens of the file (as build's --eval-tokens; --max-tokens is the older name)")] = 16384,
    reference: Annotated[Optional[str], typer.Option(help="model to compare against (KL, top-1)")] = None,
    batch_size: Annotated[int, typer.Option(help="windows per forward pass")] = 4,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the report here")] = None,
    int8_activations: Annotated[bool, typer.Option("--int8-activations", help="score an artifact as served with --int8-activations")] = False,
    engine: Annotated[Optional[str], typer.Option(help="score the artifact's engines/onnx/ instead of its simulation, run by onnx (the reference evaluator) or onnxruntime")] = None,
    ort_accuracy_level: Annotated[int, typer.Option(help="--engine onnxruntime: MatMulNBits accuracy level, 0 float activations .. 4 int8 (ONNX Runtime's default)")] = 0,
    served: Annotated[bool, typer.Option("--served", help="score as `qkiln serve` computes: the runtime engine, its dtype and paged KV cache (no KL)")] = False,
    dtype: Annotated[str, typer.Option(help="--served: auto (bf16), bf16, fp16 or fp32, as `serve --dtype`")] = "auto",
):
    """Perplexity, bits per byte and (with --reference) KL / top-1 agreement on a pinned protocol."""
    from .evaluate import check_reference, check_window, evaluate
    from .model_ref import open_model

    try:
        _check_eval_options(data, json_out, int8_activations, engine, ort_accuracy_level, served, dtype, reference)
        with unpacked(model) as path, unpacked(reference) if reference else nullcontext() as ref_path:
            m = _open_scorer(path, int8_activations, engine, ort_accuracy_level, served, dtype)
            config = m.config if hasattr(m, "config") else m.model.config
            check_window("--seq-len", seq_len, m.tokenizer.add_bos, config.max_position_embeddings)
            ref = open_model(ref_path) if reference else None
            if ref is not None:
                check_reference(m.tokenizer, ref.tokenizer, (config.vocab_size, ref.model.config.vocab_size),
                                ref.model.config.max_position_embeddings, seq_len)
                _warn_if_swapped(getattr(m, "description", {}), ref.description)
            report = evaluate(m, m.tokenizer, data, seq_len, max_tokens, reference=ref, batch_size=batch_size)
    except QkilnError as e:
        exit_with(e)
    report["model"] = model
    report |= {k: v for k, v in getattr(m, "description", {}).items()
               if k in ("sha256", "digest", "scoring", "kernels")}
    from .artifact import toolchain_versions

    report["toolchain"] = toolchain_versions()  # the versions that computed it move its last digits too
    if engine:
        report["engine"] = engine
    if engine == "onnxruntime":
        report["ort_accuracy_level"] = ort_accuracy_level
    if int8_activations:
        report["int8_activations"] = True
    if reference:
        report["reference"] = reference
    _write_report(json.dumps(report, indent=2), json_out)


def _check_eval_options(data: str, json_out: Path | None, int8_activations: bool, engine: str | None,
                        ort_accuracy_level: int, served: bool, dtype: str, reference: str | None) -> None:
    """Refuse what eval cannot do before the model loads (~20 s for SmolLM2), not after."""
    from qkiln.calib_data import eval_data_file

    from .artifact_writer import check_output_file

    if json_out is not None:  # found out now, not after the whole evaluation
        check_output_file(json_out, "--json")
    data_file = eval_data_file(data)[0]
    if not data_file.is_file():
        raise CalibrationDataError(f"--data {data_file} {'is not a file' if data_file.exists() else 'does not exist'}"
                                   "; give the text file to score")
    if engine not in (None, "onnx", "onnxruntime") or (engine and int8_activations):
        raise QkilnError("--engine takes onnx or onnxruntime, without --int8-activations "
                         "(the engine computes the recipe exactly)")
    if (ort_accuracy_level and engine != "onnxruntime") or not 0 <= ort_accuracy_level <= 4:
        raise QkilnError("--ort-accuracy-level takes 0..4 and applies to --engine onnxruntime")
    if served and (engine or reference):
        raise QkilnError("--served scores target logprobs as the server computes them: without --engine or "
                         "--reference (KL needs whole distributions)")
    if dtype != "auto" and not served:
        raise QkilnError("--dtype applies to --served (the simulation scores in fp32)")
    if data_file.suffix == ".json":
        print(f"note: {data} is scored as the file's text as stored, JSON syntax included; to score its "
              "documents, write them as JSONL (one {\"text\": ...} object a line)", file=sys.stderr)


def _open_scorer(path: str, int8_activations: bool, engine: str | None, ort_accuracy_level: int, served: bool,
                 dtype: str):
    """What scores the windows: an ONNX engine, the serving engine (--served) or the simulation."""
    if engine:
        from .onnx_eval import open_engine

        return open_engine(Path(path), engine, ort_accuracy_level)
    if served:
        from .served_eval import ServedScorer

        return ServedScorer(path, dtype, int8_activations)
    from .model_ref import open_model

    return open_model(path, int8_activations)


def _write_report(text: str, json_out: Path | None) -> None:
    try:
        if json_out:  # first, whole or not at all: stdout may be a pipe its reader closed (| head)
            _write_atomically(json_out, text + "\n")
    except OSError as e:
        print(text)  # the evaluation is not lost
        exit_with(QkilnError(f"--json {json_out}: cannot write the report ({e.strerror or e}); it is printed above"))
    try:
        print(text, flush=True)
    except BrokenPipeError:  # the reader left; the file, if asked for, is written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _warn_if_swapped(model: dict, reference: dict) -> None:
    """KL(reference || model) is not symmetric: an artifact as the reference of its own source is
    almost always the arguments the wrong way round."""
    if model.get("kind") != "artifact" and reference.get("kind") == "artifact" \
            and reference.get("source_sha256") == model.get("sha256"):
        print("note: the reference is an artifact built from the model; KL is taken as KL(reference || model), "
              "so for the artifact's own KL pass the artifact as the model and its source as --reference",
              file=sys.stderr)
