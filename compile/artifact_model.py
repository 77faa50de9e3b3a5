"""Evaluate an artifact in simulation: its stored tensors, dequantized exactly as the kernels
would, fake-quant activations and KV. Used by `qkiln eval ARTIFACT` and the quality bench."""

from pathlib import Path

from qkiln.quant import QuantScheme
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.tokenizer import Tokenizer

from .artifact import load_tensors, read_manifest, verify_artifact
from .artifact_tensors import from_tensors
from .model_ref import LoadedModel
from .simulate import SIMULATION_SCORING, simulated_model


def load_artifact_model(path: Path, int8_activations: bool = False, verify: bool = True) -> LoadedModel:
    """int8_activations: as served with that option (simulate.simulated_model). verify=False is for
    a caller that has just verified or written the artifact (a build checking its own engine)."""
    if verify:
        verify_artifact(path, check_target=False)  # evaluation runs anywhere; serving checks the target
    manifest = read_manifest(path)
    config = ModelConfig.from_dict(manifest.architecture)
    scheme = QuantScheme.from_dict(manifest.recipe["scheme"])
    qm = from_tensors(config, scheme, load_tensors(path, manifest, verify=False), manifest.quantization)
    model, backend = simulated_model(qm, int8_activations)
    return LoadedModel(str(path), Tokenizer.from_dir(Path(path) / "tokenizer"), model,
                       {"kind": "artifact", "recipe": manifest.recipe.get("name"), "digest": manifest.digest,
                        "source_sha256": manifest.source.get("sha256"), "scoring": SIMULATION_SCORING,
                        "int8_activations": int8_activations}, backend)
