"""CUDA-graph decode: static input buffers per batch-size bucket, captured once, replayed.

Why: one eager paged-attention call costs ~141 us of host-side dispatch on an H200 against ~6 us
inside a graph (DESIGN.md: a small launch costs ~30 us there), so decode steps must replay graphs.

Owns `GraphRunner` (a `ModelRunner` whose pure-decode steps replay a graph; anything else, and
any step on a CPU, runs eagerly through `ModelRunner.run`), the bucket rule and the staging
buffers. Must not schedule nor sample: it returns logits like `ModelRunner.execute`.

A step is pure decode when every scheduled sequence computes exactly one token and samples. It
runs in the smallest bucket B >= num_seqs; rows num_seqs..B-1 are padding that writes nothing
and reads one slot of block 0 (any block id is memory-safe to read; the rows' logits are
dropped, and rows never mix: every op is row-wise or per sequence):

    row          0 .. n-1 (real)                 n .. B-1 (padding)
    input_ids    last token of each sequence     0
    positions    num_computed_tokens             0
    slot_mapping its slot for that position      -1 (cache_write skips it)
    block_tables its blocks, then zeros          zeros (width W = ceil(max_model_len / bs))
    seq_lens     position + 1                    1
    query_start_loc = [0, 1, ..., B]             (constant)

All six inputs live in ONE pinned host buffer and ONE device buffer with the same layout (int32
words; the int64 sections are views at even word offsets), so a step is one non-blocking H2D
copy, then `graph.replay()`. The host buffer is refilled only after the previous copy's event
completed. The only host sync of a step stays the caller's fetch of sampled tokens.

    words: [ids: 2M][positions: 2M][slots: 2M][tables: M*W][seq_lens: M][qsl: M+1]   M = max bucket

Invariants: graphs of all buckets share one memory pool and are replayed one at a time on the
capturing stream; the KV caches, weights and these buffers never move after capture.
"""

import torch

from .block_manager import cdiv
from .model import CausalLM
from .paged_attention import AttentionMetadata
from .runner import ModelRunner, StepLogits
from .scheduler import StepPlan

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(num_seqs: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket holding num_seqs rows, or None when none does (run eagerly)."""
    return next((b for b in sorted(buckets) if b >= num_seqs), None) if num_seqs > 0 else None


def is_pure_decode(plan: StepPlan) -> bool:
    """Every scheduled sequence computes one token and samples it (what a graph can replay)."""
    return bool(plan.scheduled) and all(s.num_scheduled_tokens == 1 and s.is_sampling
                                        for s in plan.scheduled)


class DecodeInputs:
    """The staging buffers of the module docstring: pinned host words -> device words."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        self.max_batch, self.max_blocks, self.device = max_batch, max_blocks, torch.device(device)
        m = max_batch
        sizes = {"input_ids": 2 * m, "positions": 2 * m, "slot_mapping": 2 * m,
                 "block_tables": m * max_blocks, "seq_lens": m, "query_start_loc": m + 1}
        self._offsets, total = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (total, total + size)
            total += size
        is_cuda = self.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=is_cuda)  # [total words]
        self.dev = torch.zeros(total, dtype=torch.int32, device=self.device)
        self._host_views = self._views(self.host)
        self._np = {k: v.numpy() for k, v in self._host_views.items()}
        self._np["query_start_loc"][:] = range(m + 1)
        self._copied = torch.cuda.Event() if is_cuda else None
        self._has_pending_copy = False

    def _views(self, words: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, (begin, end) in self._offsets.items():
            part = words[begin:end]
            if name in ("input_ids", "positions", "slot_mapping"):
                part = part.view(torch.int64)  # [M]
            elif name == "block_tables":
                part = part.view(self.max_batch, self.max_blocks)  # [M, W]
            views[name] = part
        return views

    def device_views(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [B], positions [B], metadata) over the device buffer's first B rows."""
        v = self._views(self.dev)
        metadata = AttentionMetadata(slot_mapping=v["slot_mapping"][:batch],
                                     block_tables=v["block_tables"][:batch],
                                     seq_lens=v["seq_lens"][:batch],
                                     query_start_loc=v["query_start_loc"][:batch + 1])
        return v["input_ids"][:batch], v["positions"][:batch], metadata

    def host_views(self, batch: int) -> dict[str, torch.Tensor]:
        """The host buffer's sections cut to B rows (what the next upload will carry)."""
        return {k: (v[:batch + 1] if k == "query_start_loc" else v[:batch])
                for k, v in self._host_views.items()}

    def _wait_for_copy(self) -> None:
        if self._has_pending_copy:
            self._copied.synchronize()  # already done in practice: the caller synced on tokens
            self._has_pending_copy = False

    def stage_padding(self, batch: int) -> None:
        """All `batch` rows padding: valid inputs that write nothing (warm-up and capture)."""
        self._wait_for_copy()
        a = self._np
        a["block_tables"][:batch] = 0
        a["input_ids"][:batch] = 0
        a["positions"][:batch] = 0
        a["slot_mapping"][:batch] = -1
        a["seq_lens"][:batch] = 1

    def stage(self, plan: StepPlan, block_size: int, batch: int) -> int:
        """Write a pure-decode plan into the host buffer padded to `batch` rows; returns n."""
        self._wait_for_copy()
        n = len(plan.scheduled)
        assert is_pure_decode(plan) and n <= batch <= self.max_batch, (n, batch)
        a = self._np
        tables = a["block_tables"]
        tables[:batch] = 0
        for row, s in enumerate(plan.scheduled):
            pos = s.num_computed_tokens
            table = s.block_table
            a["input_ids"][row] = s.seq.last_token_id  # decode: the one uncomputed token
            a["positions"][row] = pos
            a["slot_mapping"][row] = table[pos // block_size] * block_size + pos % block_size
            a["seq_lens"][row] = pos + 1
            tables[row, :len(table)] = table
        a["input_ids"][n:batch] = 0
        a["positions"][n:batch] = 0
        a["slot_mapping"][n:batch] = -1
        a["seq_lens"][n:batch] = 1
        return n

    def upload(self) -> None:
        """One H2D copy of every section (non-blocking from pinned memory on CUDA)."""
        self.dev.copy_(self.host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
            self._has_pending_copy = True


class GraphRunner(ModelRunner):
    """ModelRunner that replays a captured CUDA graph for pure-decode steps (eager elsewhere).

    use_graphs: None -> only on CUDA. pad_decode (default: use_graphs) sends pure-decode steps
    through the padded static buffers; without graphs that forward runs eagerly, which is how
    CPU tests check the padding rule end to end.
    """

    def __init__(self, model: CausalLM, caches, block_size: int, device="cuda",
                 max_model_len: int | None = None, max_num_seqs: int = BATCH_BUCKETS[-1],
                 buckets: tuple[int, ...] = BATCH_BUCKETS, use_graphs: bool | None = None,
                 pad_decode: bool | None = None):
        super().__init__(model, caches, block_size, device)
        max_model_len = max_model_len or model.config.max_position_embeddings
        top = bucket_for(max_num_seqs, buckets) or max(buckets)
        self.buckets = tuple(b for b in sorted(buckets) if b <= top)
        self.max_blocks = cdiv(max_model_len, block_size)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.pad_decode = self.use_graphs if pad_decode is None else pad_decode
        self.inputs = DecodeInputs(self.buckets[-1], self.max_blocks, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def decode_bucket(self, plan: StepPlan) -> int | None:
        """The bucket this plan replays in, or None when it must run eagerly."""
        if not is_pure_decode(plan):
            return None
        if any(len(s.block_table) > self.max_blocks for s in plan.scheduled):
            return None
        return bucket_for(len(plan.scheduled), self.buckets)

    @torch.inference_mode()
    def run(self, plan: StepPlan, argmax: bool = False) -> StepLogits:
        bucket = self.decode_bucket(plan) if self.pad_decode else None
        if bucket is None:
            return super().run(plan, argmax)
        return StepLogits(self.execute_padded(plan, bucket), None)

    @torch.inference_mode()
    def execute_padded(self, plan: StepPlan, bucket: int | None = None) -> torch.Tensor:
        """Run a pure-decode plan in a padded bucket: graph replay, or eager without graphs.

        The result may view the graph's static output (fp32 models): use it before the next step.
        """
        bucket = bucket or bucket_for(len(plan.scheduled), self.buckets)
        if self.use_graphs and bucket not in self.graphs:
            self.capture(bucket)  # stages its own padding inputs: before this step's
        num_seqs = self.inputs.stage(plan, self.block_size, bucket)
        self.inputs.upload()
        if self.use_graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self._forward(bucket)
        return logits[:num_seqs].float()  # [num_seqs, vocab]

    def _forward(self, bucket: int) -> torch.Tensor:
        input_ids, positions, metadata = self.inputs.device_views(bucket)
        self.backend.metadata = metadata
        hidden = self.model.hidden_states(input_ids, positions, self.backend)  # [B, hidden]
        return self.model.compute_logits(hidden)  # [B, vocab]

    @torch.inference_mode()
    def capture(self, bucket: int):
        """Warm up (compiles Triton kernels, builds RoPE tables) then capture one bucket.

        Runs on all-padding inputs, so warm-up never writes a live KV block.
        """
        self.inputs.stage_padding(bucket)
        self.inputs.upload()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)
        self._pool = graph.pool()
        self.graphs[bucket] = (graph, logits)
        return graph, logits

    def capture_all(self) -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse its pool memory)."""
        for bucket in reversed(self.buckets):
            if bucket not in self.graphs:
                self.capture(bucket)
