"""`Scheduler`: which sequences run in the next step and with how many tokens (vLLM v1's model).

Owns the waiting queue (FCFS), the running list (admission order; the last one is the newest),
the per-step token budget, preemption, and the stop conditions that need no text (max_tokens,
EOS, stop token ids, min_tokens, context length). Must not allocate or free blocks itself
(`KVCacheManager` does; the scheduler only hands each step's block tables to the runner) nor touch
tensors (the runner turns a `StepPlan` into them).

There are no prefill and decode phases. Each sequence has `num_computed_tokens`; a step gives
it up to `num_tokens - num_computed_tokens` tokens, capped by what is left of the step's budget:

    prompt            outputs
    [p p p p p p p p p o o]          one rule covers:
    [computed   )[sched )            chunked prefill (budget caps the chunk),
                         ^ sample    prefix hits (computed starts > 0), decode (1 token)
    when computed + scheduled == num_tokens the step yields logits and the sequence samples.

Order: running sequences first (so decodes are never starved by new prompts), then waiting
ones in FCFS order while budget, `max_num_seqs` and KV blocks last. A waiting sequence that
does not fit blocks the ones behind it (no overtaking). When a running sequence needs a block
and none is left, the newest running sequence is preempted: blocks freed, `num_computed_tokens`
reset to 0, put at the FRONT of the waiting queue, recomputed later (prefix cache permitting);
nothing is ever dropped. No admissions happen in a step that preempted, so a sequence scheduled
in a step keeps its blocks through it. Each sequence's blocks that the step fills are offered to
the prefix cache as it is scheduled, so a sequence admitted after it in the same step can hit
them; a step that fails is undone with `rollback()`.

Fixed chunks (`enable_chunked_prefill=False`, vLLM's `--no-enable-chunked-prefill`, for evaluation
jobs): a chunk is cut where the budget ran out, so how a prompt is split, and how many rows each
of its steps holds, depend on what else arrived; an int4 linear takes another kernel for a few rows
than for many, so the prompt's logprobs moved (0.14 nats apart on a SmolLM2 W4A16 artifact). With
it off, a sequence's chunks end only at multiples of the chunk size (or its end) and wait whole for
a step with room; a chunk that found no room makes the next step prefill-only (no decodes), as
vLLM's scheduler without chunked prefill puts prompts first. (A last chunk of at most 8 rows can
still share its step with decodes and cross that kernel threshold.)

Invariants (`check_integrity()`): every unfinished sequence is either running or waiting;
waiting ones hold no blocks and have nothing computed; running ones hold blocks for all their
computed tokens and have at least one token left to compute.
"""

from collections import deque
from dataclasses import dataclass, field

from qkiln.errors import RequestError
from qkiln.runtime.block_manager import KVCacheManager
from qkiln.runtime.bad_words import bad_words_banned
from qkiln.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # > 0: cap one sequence's chunk per step so a long prompt leaves budget for the others.
    long_prefill_token_threshold: int = 0
    # The model's context length; sequences stop ("length") when they reach it. None: no limit.
    max_model_len: int | None = None
    # False: a prompt's chunks end only at fixed positions (multiples of the chunk size), so its
    # prompt logprobs do not depend on what else shared the step (see "Fixed chunks" above).
    enable_chunked_prefill: bool = True

    @property
    def chunk_size(self) -> int:
        """The longest chunk one sequence gets in a step."""
        threshold = self.long_prefill_token_threshold
        return min(threshold, self.max_num_batched_tokens) if threshold > 0 else self.max_num_batched_tokens

    def __post_init__(self):
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1, self
        assert self.long_prefill_token_threshold >= 0, self


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens [num_computed_tokens, + num_scheduled_tokens)."""

    seq: Sequence
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]
    is_sampling: bool
    # Tokens the sampler must not pick this step (EOS and stop ids while below min_tokens).
    banned_token_ids: tuple[int, ...] = ()

    @property
    def seq_id(self):
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.seq.token_ids[start:start + self.num_scheduled_tokens]

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens)

    @property
    def prompt_logprob_positions(self) -> range:
        """The scheduled positions whose logits score the next prompt token (prompt_logprobs)."""
        if not self.seq.needs_prompt_logprobs:
            return range(0)
        start = self.num_computed_tokens
        return range(start, min(start + self.num_scheduled_tokens, self.seq.num_prompt_tokens - 1))


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_seq_ids: list = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def sampling(self) -> list[ScheduledSeq]:
        """The scheduled sequences that yield logits this step, in plan order."""
        return [s for s in self.scheduled if s.is_sampling]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, eos_token_ids=(),
                 primary_eos_token_id: int | None = None):
        """primary_eos_token_id: the tokenizer's EOS, whose stop reports no stop_reason; the model's
        other EOS ids (generation_config.json's) report theirs, as vLLM's stop_token_ids do."""
        self.config = config
        self.kv = kv_manager
        if isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids = frozenset(t for t in (eos_token_ids or ()) if t is not None)
        self.primary_eos_token_id = primary_eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict = {}  # seq_id -> unfinished Sequence
        self.num_preemptions = 0
        self._prefill_first = False  # chunked prefill off: a fixed chunk found no room last step

    # ----------------------------------------------------------------- queue
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id) -> Sequence | None:
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; `RequestError` if it could never run to completion here."""
        if seq.seq_id in self._seqs:
            raise RequestError(f"request id {seq.seq_id!r} is already in use; use a unique id")
        if seq.num_prompt_tokens == 0:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        seq.sampling_params.validate()
        max_len = self.config.max_model_len
        # A prompt may fill the context: its logprobs are what a loglikelihood evaluation reads,
        # and the one token sampled after it is never computed (it ends the sequence, "length").
        if max_len is not None and seq.num_prompt_tokens > max_len:
            raise RequestError(f"the prompt has {seq.num_prompt_tokens} tokens but the model's context is "
                               f"{max_len}; shorten the prompt", "prompt")
        pool = self.kv.num_blocks * self.kv.block_size
        if seq.num_prompt_tokens > pool:
            raise RequestError(f"the prompt has {seq.num_prompt_tokens} tokens but the KV cache holds {pool}; shorten "
                               "the prompt, or give the engine more KV cache", "prompt")
        # The last token is sampled but never computed, so it needs no KV slot.
        final_len = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        num_slots = max(seq.num_prompt_tokens, min(final_len, max_len if max_len is not None else final_len) - 1)
        if self.kv.num_blocks_for(num_slots) > self.kv.num_blocks:
            raise RequestError(f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens "
                               f"({seq.sampling_params.max_tokens}) needs {num_slots} KV slots but the cache holds "
                               f"{self.kv.num_blocks * self.kv.block_size}; lower max_tokens or shorten the prompt",
                               "max_tokens")
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq_id, reason: str) -> Sequence | None:
        """End a sequence wherever it is and free its blocks; None if it already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.set_finished(reason)
        del self._seqs[seq_id]
        return seq

    def abort(self, seq_id) -> Sequence | None:
        return self.finish(seq_id, "abort")

    # ----------------------------------------------------------------- step
    def schedule(self) -> StepPlan:
        prefill_only, self._prefill_first = self._prefill_first, False
        plan = self._schedule(prefill_only)
        if plan.is_empty and prefill_only and not plan.preempted_seq_ids:
            plan = self._schedule(False)  # no prompt could start after all (no blocks): decode
        return plan

    def _schedule(self, prefill_only: bool) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if prefill_only and seq.num_tokens - seq.num_computed_tokens == 1:
                continue  # a decode waits one step for the prompts
            num_new = self._num_tokens_to_schedule(seq, seq.num_computed_tokens, budget)
            if num_new == 0:
                continue  # its fixed chunk does not fit in what is left
            if not self._allocate_or_preempt(seq, num_new, plan):
                break  # it preempted itself: it was the newest, nothing runs after it
            self.kv.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
            plan.scheduled.append(self._entry(seq, num_new))
            budget -= num_new
        if not plan.preempted_seq_ids:
            self._admit_waiting(plan, budget)
        return plan

    def _num_tokens_to_schedule(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """How many tokens `seq` computes this step; 0 when its fixed chunk does not fit `budget`
        (chunked prefill off), which makes the next step prefill-only."""
        num_left = seq.num_tokens - num_computed
        assert num_left > 0, f"sequence {seq.seq_id!r} has nothing to compute"
        chunk = self.config.chunk_size
        if self.config.enable_chunked_prefill:
            return min(num_left, chunk, budget)
        num_new = min(num_left, chunk - num_computed % chunk)  # up to the next fixed boundary
        if num_new > budget:
            self._prefill_first = True
            return 0
        return num_new

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        while self.kv.allocate_slots(seq, num_new) is None:
            victim = self.running.pop()  # newest: least service lost, FCFS order kept
            self._preempt(victim)
            plan.preempted_seq_ids.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, counted: bool = True) -> None:
        """Back to the front of the queue with nothing computed; `counted`: a preemption for the
        stats (a failed step's rollback is not one)."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        if counted:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        # Victims leave newest first, so each goes in front of the previous: FCFS order holds.
        self.waiting.appendleft(seq)

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(seq, lookup=not seq.needs_prompt_logprobs)
            num_new = self._num_tokens_to_schedule(seq, num_cached, budget)
            if num_new == 0 or self.kv.allocate_slots(seq, num_new, computed_blocks) is None:
                break  # FCFS: later arrivals do not overtake the head of the queue
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:  # vLLM's: the prompt's hit when first scheduled (a preempted
                # sequence finds its own output blocks again, which are no prompt tokens)
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            self.kv.cache_full_blocks(seq, num_cached + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append(self._entry(seq, num_new))
            budget -= num_new

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        is_sampling = seq.num_computed_tokens + num_new == seq.num_tokens
        params = seq.sampling_params
        banned = ()
        if is_sampling and seq.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(sorted(self.eos_token_ids))
            banned = eos + tuple(params.stop_token_ids)
        if is_sampling and seq.bad_words_token_ids:  # matched on the output's last tokens only
            longest = max(map(len, seq.bad_words_token_ids))
            recent = seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - longest + 1):]
            banned += bad_words_banned(seq.bad_words_token_ids, recent)
        return ScheduledSeq(seq, seq.num_computed_tokens, num_new, self.kv.block_table(seq.seq_id),
                            is_sampling, banned)

    def update(self, plan: StepPlan, sampled: dict) -> list[Sequence]:
        """Apply a step's results: advance computed counts, append samples, finish what stops."""
        finished = []
        for entry in plan.scheduled:
            seq = entry.seq
            if seq.is_finished:
                continue  # aborted between schedule() and update(); its blocks are already free
            assert seq.num_computed_tokens == entry.num_computed_tokens, f"{seq.seq_id!r} changed mid-step"
            seq.num_computed_tokens += entry.num_scheduled_tokens
            if not entry.is_sampling:
                continue
            seq.append_token(sampled[seq.seq_id])
            reason = self._stop_reason(seq)
            if reason is not None:
                self.finish(seq.seq_id, reason)
                finished.append(seq)
        self.kv.commit_pending()
        return finished

    def rollback(self, plan: StepPlan) -> None:
        """Undo a step that failed before `update`: the prefix-cache hashes it gave are dropped
        (the KV they name may not have been written) and its sequences are preempted, to be
        recomputed if they are not aborted (one that hit a dropped block believes it computed)."""
        self.kv.forget_pending()
        for entry in reversed(plan.scheduled):  # newest first: _preempt keeps FCFS order
            seq = entry.seq
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
                self._preempt(seq, counted=False)

    def _stop_reason(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        token_id = seq.last_token_id
        # The sampler bans stop tokens for the first min_tokens outputs, so the earliest one
        # that may stop is output number min_tokens + 1 (vLLM's semantics).
        if seq.num_output_tokens > params.min_tokens:
            if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
                return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        if self.config.max_model_len is not None and seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def stop_token(self, seq: Sequence) -> int | None:
        """The token that stopped a sequence as vLLM reports it: a stop_token_ids entry or one of the
        model's other EOS ids; None when the tokenizer's EOS did (vLLM checks it first)."""
        token_id, params = seq.last_token_id, seq.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return None if self.primary_eos_token_id in (None, token_id) else token_id
        return token_id if token_id in params.stop_token_ids else None

    def check_integrity(self) -> None:
        """The KV manager's checks plus the queue invariants of the module docstring."""
        self.kv.check_integrity()
        assert len(self.running) <= self.config.max_num_seqs, "more running sequences than max_num_seqs"
        queued = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        assert sorted(map(repr, queued)) == sorted(map(repr, self._seqs)), "a sequence is lost or queued twice"
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING, f"{seq.seq_id!r} running with status {seq.status}"
            assert 0 <= seq.num_computed_tokens < seq.num_tokens, f"{seq.seq_id!r} has nothing left to compute"
            num_slots = len(self.kv.block_table(seq.seq_id)) * self.kv.block_size
            assert num_slots >= seq.num_computed_tokens, f"{seq.seq_id!r} computed tokens without blocks"
        for seq in self.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), seq.status
            assert seq.num_computed_tokens == 0, f"waiting {seq.seq_id!r} has computed tokens"
            assert not self.kv.block_table(seq.seq_id), f"waiting {seq.seq_id!r} holds blocks"
