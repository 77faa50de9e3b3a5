"""Attention backends the lean model calls through one method: `attend(layer_id, q, k, v)`.

The decoder layers compute q/k/v and RoPE; *where* K/V live is the backend's business:
  - `DenseAttention`: whole sequences in a batch [B, T, H, D], causal, nothing cached. Used
    by evaluation and layer-by-layer calibration. Optional hooks simulate KV quantization
    (`kv_transform`) and observe K/V for calibration (`kv_observer`).
  - `PagedAttention` (runtime/paged_attention.py): flattened tokens [N, H, D] of many
    sequences, K/V written into the paged cache through the plugins' ops.
Invariant: backends never change q/k/v shapes or dtypes seen by the caller.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (layer_id, k, v) -> (k, v): e.g. fake-quantize K/V as the quantized cache would store them.
KVTransform = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
KVObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


class DenseAttention:
    def __init__(self, kv_transform: KVTransform | None = None, kv_observer: KVObserver | None = None):
        self.kv_transform = kv_transform
        self.kv_observer = kv_observer

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] -> [B, T, Hq, D], causal."""
        if self.kv_observer is not None:
            self.kv_observer(layer_id, k, v)
        if self.kv_transform is not None:
            k, v = self.kv_transform(layer_id, k, v)
        num_groups = q.shape[-2] // k.shape[-2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if num_groups > 1:
            k = k.repeat_interleave(num_groups, dim=1)
            v = v.repeat_interleave(num_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)
