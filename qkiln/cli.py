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


def main():
    app()
