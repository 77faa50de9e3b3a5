"""`PagedAttention`: the attention backend of the serving runtime.

For each decoder layer it writes this step's K/V into the paged cache (quantizing on write as
the cache's dtype says) and attends over each sequence's blocks, through the plugins' custom
ops. The runner sets `metadata` before every forward; layers never see block tables.
"""

from dataclasses import dataclass

import torch

from qkiln.plugins import KVCache, cache_write, paged_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


class PagedAttention:
    def __init__(self, caches: list[KVCache], head_dim: int):
        self.caches = caches
        self.scale = head_dim ** -0.5
        self.metadata: AttentionMetadata | None = None

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]."""
        m = self.metadata
        cache = self.caches[layer_id]
        cache_write(k, v, cache, m.slot_mapping)
        return paged_attention(q, cache, m.block_tables, m.seq_lens, m.query_start_loc, self.scale)
