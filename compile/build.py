"""`qkiln build`: the whole offline stage, from a source model and a recipe to a verified artifact.

    validate recipe against the model            (milliseconds; nothing else has run yet)
    calibration tokens (seeded, hashed)          calib_data/
    weights, layer by layer (cached per layer)    calibrate.py + layer_cache.py
    KV-cache scales                               kv_calibrate.py
    accuracy vs the unquantized model            evaluate.py (one pass: model and reference)
    engines (--engine onnx), checked in place     export_onnx.py
    write the artifact atomically                 artifact_tensors.py + artifact_writer.py
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qkiln.calib_data import eval_data_file, load_text_source, sample_token_set
from qkiln.errors import CalibrationDataError, RecipeError
from qkiln.runtime.memory_limits import available_bytes, release_freed_memory
from qkiln.runtime.source import load_source

from .artifact import Manifest, toolchain_versions
from .artifact_tensors import stored_precision, to_tensors
from .artifact_writer import check_destination, output_path, source_date_epoch, write_artifact
from .calibrate import linear_shapes, quantize_model
from .evaluate import check_window, evaluate, evaluation_tokens
from .export_onnx import ENGINES, check_artifact_engine, onnx_engine_files, require_onnx
from .kv_calibrate import calibrate_kv
from .layer_cache import LayerCache, calibration_numerics, default_cache_dir, layer_key
from .model_ref import LoadedModel
from .recipe import Recipe
from .self_generate import make_self_generator
from .simulate import SIMULATION_SCORING, simulated_kv_backend
from .upcast import compute_in_float32


KV_CALIBRATION_SAMPLES = 16


@dataclass
class BuildResult:
    path: Path
    manifest: Manifest
    seconds: float
    num_cached_layers: int
    num_layers: int
    calibration_seconds: float = 0.0  # quantization and KV calibration only (no load, evaluation or write)


def build(source_name: str, recipe: Recipe, out: Path, overwrite: bool = False, use_cache: bool = True,
          progress: bool = True, log=print, engines: tuple[str, ...] = (),
          on_step: Callable[[str], None] = lambda name: None) -> BuildResult:
    """engines: ("onnx",) also writes engines/onnx/, checked against the artifact before it is
    published (compile/export_onnx.py). on_step(name) is called as each step begins (`qkiln bench
    build-memory` measures them)."""
    start = time.perf_counter()
    check_destination(output_path(out), overwrite)  # a taken path fails now, not after calibration
    source_date_epoch()  # a malformed one, too
    _check_evaluation_data(recipe)
    _check_engines(engines, recipe)
    toolchain = toolchain_versions()  # now: a checkout switched during the build did not build it
    on_step("load source")
    source = load_source(source_name, mapped=True)  # the files' pages: reclaimable, read as needed
    model = compute_in_float32(source.build_model(None))  # as stored; calibration copies a layer at a time
    recipe.validate(linear_shapes(model), source.config.head_dim)  # fail before any work
    scheme = recipe.scheme
    if source.config.tie_word_embeddings and scheme.weights is not None and scheme.lm_head is None \
            and not scheme.is_ignored("lm_head"):  # `ignore` reaches linears, and a tied head is none
        log("note: lm_head is tied to the embeddings and stays in high precision; a recipe's lm_head: section "
            "(an integer scheme) quantizes a copy of it")
    _check_lengths(recipe, source.config.max_position_embeddings, source.tokenizer.add_bos)
    ev = recipe.evaluation
    if ev.data is not None:  # unreadable or too short: said now, not after minutes of calibration
        evaluation_tokens(source.tokenizer, ev.data, ev.seq_len, ev.max_tokens)
    tokens, input_ids = None, None
    if recipe.needs_calibration:
        _check_calibration_memory(recipe, source.config.hidden_size)
        spec = recipe.calibration
        on_step("calibration data")
        text = load_text_source(spec.source, make_self_generator(source, spec.seq_len, progress, warn=log), spec.seed)
        tokens = sample_token_set(text, source.tokenizer, spec.num_samples, spec.seq_len, spec.seed)
        log(f"calibration: {spec.source}, {spec.num_samples} x {spec.seq_len} tokens, sha256 {tokens.sha256[:12]}")
        input_ids = torch.tensor(tokens.input_ids, dtype=torch.int64)  # [num_samples, seq_len]
    weight_scheme = recipe.scheme  # quantize_model ignores kv_cache: KV is calibrated below
    token_sha = tokens.sha256 if tokens is not None and weight_scheme.needs_weight_calibration else None
    scheme_key = {k: v for k, v in weight_scheme.to_dict().items() if k != "kv_cache"}
    # a layer whose linears stay in high precision (a KV-only recipe) is cheaper to recompute than to store
    cache = LayerCache(default_cache_dir() if use_cache and weight_scheme.weights is not None else None, warn=log,
                       reserve=(output_path(out), artifact_reserve_bytes(source.state_dict)),
                       before_write=source.check_unchanged)  # no entry of other weights under its sha256
    calibration_start = time.perf_counter()
    on_step("quantize weights")
    numerics = calibration_numerics() if token_sha else None
    qm = quantize_model(model, weight_scheme, input_ids if token_sha else None, progress=progress, cache=cache,
                        cache_key=lambda i: layer_key(source.sha256, scheme_key, token_sha, i, numerics))
    log(f"weights: {cache.num_hits} of {len(model.model.layers)} layers from the build cache")
    for name, report in qm.report.items():  # recorded in the manifest too, but a build should say it
        if report.get("fallback"):
            log(f"warning: {name} fell back to {report['fallback']}: {report.get('fallback_reason', 'see layers.json')}")
    if recipe.scheme.kv_cache is not None:
        # per-(head, channel) amax settles within a few thousand tokens; a full pass is not needed
        on_step("calibrate kv cache")
        calibrate_kv(model, qm, recipe.scheme.kv_cache, input_ids[:KV_CALIBRATION_SAMPLES], progress=progress,
                     warn=log)
    calibration_seconds = time.perf_counter() - calibration_start
    _round_as_stored(model, qm)
    if recipe.evaluation.data is not None:
        on_step("evaluate accuracy")
    accuracy = _accuracy(source, model, qm, recipe, progress)
    on_step("artifact tensors")
    tensors, quantization = to_tensors(qm)
    manifest = _manifest(source, recipe, tokens, qm, quantization, accuracy, out, toolchain)
    if numerics is not None:  # they decided the codes: a rebuild elsewhere can say why its bytes differ
        manifest.toolchain |= numerics
    reports = {"accuracy.json": accuracy, "layers.json": qm.report}
    tokenizer_files = _tokenizer_files(source)
    if "onnx" in engines:
        on_step("export onnx")
    engine_files = onnx_engine_files(manifest, tensors) if "onnx" in engines else {}
    if engine_files:  # the engine's bytes are onnx's serialization
        import onnx

        manifest.toolchain["onnx"] = onnx.__version__

    num_layers = len(model.model.layers)
    source.check_unchanged()  # everything above read the source's files as they were when hashed
    # the fp32 source and its simulation are done with: the engine check simulates the model in
    # float32 and float64, and held beside them it was the build's peak (main job: 4.4 GiB)
    model = qm = source = None  # rebound, not deleted: the layer cache key function closes over source
    cache.before_write = None  # a method of the source, which it held
    release_freed_memory()

    def check_engine(artifact: Path) -> None:  # on the complete artifact, before it is published
        on_step("check onnx engine")
        check = check_artifact_engine(artifact, log)
        if check is not None:
            log(f"onnx engine checked: {check.summary()}")

    on_step("write artifact")
    path = write_artifact(out, manifest, tensors, tokenizer_files, reports, engines=engine_files,
                          overwrite=overwrite, check=check_engine if engine_files else None)
    seconds = time.perf_counter() - start
    return BuildResult(path, manifest, seconds, cache.num_hits, num_layers, calibration_seconds)


def artifact_reserve_bytes(state_dict: dict) -> int:
    """Free space the layer cache leaves for the artifact on a disk they share: the source's size in
    bf16 (a quantized artifact is smaller; an engine adds about as much again) and 64 MiB."""
    return sum(2 * t.numel() for t in state_dict.values()) + (64 << 20)


def _check_engines(engines: tuple[str, ...], recipe: Recipe) -> None:
    """Refuse, before any work, an engine this build could not write."""
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise RecipeError(f"unknown engine {', '.join(sorted(unknown))}; qkiln writes {', '.join(ENGINES)} "
                          "(no TensorRT plan yet: TensorRT builds one from the ONNX engine)")
    if "onnx" in engines:
        require_onnx()
        w = recipe.scheme.weights
        if w is not None and w.type == "int" and not w.symmetric and w.zero_point == "float":
            raise RecipeError("an ONNX engine holds integer zero points only (DequantizeLinear); this recipe's "
                              "weights use zero_point: float: set zero_point: int, or drop --engine onnx")


def _check_evaluation_data(recipe: Recipe) -> None:
    """A named evaluation file that is not there is an error now, not a skipped report later."""
    data = recipe.evaluation.data
    if data is not None and not eval_data_file(data)[0].is_file():
        raise CalibrationDataError(f"evaluation data {data}: no such file; fix the path, or leave "
                                   "evaluation.data / --eval-data out to build without an accuracy report")


def _check_calibration_memory(recipe: Recipe, hidden_size: int) -> None:
    """Calibration holds every sample's activations in fp32 twice (a layer's inputs and outputs):
    more than the host (or the container) has failed with an allocation traceback after the samples
    were drawn. Checked once the model is in memory, so what is available is what is left for them."""
    spec = recipe.calibration
    need = 2 * spec.num_samples * spec.seq_len * hidden_size * 4
    available = available_bytes()
    if need > available:
        raise RecipeError(f"calibration holds {spec.num_samples} x {spec.seq_len} x {hidden_size} fp32 activations "
                          f"twice ({need / 2**30:.1f} GiB) and {available / 2**30:.1f} GiB is free (the host's, or "
                          "the container's limit): lower --num-samples or calibration.seq_len")


def _check_lengths(recipe: Recipe, max_len: int, add_bos: bool) -> None:
    """Before calibration: a calibration sample is seq_len tokens; an evaluation window is seq_len
    tokens and a BOS when the tokenizer adds one. Without evaluation data there is no window (a
    512-token model that adds BOS had been refused for the default evaluation.seq_len of 512 it
    would never use)."""
    check_window("calibration.seq_len (a recipe file's)", recipe.calibration.seq_len, False, max_len,
                 error=RecipeError)
    if recipe.evaluation.data is not None:
        check_window("evaluation.seq_len (--eval-seq-len)", recipe.evaluation.seq_len, add_bos, max_len,
                     error=RecipeError)


def _round_as_stored(model, qm) -> None:
    """Give the model the report scores its high-precision tensors as the artifact stores them
    (bf16 but norms and 1-D tensors), so the report describes the artifact: scoring the fp32
    source's embeddings reported SmolLM2's main job at perplexity 36.390 where the artifact
    itself (`qkiln eval`) scores 36.572."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, t in tensors.items():
            if name in qm.fp_tensors:
                # new storage, not copy_: the model shares the source's tensors, from which the
                # unquantized reference is built (copy_ made that reference part bf16). Held in bf16,
                # computed with in fp32 (compile/upcast.py); a bf16 source's tensors stay as they are
                t.data = stored_precision(name, t)


def _accuracy(source, model, qm, recipe: Recipe, progress: bool) -> dict:
    ev = recipe.evaluation
    if ev.data is None:
        return {"skipped": "no evaluation data (set evaluation.data or --eval-data)"}
    # hidden states and head apart: evaluation computes the logits a slice at a time (evaluate.py)
    quantized = LoadedModel("quantized", source.tokenizer, model, {}, simulated_kv_backend(qm))
    # the source's own tensors, not `model`'s (quantized in place)
    reference = LoadedModel("reference", source.tokenizer, compute_in_float32(source.build_model(None)), {})
    # the reference's perplexity comes with the KL, from the same logits (a separate cached pass before)
    report = evaluate(quantized, source.tokenizer, ev.data, ev.seq_len, ev.max_tokens, reference=reference,
                      progress=progress)
    report["scoring"] = SIMULATION_SCORING
    return report


def _tokenizer_files(source) -> dict[str, bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        source.tokenizer.save(Path(tmp))
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


def _manifest(source, recipe: Recipe, tokens, qm, quantization, accuracy, out: Path, toolchain: dict) -> Manifest:
    num_params = sum(v.numel() for k, v in source.state_dict.items()
                     if not (source.config.tie_word_embeddings and k == "lm_head.weight"))
    kv = recipe.scheme.kv_cache
    return Manifest(
        name=output_path(out).name,
        architecture=source.config.to_dict(),
        target={"device": recipe.target, "min_compute_capability": "8.0" if recipe.target == "cuda" else None},
        recipe=recipe.to_dict() | {"fallbacks": qm.fallbacks},
        quantization=quantization,
        kv_cache=None if kv is None else kv.to_dict(),
        calibration=None if tokens is None else tokens.provenance,
        source={"name": source.name, "kind": source.kind, "sha256": source.sha256},
        toolchain=toolchain,
        accuracy=accuracy,
        num_parameters=num_params,
        source_bytes_bf16=2 * num_params,
        created=source_date_epoch(),
    )
