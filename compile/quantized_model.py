"""`QuantizedModel`: what calibration produces and what the artifact stores.

Per linear (HF name without `.weight`): a `QuantizedWeight` (INT4/INT8 codes), an `Fp8Weight`,
or nothing (kept in high precision, found in `fp_tensors`). Static FP8 activation scales per
linear, calibrated KV scales per layer, and a per-layer report (algorithm, loss, fallbacks).
`fp_tensors` holds every tensor that stays in high precision *after* any folding (AWQ scales
folded into norms, key smoothing folded into q/k), so the quantized model is exactly
`fp_tensors` + `weights` + scales.
"""

from dataclasses import dataclass, field

import torch

from qkiln.quant import Fp8Weight, KVCalibration, QuantizedWeight, QuantScheme
from qkiln.runtime.config import ModelConfig


@dataclass
class QuantizedModel:
    config: ModelConfig
    scheme: QuantScheme
    fp_tensors: dict[str, torch.Tensor]
    weights: dict[str, QuantizedWeight | Fp8Weight] = field(default_factory=dict)
    act_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # linear -> 0-dim fp32
    kv: dict[int, tuple[KVCalibration, KVCalibration]] = field(default_factory=dict)  # layer -> (K, V)
    report: dict[str, dict] = field(default_factory=dict)  # linear or "layers.{i}.kv" -> facts
    timings: dict[str, dict] = field(default_factory=dict)  # per layer; never written (not reproducible)

    @property
    def fallbacks(self) -> dict[str, str]:
        return {name: r["fallback"] for name, r in self.report.items() if r.get("fallback")}
