"""KV-cache scale calibration on the (weight-quantized) model: one pass, all layers.

Observes K (post-RoPE, as the cache stores it) and V of every layer through the dense
attention backend's observer, keeps running per-(head, channel) statistics (min, max, mean), and
turns them into static scales with quant.kv (fp8 per-head scales; key smoothing per channel; the
key offset, which is a mean of post-RoPE keys because that is what the cache stores). Separate
from weight calibration so a KV-only change reuses the cached weights.
"""

import torch
from tqdm import tqdm

from qkiln.quant import KVCacheScheme, kv
from qkiln.runtime.attention import DenseAttention
from qkiln.runtime.model import CausalLM

from .quantized_model import QuantizedModel


@torch.no_grad()
def calibrate_kv(model: CausalLM, qm: QuantizedModel, scheme: KVCacheScheme, input_ids: torch.Tensor,
                 batch_size: int = 8, progress: bool = True) -> None:
    stats: dict[int, tuple] = {}

    def observe(layer_id, k, v):
        k_stats, v_stats = stats.get(layer_id, (None, None))
        stats[layer_id] = (kv.update_kv_stats(k_stats, k), kv.update_kv_stats(v_stats, v))

    backend = DenseAttention(kv_observer=observe)
    for start in tqdm(range(0, input_ids.shape[0], batch_size), desc="kv-calibrate", unit="batch",
                      disable=not progress):
        ids = input_ids[start : start + batch_size]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        model.hidden_states(ids, positions, backend)
    for i, (k_stats, v_stats) in sorted(stats.items()):
        qm.kv[i] = (kv.kv_scales_from_stats(k_stats, scheme, is_key=True),
                    kv.kv_scales_from_stats(v_stats, scheme, is_key=False))
        qm.report[f"model.layers.{i}.kv"] = {"dtype": scheme.dtype,
                                             "key_smoothing": qm.kv[i][0].channel_scale is not None,
                                             "key_offset": qm.kv[i][0].offset is not None}
