"""Score an artifact's ONNX engine on the evaluation protocol (`qkiln eval ARTIFACT --engine onnx`):
what the deployed graph does to accuracy, beside what the artifact's simulation reports.

Each batch of windows is one engine step: every window a sequence prefilled from position 0 into
fresh paged caches (its own blocks, `block_size` tokens each), all windows flattened into one
`input_ids`, as the runtime batches prefills. The engine runs under onnx's reference evaluator
(`--engine onnx`, onnx_check.ReferenceEngine: the specification's arithmetic, seconds a window on
SmolLM2) or under ONNX Runtime (`--engine onnxruntime`, onnx_ort.OrtEngine: what a production
runtime's kernels make of the file, MatMulNBits at the accuracy level a deployment picks, the
plugin nodes through qkiln's own kernels). Both are for accuracy jobs, not serving.
"""

from pathlib import Path

import torch

from qkiln.errors import ArtifactError
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.tokenizer import Tokenizer

from .artifact import read_manifest, verify_artifact
from .export_onnx import artifact_engine_dir, require_onnx
from .onnx_check import ArtifactCaches, ReferenceEngine, check_contract, read_engine_contract
from .onnx_contract import rewrite_hint

BLOCK_SIZE = 16  # the runtime's default
RUNNERS = ("onnx", "onnxruntime")


class EngineScorer:
    """ids [B, T] -> logits [B, T, V] float32 through the engine in `engine_dir`."""

    def __init__(self, artifact: Path, engine_dir: Path, config: ModelConfig, runner: str = "onnx",
                 accuracy_level: int = 0):
        self.engine_dir, self.config, self.tokenizer = engine_dir, config, None
        self.description: dict = {}
        self.runner, self.accuracy_level = runner, accuracy_level
        self.caches = ArtifactCaches(artifact, config, BLOCK_SIZE)
        check_contract(engine_dir, self.caches.contract())
        self.engine = None  # loaded at the first batch

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        per_seq = -(-length // BLOCK_SIZE)
        caches = self.caches.new(batch * per_seq)  # fresh: each window starts at position 0
        if self.engine is None and self.runner == "onnxruntime":
            from .onnx_ort import OrtEngine

            self.engine = OrtEngine(self.engine_dir, caches, self.accuracy_level)
        elif self.engine is None:
            self.engine = ReferenceEngine(self.engine_dir, caches)
        self.engine.use(caches)
        engine = self.engine
        tables = torch.arange(batch * per_seq, dtype=torch.int32).reshape(batch, per_seq)
        positions = torch.arange(length).repeat(batch)
        seq = torch.arange(batch).repeat_interleave(length)
        slots = tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        lens = torch.full((batch,), length, dtype=torch.int32)
        starts = torch.arange(batch + 1, dtype=torch.int32) * length
        logits = engine.step(ids.reshape(-1), positions, slots, tables, lens, starts)
        return logits.reshape(batch, length, -1)


def open_engine(artifact: Path, runner: str = "onnx", accuracy_level: int = 0) -> EngineScorer:
    """The artifact's engines/onnx/ as an evaluation scorer run by `runner` (RUNNERS); `.tokenizer`
    is the artifact's. accuracy_level: ONNX Runtime's MatMulNBits level (onnx_ort.py)."""
    if runner not in RUNNERS:
        raise ArtifactError(f"engine runner {runner!r} is not one of {RUNNERS}")
    require_onnx()
    if runner == "onnxruntime":
        from .onnx_ort import require_onnxruntime

        require_onnxruntime()
    verify_artifact(artifact, check_target=False)  # evaluation runs anywhere
    engine_dir = artifact_engine_dir(artifact, "score")
    manifest = read_manifest(artifact)
    _check_engine_is_the_artifact_s(manifest, engine_dir)
    config = ModelConfig.from_dict(manifest.architecture)
    scorer = EngineScorer(Path(artifact), engine_dir, config, runner, accuracy_level)
    scorer.tokenizer = Tokenizer.from_dir(Path(artifact) / "tokenizer")
    scorer.description = {"digest": manifest.digest, "scoring": f"engine: engines/onnx/ run by {runner}"}
    return scorer


def _check_engine_is_the_artifact_s(manifest, engine_dir: Path) -> None:
    """engine.json names the artifact it was exported from (name, recipe, source): an engine copied in
    from another artifact, with the manifest's hashes redone, had been scored as this one's.
    (`qkiln verify --engines` compares the weights themselves.)"""
    recorded = read_engine_contract(engine_dir).get("artifact") or {}
    expected = {"name": manifest.name, "recipe": manifest.recipe.get("name"),
                "source_sha256": manifest.source.get("sha256")}
    differing = [k for k, v in expected.items() if recorded.get(k) != v]
    if differing:
        theirs = ", ".join(f"{k} {recorded.get(k)!r}" for k in differing)
        ours = ", ".join(f"{k} {expected[k]!r}" for k in differing)
        raise ArtifactError(f"{engine_dir} was exported from another artifact ({theirs}; this one's: {ours}): "
                            f"{rewrite_hint(engine_dir)}, or score the artifact it came from")
