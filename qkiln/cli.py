"""The `qkiln` command line: subcommands are thin wrappers over the library's public API.

Every user-facing failure is a `QkilnError`, printed as one `error: ...` line with a non-zero
exit code; anything else is a bug and keeps its traceback.
"""

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkiln.errors import QkilnError

app = typer.Typer(help="qkiln: calibrate, quantize, compile and serve LLMs.", no_args_is_help=True,
                  pretty_exceptions_enable=False)


@app.callback()
def _root():
    """qkiln: calibrate, quantize, compile and serve LLMs."""


def _fail(e: QkilnError):
    print(f"error: {e}", file=sys.stderr)
    raise typer.Exit(e.exit_code)


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Argument(help="source model (alias, HF dir, .gguf) or artifact dir")],
    data: Annotated[Path, typer.Option(help="text file scored exactly as stored (UTF-8)")],
    seq_len: Annotated[int, typer.Option(help="window length in tokens")] = 512,
    max_tokens: Annotated[int, typer.Option(help="score the first T tokens of the file")] = 16384,
    reference: Annotated[Optional[str], typer.Option(help="model to compare against (KL, top-1)")] = None,
    batch_size: Annotated[int, typer.Option(help="windows per forward pass")] = 4,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the report here")] = None,
):
    """Perplexity, bits per byte and (with --reference) KL / top-1 agreement on a pinned protocol."""
    from qkiln.compile.evaluate import evaluate
    from qkiln.compile.model_ref import open_model

    try:
        m = open_model(model)
        ref = open_model(reference) if reference else None
        report = evaluate(m, m.tokenizer, str(data), seq_len, max_tokens, reference=ref, batch_size=batch_size)
    except QkilnError as e:
        _fail(e)
    report["model"] = model
    if reference:
        report["reference"] = reference
    text = json.dumps(report, indent=2)
    if json_out:
        json_out.write_text(text + "\n")
    print(text)


@app.command("build")
def build_cmd(
    source: Annotated[str, typer.Argument(help="source model: alias (smollm2-135m), HF dir or .gguf")],
    recipe: Annotated[str, typer.Option(help="preset (w4a16-gptq, fp8-w8a8+kv-fp8, ...) or YAML/TOML file")],
    out: Annotated[Path, typer.Option("-o", "--out", help="artifact directory to create")],
    calib: Annotated[Optional[str], typer.Option(help="calibration data: file:PATH, jsonl:PATH, hf:NAME:SPLIT, self:N")] = None,
    num_samples: Annotated[Optional[int], typer.Option(help="calibration samples")] = None,
    target: Annotated[Optional[str], typer.Option(help="cpu or cuda")] = None,
    eval_data: Annotated[Optional[str], typer.Option(help="text file for the accuracy report")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option(help="tokens scored in the accuracy report")] = None,
    archive: Annotated[Optional[Path], typer.Option(help="also write the artifact as one .tar/.tar.gz")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing artifact")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="ignore the per-layer build cache")] = False,
):
    """Calibrate, quantize, evaluate and write a verified artifact."""
    import dataclasses

    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    try:
        r = load_recipe(recipe)
        cal = {k: v for k, v in (("source", calib), ("num_samples", num_samples)) if v is not None}
        ev = {k: v for k, v in (("data", eval_data), ("max_tokens", eval_tokens)) if v is not None}
        r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, **cal),
                                evaluation=dataclasses.replace(r.evaluation, **ev), target=target or r.target)
        log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
        result = build(source, r, out, overwrite=force, use_cache=not no_cache, log=log)
        if archive:
            from qkiln.compile.artifact_writer import write_archive

            write_archive(result.path, archive)
    except QkilnError as e:
        _fail(e)
    acc = result.manifest.accuracy
    ppl = f"perplexity {acc['perplexity']:.3f} ({acc['perplexity_change']:+.2%} vs unquantized)" if "perplexity" in acc else "no accuracy report"
    print(f"built {result.path} in {result.seconds:.1f} s: {result.num_cached_layers}/{result.num_layers} "
          f"layers from cache, {ppl}")


from qkiln.compile.artifact_cli import inspect_cmd, verify_cmd  # noqa: E402  (registered below)

app.command("verify")(verify_cmd)
app.command("inspect")(inspect_cmd)


def main():
    app()
