"""The `qkiln` command line: subcommands are thin wrappers over the library's public API.

Every user-facing failure is a `QkilnError`, printed as one `error: ...` line with a non-zero
exit code; anything else is a bug and keeps its traceback.
"""

import errno
import os
import signal
import socket
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
import typer.core

from qkiln.bench.cli import Int8Activations, bench_app  # imports nothing heavy
from qkiln.compile.artifact_archive import unpacked
from qkiln.compile.artifact_cli import inspect_cmd, verify_cmd  # imports nothing heavy
from qkiln.compile.eval_cli import eval_cmd  # imports nothing heavy
from qkiln.errors import ArtifactError, QkilnError, exit_on_error, exit_with

KvDtype = Annotated[Optional[str], typer.Option(
    help="KV cache dtype: bf16, fp16, fp32, fp8 or int4 (default: the artifact's KV scheme, else the activation dtype)")]
DensePrefill = Annotated[bool, typer.Option(
    help="CPU: an artifact's int4 / int8 linears also keep a dense copy (bf16, 2 bytes a weight; fp32 on CPUs "
         "without fast bf16) for prompts' many-row GEMMs; --no-dense-prefill computes prompts from the codes: "
         "less memory, slower prefill")]

try:  # typer 0.29 vendors click; before, it used click itself
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:
    from click.exceptions import NoArgsIsHelpError, UsageError


class _OneLineUsageError(UsageError):
    def show(self, file=None) -> None:
        command = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        print(f"error: {self.format_message()}{command}", file=file or sys.stderr)


@contextmanager
def _one_line_usage_errors():
    try:
        yield
    except UsageError as e:
        if isinstance(e, (_OneLineUsageError, NoArgsIsHelpError)):
            raise
        raise _OneLineUsageError(e.format_message(), e.ctx) from None


class _OneLineErrors(typer.core.TyperGroup):
    """A malformed command line gets one `error:` line and exit 2, as every other refusal does
    (click printed a usage block with `Error:` on its fourth line, which `grep ^error:` missed)."""

    def make_context(self, *args, **kwargs):
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(help="qkiln: calibrate, quantize, compile and serve LLMs.", no_args_is_help=True, cls=_OneLineErrors,
                  pretty_exceptions_enable=False, rich_markup_mode=None)  # help texts say [default: ...]


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"qkiln {version('qkiln')}")
        raise typer.Exit()


@app.callback()
def _root(show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                     help="print qkiln's version and exit")] = False):
    """qkiln: calibrate, quantize, compile and serve LLMs."""


app.command("eval")(eval_cmd)  # first in --help: the command most runs start with


@app.command("build")
def build_cmd(
    source: Annotated[str, typer.Argument(help="source model: alias (smollm2-135m), HF dir or .gguf")],
    recipe: Annotated[str, typer.Option(help="preset (w4a16-gptq, fp8-w8a8+kv-fp8, ...) or YAML/TOML file")],
    out: Annotated[Path, typer.Option("-o", "--out", help="artifact directory to create")],
    calib: Annotated[Optional[str], typer.Option(help="calibration data: bundled:NAME, file:PATH, jsonl:PATH, hf:NAME:SPLIT, self:N, mix:A+B [default: the recipe's, else mix:bundled:wikitext2-valid+bundled:pride-and-prejudice]")] = None,
    num_samples: Annotated[Optional[int], typer.Option(help="calibration samples [default: the recipe's, else 128]")] = None,
    target: Annotated[Optional[str], typer.Option(help="cpu or cuda [default: the recipe's, else cpu]")] = None,
    eval_data: Annotated[Optional[str], typer.Option(help="text file (or JSONL, as eval's --data) for the accuracy report [default: the recipe's, else none]")] = None,
    eval_tokens: Annotated[Optional[int],
                           typer.Option(help="tokens scored in the accuracy report, as eval's --eval-tokens [default: the recipe's, else 4096; eval's is 16384]")] = None,
    eval_seq_len: Annotated[Optional[int], typer.Option(help="window length of the accuracy report, as eval's --seq-len [default: the recipe's, else 512]")] = None,
    archive: Annotated[Optional[Path], typer.Option(help="also write the artifact as one .tar/.tar.gz")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing artifact (and --archive file)")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="ignore the per-layer build cache")] = False,
    engine: Annotated[Optional[list[str]], typer.Option(help="also write engines/NAME/, checked against the artifact: onnx")] = None,
):
    """Calibrate, quantize, evaluate and write a verified artifact."""

    from tqdm import tqdm

    from qkiln.compile.artifact import is_artifact_dir
    from qkiln.compile.artifact_archive import check_archive_path, write_archive
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    try:
        r = load_recipe(recipe)
        cal = {k: v for k, v in (("source", calib), ("num_samples", num_samples)) if v is not None}
        ev = {k: v for k, v in (("data", eval_data), ("max_tokens", eval_tokens), ("seq_len", eval_seq_len))
              if v is not None}
        # a warning while a progress bar is drawn (the layer cache's) goes on a line of its own
        log = lambda msg: tqdm.write(msg, file=sys.stderr)  # noqa: E731
        if (eval_tokens, eval_seq_len) != (None, None) and r.evaluation.data is None and eval_data is None:
            log("note: --eval-tokens / --eval-seq-len apply with --eval-data (or the recipe's evaluation.data); "
                "no accuracy report")
            ev = {}
        if cal and not r.needs_calibration:  # nor recorded: the manifest (its digest) stays what the build used
            log(f"note: recipe {r.name} calibrates nothing (data-free), so --calib / --num-samples are not used")
            cal = {}
        r = r.with_overrides(calibration=cal, evaluation=ev, target=target or r.target)
        if archive:
            check_archive_path(archive, overwrite=force)  # before the build, which takes minutes
            if not force and is_artifact_dir(out) and not archive.exists():
                # a build killed while archiving left the artifact without it (probe s48)
                raise ArtifactError(f"{out}: already exists, its --archive {archive} does not (a build stopped while "
                                    "writing it?); pass --force to build both again")
        result = build(source, r, out, overwrite=force, use_cache=not no_cache, log=log, engines=tuple(engine or ()))
        if archive:
            try:
                write_archive(result.path, archive)
            except QkilnError as e:  # a retry must know the artifact is there (and pass --force)
                raise type(e)(f"the artifact {result.path} was written, its archive was not: {e}") from None
    except QkilnError as e:
        exit_with(e)
    acc = result.manifest.accuracy
    ppl = f"perplexity {acc['perplexity']:.3f} ({acc['perplexity_change']:+.2%} vs the source model in fp32)" \
        if "perplexity" in acc else "no accuracy report"
    print(f"built {result.path} in {result.seconds:.1f} s: {result.num_cached_layers}/{result.num_layers} "
          f"layers from cache, {ppl}")
    print(f"next: qkiln inspect {result.path}; qkiln generate {result.path} --prompt TEXT; "
          f"qkiln serve {result.path}", file=sys.stderr)


@app.command("generate")
def generate_cmd(
    model: Annotated[str, typer.Argument(help="artifact dir or archive (.tar, .tar.gz), or source model (alias, HF dir, .gguf)")],
    prompt: Annotated[Optional[str], typer.Option(help="text to continue (or the user message with --chat)")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="read the prompt from this UTF-8 file ('-': stdin), "
                                                        "for one too long for a command line")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate at most")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling threshold (1 = off)")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample from the k most likely tokens (-1 or 0 = off)")] = -1,
    seed: Annotated[Optional[int], typer.Option(help="sampling seed")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="divide a positive logit of a token already in the "
                                                      "prompt or output by this, multiply a negative one (1 = off)")] = 1.0,
    min_p: Annotated[float, typer.Option(help="drop tokens less likely than this x the top token (0 = off)")] = 0.0,
    chat: Annotated[bool, typer.Option("--chat", help="wrap the prompt in the model's chat template")] = False,
    dtype: Annotated[str, typer.Option(help="activation dtype: auto, bf16, fp16, fp32")] = "auto",
    kv_dtype: KvDtype = None,
    int8_activations: Int8Activations = False,
    dense_prefill: DensePrefill = True,
):
    """Generate from one prompt and stream the text to stdout."""
    from qkiln.runtime.llm import LLM
    from qkiln.runtime.sampling_params import SamplingParams

    try:
        # a bad option is refused before the model loads
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, repetition_penalty=repetition_penalty, min_p=min_p)
        prompt = _prompt_text(prompt, prompt_file)
        with unpacked(model) as path:
            llm = LLM(path, dtype=dtype, int8_activations=int8_activations, max_num_seqs=1, kv_dtype=kv_dtype,
                      dense_prefill=dense_prefill)
            # serve and LLM.generate apply the model's recommended values; this command's options stand
            unused = {k: v for k, v in llm.engine.sampling_defaults.items() if getattr(params, k) != v}
            if unused:
                print(f"note: the model recommends {unused} (its generation config); qkiln generate samples with "
                      "its own options (greedy unless --temperature): pass them to follow it", file=sys.stderr)
            tok = llm.tokenizer
            ids = tok.chat_prompt_ids([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
            llm.engine.add_request(ids, params)
            out = None
            try:
                while llm.engine.has_unfinished():
                    for out in llm.engine.step():
                        print(out.new_text, end="", flush=True)
                print()
            except BrokenPipeError:  # the reader left (`| head`): stop generating, a success under pipefail
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
                out = None
            if out is not None and out.finish_reason == "length" and len(out.token_ids) < max_tokens:
                print(f"note: stopped after {len(out.token_ids)} of --max-tokens {max_tokens}: with the prompt's "
                      f"{len(ids)} tokens they fill the {llm.engine.max_request_len} tokens a request may reach",
                      file=sys.stderr)
    except QkilnError as e:
        exit_with(e)


def _prompt_text(prompt: str | None, prompt_file: Path | None) -> str:
    """--prompt, or --prompt-file's text ('-': stdin); exactly one of them."""
    if (prompt is None) == (prompt_file is None):
        raise QkilnError("give the prompt as --prompt TEXT or --prompt-file PATH (one of them)")
    if prompt_file is None:
        return prompt
    try:
        return sys.stdin.read() if str(prompt_file) == "-" else prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise QkilnError(f"--prompt-file {prompt_file}: cannot be read as UTF-8 text ({e})") from None


@app.command("serve")
def serve_cmd(
    model: Annotated[str, typer.Argument(help="artifact dir or archive (.tar, .tar.gz), or source model (alias, HF dir, .gguf)")],
    host: Annotated[str, typer.Option(help="address to bind (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="QKILN_API_KEY", help="require 'Authorization: Bearer KEY'")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="requests batched together at most")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="token budget per engine step")] = 1024,
    long_prefill_token_threshold: Annotated[int, typer.Option(min=0, help="cap one prompt's chunk per step at this many tokens, so requests behind a long prompt start sooner (0: no cap)")] = 0,
    enable_chunked_prefill: Annotated[bool, typer.Option(help="cut prompts where the step's budget runs out; off: only at fixed positions, so a prompt's logprobs repeat whatever else runs (evaluation jobs; a decode may then wait a step for prompts)")] = True,
    enable_prefix_caching: Annotated[bool, typer.Option(help="reuse the KV of prompt prefixes seen before; off: a prompt's first answer is its answer every time (evaluation jobs)")] = True,
    max_model_len: Annotated[Optional[int], typer.Option(min=1, help="context length, at most the model's (default: the model's); the RoPE tables cover only this many positions (a 1M-token context's take 1.6 GB at head_dim 128)")] = None,
    kv_cache_mb: Annotated[int, typer.Option("--kv-cache-mb", "--kv-cache-mib", min=1, help="KV cache pool size in MiB")] = 512,
    dtype: Annotated[str, typer.Option(help="activation dtype: auto, bf16, fp16, fp32")] = "auto",
    kv_dtype: KvDtype = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="name clients send as 'model'")] = None,
    int8_activations: Int8Activations = False,
    dense_prefill: DensePrefill = True,
    shutdown_timeout: Annotated[float, typer.Option(min=0, help="on SIGTERM / Ctrl-C, seconds to let requests in flight finish before they are aborted")] = 5.0,
    allowed_origin: Annotated[Optional[list[str]], typer.Option(help="an origin browsers may call from (CORS), e.g. https://app.example; repeat for more, '*' for any; none by default")] = None,
    max_concurrent_requests: Annotated[int, typer.Option(min=1, help="requests running or queued at once (a request with n choices counts n); past it new ones get 429 with Retry-After")] = 4096,
    generation_config: Annotated[str, typer.Option(help="'auto': sampling fields a request leaves out take the model's generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as in vLLM; 'vllm': the API's own defaults")] = "auto",
    log_level: Annotated[Literal["critical", "error", "warning", "info", "debug"], typer.Option("--log-level", "--uvicorn-log-level", help="the server's log lines from this level up (uvicorn's and qkiln's; --enable-log-requests' lines whatever it says)")] = "info",
    disable_access_log: Annotated[bool, typer.Option("--disable-access-log", "--disable-uvicorn-access-log", help="no line per HTTP request (health probes and scrapes write one each)")] = False,
    enable_log_requests: Annotated[bool, typer.Option("--enable-log-requests", help="a line when a request is received, finishes or is aborted: its id (x-request-id), token counts, latencies")] = False,
):
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics)."""
    from qkiln.runtime.async_engine import AsyncLLMEngine
    from qkiln.runtime.server import check_allowed_origins, serve

    _check_port_free(host, port)  # before the model loads (seconds to minutes)
    try:
        check_allowed_origins(allowed_origin)
    except QkilnError as e:
        exit_with(e)
    for option, value in (("--api-key", api_key), ("--served-model-name", served_model_name)):
        if value == "":  # a template's unset variable: an empty key had required an empty token, a name fell back
            exit_with(QkilnError(f"{option} is empty: give one, or leave the option out"))
    with ExitStack() as stack:  # an archive's unpacked folder lives as long as the server
        try:
            path = stack.enter_context(unpacked(model))
            engine = AsyncLLMEngine.from_model(path, dtype=dtype, name=served_model_name,
                                               int8_activations=int8_activations, log_requests=enable_log_requests,
                                               dense_prefill=dense_prefill,
                                               max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               long_prefill_token_threshold=long_prefill_token_threshold,
                                               enable_chunked_prefill=enable_chunked_prefill,
                                               enable_prefix_caching=enable_prefix_caching, kv_dtype=kv_dtype, generation_config=generation_config,
                                               max_model_len=max_model_len, kv_cache_bytes=kv_cache_mb << 20)
        except QkilnError as e:
            exit_with(e)
        core = engine.engine
        print(f"KV cache: {core.kv_manager.num_blocks} blocks of {core.config.block_size} tokens "
              f"({core.kv_manager.num_blocks * core.config.block_size} tokens, {core.kv_dtype}"
              f"{f' in groups of {core.config.kv_group_size}' if core.kv_dtype == 'int4' else ''}, "
              f"{core.kv_pool_bytes / 2**20:.0f} MiB)", file=sys.stderr)
        if engine.sampling_defaults:  # as vLLM says it: a request's defaults are not the API's
            print(f"note: requests that leave them out take the model's generation_config.json sampling values "
                  f"{engine.sampling_defaults}; --generation-config vllm turns them off", file=sys.stderr)
        if engine.max_request_len < engine.max_model_len:
            print(f"note: the KV cache holds {engine.max_request_len} tokens, fewer than the model's context of "
                  f"{engine.max_model_len}: a request (prompt and output) is limited to that; raise --kv-cache-mb "
                  "to serve the whole context", file=sys.stderr)
        url_host = f"[{host}]" if ":" in host else host
        serve(engine, host=host, port=port, api_key=api_key, shutdown_timeout=shutdown_timeout,
              log_level=log_level, access_log=not disable_access_log,
              allowed_origins=allowed_origin, max_concurrent_requests=max_concurrent_requests,
              on_listening=lambda bound: print(f"serving {engine.name!r} on http://{url_host}:{bound}/v1",
                                               file=sys.stderr, flush=True))


def _check_port_free(host: str, port: int) -> None:
    try:  # the address family the host resolves to (an IPv6 host, a name), SO_REUSEADDR as uvicorn binds
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        exit_with(QkilnError(f"cannot resolve --host {host} ({e.strerror or e}); give an address of this machine "
                             "(127.0.0.1, 0.0.0.0, ::1) or a name that resolves to one"))
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        hint = "pick another --port or stop what holds it" if e.errno == errno.EADDRINUSE else \
            "pick another --port, or a --host address of this machine"
        exit_with(QkilnError(f"cannot listen on {host}:{port} ({e.strerror or e}); {hint}"))


app.command("verify")(verify_cmd)
app.command("inspect")(inspect_cmd)


def main():
    # SIGTERM (CI cancelling a job, docker stop) ends a command as Ctrl-C does: a build's partial
    # output is removed on the way out (the default handler killed it and left hundreds of MB)
    signal.signal(signal.SIGTERM, _terminated)
    with exit_on_error():  # what a command's own `except QkilnError` leaves: a PermissionError
        app()


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


app.add_typer(bench_app, name="bench")


@app.command("export")
def export_cmd(
    artifact: Annotated[Path, typer.Argument(help="artifact directory, or an archive (.tar, .tar.gz)")],
    out: Annotated[Path, typer.Option("-o", "--out", help="directory to create")],
    format: Annotated[str, typer.Option("--format", help="compressed-tensors (a Hugging Face checkpoint) or onnx (an engine)")] = "compressed-tensors",
    drop_kv: Annotated[bool, typer.Option("--drop-kv", help="compressed-tensors: the weights only, without the KV-cache scheme")] = False,
    force: Annotated[bool, typer.Option("--force", help="replace an earlier export")] = False,
    no_check: Annotated[bool, typer.Option("--no-check", help="onnx: skip running the engine against the artifact")] = False,
):
    """Write the artifact as a checkpoint vLLM / transformers load, checked bit for bit after writing
    (transformers: asymmetric int4 with CompressedTensorsConfig(dequantize=True), README),
    or as an ONNX engine (paged-attention plugin nodes), checked against the artifact over two steps."""
    from qkiln.compile.export_compressed_tensors import export_compressed_tensors
    from qkiln.compile.export_onnx import export_onnx

    try:
        if format not in ("compressed-tensors", "onnx"):
            raise QkilnError(f"unknown export format {format!r}; use compressed-tensors or onnx")
        if format == "onnx" and drop_kv:
            raise QkilnError("--drop-kv applies to compressed-tensors; an ONNX engine always holds its KV cache")
        if format != "onnx" and no_check:  # it would have been ignored: that check reads back what was written
            raise QkilnError("--no-check applies to --format onnx; a compressed-tensors export is always checked "
                             "(a read-back of what it wrote, seconds)")
        with unpacked(str(artifact)) as path:
            if format == "onnx":
                result = export_onnx(Path(path), out, overwrite=force, verify=not no_check,
                                     log=lambda msg: print(msg, file=sys.stderr))
            else:
                result = export_compressed_tensors(Path(path), out, drop_kv=drop_kv, overwrite=force)
    except QkilnError as e:
        exit_with(e)
    if format == "onnx":
        checked = f"checked: {result.check.summary()}" if result.check else "not checked"
        print(f"exported an ONNX engine ({result.num_nodes} nodes, {result.bytes / 2**20:.1f} MiB) to {result.path}; "
              + checked)
    else:
        print(f"exported {result.num_linears} quantized linears to {result.path} (verified with compressed-tensors)")


@app.command("import")
def import_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="quantized HF directory: compressed-tensors, GPTQ or AWQ")],
    out: Annotated[Path, typer.Option("-o", "--out", help="artifact directory to create")],
    target: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    force: Annotated[bool, typer.Option("--force", help="replace an existing artifact (what qkiln wrote, nothing else)")] = False,
):
    """Convert a quantized checkpoint into a verified artifact (weights kept bit for bit)."""
    from qkiln.compile.import_checkpoint import import_checkpoint

    try:
        path = import_checkpoint(checkpoint, out, target=target, overwrite=force)
    except QkilnError as e:
        exit_with(e)
    print(f"imported {checkpoint} into {path}")
