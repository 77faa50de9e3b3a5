"""`ModelRunner`: turns a `StepPlan` into flat tensors, runs the model, returns sampling logits.

Input layout of one step (in-flight batching: prefill chunks and decodes side by side):

    seq A (prefill chunk, 3 tokens)   seq B (decode)   seq C (prefill chunk, 2 tokens)
    input_ids  [a5 a6 a7 | b9 | c0 c1]            positions [5 6 7 | 9 | 0 1]
    query_start_loc [0, 3, 4, 6]   seq_lens [8, 10, 2]
    slot_mapping[i] = block_table[pos // block_size] * block_size + pos % block_size

Only rows that end a sequence's known tokens are turned into logits (`sample_rows`), so a
prefill chunk pays for the lm_head once, not once per token; a sequence that asked for its
prompt's logprobs also gets its prompt rows' logits (`prompt_rows`). Owns no scheduling decisions.
"""

from typing import NamedTuple

import torch

from qkiln.plugins import KVCache

from .decode_stack import NativeDecodeStack
from .model import CausalLM
from .paged_attention import AttentionMetadata, PagedAttention
from .scheduler import StepPlan


class StepLogits(NamedTuple):
    logits: torch.Tensor  # [num_sampling_seqs, vocab], plan.sampling order, the model's dtype
    argmax: torch.Tensor | None  # [num_sampling_seqs] int64 ops.argmax of them, when asked and made
    # [num_prompt_rows, hidden]: the final hidden states of every ScheduledSeq.prompt_logprob_positions,
    # in plan order; None when no sequence in the step asked for prompt logprobs. Hidden states, not
    # logits: up to max_num_batched_tokens rows x the vocabulary would be gigabytes for a 128k one,
    # so the engine turns them into logits (`ModelRunner.compute_logits`) a slice at a time.
    prompt_hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, caches: list[KVCache], block_size: int, device="cpu"):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = PagedAttention(caches, model.config.head_dim)
        # CPU decode-only steps run every layer in one native call when the model qualifies.
        self.decode_stack = NativeDecodeStack.build(model, caches) if self.device.type == "cpu" else None

    def prepare(self, plan: StepPlan):
        ids, positions, slots, seq_lens, starts, sample_rows, prompt_rows = [], [], [], [], [0], [], []
        max_blocks = max(len(s.block_table) for s in plan.scheduled)
        # [S, max_blocks], zero-padded, one tensor from one list (a tensor per row: prepare() took
        # 0.87 ms of a 64-row decode step, now 0.40)
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in plan.scheduled],
                              dtype=torch.int32)
        bs = self.block_size
        for s in plan.scheduled:
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            ids.extend(s.seq.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(start + n)
            starts.append(starts[-1] + n)
            if s.is_sampling:
                sample_rows.append(starts[-1] - 1)
            prompt_rows.extend(starts[-2] + p - start for p in s.prompt_logprob_positions)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)  # [N]
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)  # [N]
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        return input_ids, positions_t, metadata, rows, torch.tensor(prompt_rows, dtype=torch.int64, device=dev)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run one step; returns logits [num_sampling_seqs, vocab] in `plan.sampling` order, in the
        model's dtype (the sampler widens them to fp32 where it computes with them, not for greedy
        argmax: a 64 x 49152 fp32 copy a step, into memory often faulted in anew, is avoided)."""
        return self.run(plan).logits

    @torch.inference_mode()
    def run(self, plan: StepPlan, argmax: bool = False) -> StepLogits:
        """`execute`, and with `argmax` each logits row's ops.argmax where the native decode stack
        computes the head (then its threads take it as they write the logits), else None."""
        input_ids, positions, metadata, sample_rows, prompt_rows = self.prepare(plan)
        stack, num_tokens = self.decode_stack, input_ids.shape[0]
        if stack is not None and stack.applies(num_tokens, metadata):
            if stack.serves_head(num_tokens) and sample_rows.shape[0] == num_tokens:  # every row samples
                return StepLogits(*stack.logits(input_ids, positions, metadata, argmax))
            hidden = stack.hidden_states(input_ids, positions, metadata)  # [N, hidden]
        else:
            self.backend.metadata = metadata
            hidden = self.model.hidden_states(input_ids, positions, self.backend)  # [N, hidden]
        prompt_hidden = hidden[prompt_rows] if prompt_rows.numel() else None
        return StepLogits(self.model.compute_logits(hidden[sample_rows]), None, prompt_hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] final hidden states -> [rows, vocab] logits (the head; prompt scoring)."""
        return self.model.compute_logits(hidden)
