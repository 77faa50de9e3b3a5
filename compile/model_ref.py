"""Open whatever a command names as a model: a source model now, an artifact once built.

`open_model(name)` returns a `LoadedModel` with the tokenizer and a dense fp32 scorer used by
evaluation. An artifact directory is recognised by its manifest.json.
"""

from dataclasses import dataclass

import torch

from qkiln.runtime.loader import check_int8_activations
from qkiln.runtime.source import load_source, local_path

from .artifact import is_artifact_dir
from .upcast import compute_in_float32


@dataclass
class LoadedModel:
    name: str
    tokenizer: object
    model: torch.nn.Module
    description: dict
    backend: object = None  # attention backend (simulated KV quantization for artifacts)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(ids))

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, hidden]: evaluation takes the logits from these a slice at a time."""
        with torch.no_grad():
            return self.model.dense_hidden_states(ids, backend=self.backend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model.compute_logits(hidden).float()


def open_model(name: str, int8_activations: bool = False) -> LoadedModel:
    """int8_activations: score an artifact as served with that CPU option (simulated)."""
    path = local_path(name)  # an artifact may be named by a hub id too
    if is_artifact_dir(path):
        from .artifact_model import load_artifact_model  # an artifact: quantized layers from its manifest

        return load_artifact_model(path, int8_activations)
    if int8_activations:
        check_int8_activations(name, is_artifact=False)
    src = load_source(name)
    # as stored, computing in fp32: a bf16 checkpoint costs 2 bytes a parameter, not 4 more
    model = compute_in_float32(src.build_model(None))
    return LoadedModel(name, src.tokenizer, model, {"kind": src.kind, "sha256": src.sha256})
