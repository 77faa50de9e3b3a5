"""`qkiln bench onnx-engine`: an artifact's ONNX engine stepping under ONNX Runtime.

    qkiln bench onnx-engine smollm2-w4 --json onnx_engine.json

One decode step (1 token at context `--context`) and one prefill step (`--context` tokens) of the
artifact's engines/onnx/ under ONNX Runtime (compile/onnx_ort.OrtEngine: its kernels for the
standard nodes, qkiln's CPU kernels for the plugin nodes), at each MatMulNBits accuracy level
asked for; the engines are loaded first and the repeats take turns between them, so a drift of
the shared host lands on every row alike. Also reports how many of the artifact's int4 linears
ONNX Runtime fused into MatMulNBits (the packed path) and what the rest became.
"""

import tempfile
import time
from pathlib import Path

import torch

from .workload import BenchConfigError

from .report import log, make_report, print_table, summarize, write_report

BLOCK_SIZE = 16


def _step_inputs(vocab: int, num_tokens: int, context: int, generator: torch.Generator) -> list[torch.Tensor]:
    """One sequence's step: its last `num_tokens` positions of `context`, blocks 0.. in order; the
    logits of its last row only, as a server samples."""
    tables = torch.arange(-(-context // BLOCK_SIZE), dtype=torch.int32)[None]
    positions = torch.arange(context - num_tokens, context)
    slots = tables[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    return [torch.randint(0, vocab, (num_tokens,), generator=generator), positions, slots, tables,
            torch.tensor([context], dtype=torch.int32), torch.tensor([0, num_tokens], dtype=torch.int32),
            torch.tensor([num_tokens - 1])]


def run_onnx_engine(artifact: Path, levels: list[int], context: int, repeats: int, threads: int) -> dict:
    from qkiln.compile.artifact import read_manifest, verify_artifact
    from qkiln.compile.export_onnx import artifact_engine_dir
    from qkiln.compile.onnx_check import ArtifactCaches, check_contract
    from qkiln.compile.onnx_ort import OrtEngine
    from qkiln.runtime.config import ModelConfig

    verify_artifact(artifact, check_target=False)
    engine_dir = artifact_engine_dir(artifact, "time")
    manifest = read_manifest(artifact)
    config = ModelConfig.from_dict(manifest.architecture)
    if context > config.max_position_embeddings:  # main() refused a context below 2
        raise BenchConfigError(f"--context {context} is beyond the model's {config.max_position_embeddings} positions")
    caches = ArtifactCaches(artifact, config, BLOCK_SIZE)
    check_contract(engine_dir, caches.contract())
    torch.set_num_threads(threads)
    blocks = -(-context // BLOCK_SIZE)
    engines, fused = {}, {}
    with tempfile.TemporaryDirectory(prefix="qkiln-ort-") as tmp:
        for level in levels:
            log(f"[onnx-engine] loading {engine_dir} under ONNX Runtime, accuracy level {level}")
            optimized = Path(tmp) / f"level{level}"
            optimized.mkdir()
            engines[level] = OrtEngine(engine_dir, caches.new(blocks), level, threads, optimized_dir=optimized)
            engines[level].step(*_step_inputs(config.vocab_size, 1, context, torch.Generator().manual_seed(0)))
            fused[level] = engines[level].fused_op_counts()
    times = {(level, kind): [] for level in levels for kind in ("decode", "prefill")}
    generator = torch.Generator().manual_seed(1)
    for i in range(repeats):
        for kind, num_tokens in (("decode", 1), ("prefill", context)):
            for level, engine in engines.items():
                inputs = _step_inputs(config.vocab_size, num_tokens, context, generator)
                start = time.perf_counter()
                engine.step(*inputs)
                times[(level, kind)].append(time.perf_counter() - start)
        log(f"[onnx-engine] round {i + 1}/{repeats}")
    int4 = sum(e.get("format") == "int4" for e in manifest.quantization.get("linears", {}).values())
    return {"artifact": str(artifact), "int4_linears": int4,
            "levels": {str(level): {"decode_ms": summarize([t * 1e3 for t in times[(level, "decode")]]),
                                    "prefill_ms": summarize([t * 1e3 for t in times[(level, "prefill")]]),
                                    "matmulnbits": fused[level].get("MatMulNBits", 0),
                                    "ops": fused[level]} for level in levels}}


def main(artifact: Path, levels: str, context: int, repeats: int, threads: int, json_out: Path | None) -> dict:
    try:
        level_list = [int(x) for x in levels.split(",")]
    except ValueError:
        raise BenchConfigError(f"--levels takes a comma-separated list of 0..4, got {levels!r}") from None
    if not level_list or any(not 0 <= x <= 4 for x in level_list) or context < 2 or repeats < 1 or threads < 1:
        raise BenchConfigError("--levels takes 0..4; --context >= 2, --repeats >= 1, --threads >= 1")
    from qkiln.compile.artifact_cli import unpacked

    with unpacked(str(artifact)) as path:  # an archive as every other command takes it
        results = run_onnx_engine(Path(path), level_list, context, repeats, threads)
    rows = [[level, f"{r['decode_ms']['median']:.1f}", f"{r['prefill_ms']['median']:.1f}",
             f"{r['matmulnbits']} / {results['int4_linears']}"] for level, r in results["levels"].items()]
    print_table(f"{artifact}: engine steps under ONNX Runtime (medians of {repeats}, {threads} threads)",
                ["accuracy level", "decode 1 token (ms)", f"prefill {context} (ms)", "MatMulNBits / int4 linears"],
                rows)
    report = make_report("onnx-engine", {"levels": level_list, "context": context, "repeats": repeats,
                                         "threads": threads}, results)
    write_report(json_out, report)
    return report
