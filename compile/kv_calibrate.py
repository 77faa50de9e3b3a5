"""KV-cache scale calibration on the (weight-quantized) model: one pass, all layers.

Observes K (post-RoPE, as the cache stores it) and V of every layer through the dense
attention backend's observer, keeps running per-(head, channel) statistics (min, max, mean), and
turns them into static scales with quant.kv (fp8 per-head scales; key smoothing per channel; the
key offset, which is a mean of post-RoPE keys because that is what the cache stores), widened for
keys at positions past the samples' length by how far RoPE turns each channel over the context.
Separate from weight calibration so a KV-only change reuses the cached weights. An int4 cache keeps its
group parameters in fp16: K or V reaching past that range on the calibration data is refused (the
cache would saturate them), and a reach within 8x of it is warned about (other prompts may go further).
"""

import torch
from tqdm import tqdm

from qkiln.errors import RecipeError
from qkiln.quant import KVCacheScheme, kv
from qkiln.runtime.attention import DenseAttention
from qkiln.runtime.model import CausalLM
from qkiln.runtime.rope import inverse_frequencies

from .quantized_model import QuantizedModel


@torch.no_grad()
def calibrate_kv(model: CausalLM, qm: QuantizedModel, scheme: KVCacheScheme, input_ids: torch.Tensor,
                 batch_size: int = 8, progress: bool = True, warn=print) -> None:
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
    near_limit = []
    rotation = key_rotation(model.config)
    for i, (k_stats, v_stats) in sorted(stats.items()):
        qm.kv[i] = (kv.kv_scales_from_stats(k_stats, scheme, is_key=True, rotation=rotation),
                    kv.kv_scales_from_stats(v_stats, scheme, is_key=False))
        if scheme.dtype == "int4":
            near_limit += _int4_reach_near_limit(i, (k_stats, v_stats), qm.kv[i])
        qm.report[f"model.layers.{i}.kv"] = {"dtype": scheme.dtype,
                                             "key_smoothing": qm.kv[i][0].channel_scale is not None,
                                             "key_offset": qm.kv[i][0].offset is not None}
    if near_limit:
        warn(f"warning: the int4 KV cache stores group parameters in fp16 (up to {kv.FP16_MAX:.0f}) and the "
             f"calibration data already reaches within 8x of that: {', '.join(near_limit[:4])}"
             f"{', ...' if len(near_limit) > 4 else ''}; prompts with larger K / V would saturate there "
             "(an fp8 KV cache has no such limit)")


def key_rotation(config) -> torch.Tensor:
    """[head_dim] radians each key channel's rotate-half pair turns over the model's context: the
    calibrated key statistics (positions < the samples' length) are widened by it (quant.kv)."""
    turn = inverse_frequencies(config) * config.max_position_embeddings
    return torch.cat((turn, turn))


def _int4_reach_near_limit(layer_id: int, stats: tuple, calibrations: tuple) -> list[str]:
    """Raise RecipeError where layer `layer_id`'s K or V pass what an int4 cache's fp16 group
    parameters hold; name those within 8x of it."""
    near = []
    for what, layer_stats, calibration in zip(("keys", "values"), stats, calibrations):
        reach = kv.int4_cache_reach(layer_stats, calibration)
        if not reach <= kv.FP16_MAX:
            raise RecipeError(
                f"model.layers.{layer_id}: its {what} reach {reach:.4g} on the calibration data, past the "
                f"+-{kv.FP16_MAX:.0f} an int4 KV cache's fp16 group parameters hold (they would saturate there); "
                "use an fp8 KV cache (the kv-fp8 presets) or leave the KV cache unquantized")
        if reach > kv.FP16_MAX / 8:
            near.append(f"model.layers.{layer_id} {what} {reach:.4g}")
    return near
