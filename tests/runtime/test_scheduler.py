"""Scheduler + KV manager in scripted scenarios, with integrity checks after every step.

The test driver `PagedTokenModel` stands in for the model runner: it writes each scheduled
token's id into a simulated paged KV pool through the plan's block table, then checks that every
earlier position of the sequence reads back the right token id through that table. A stale
prefix hit, a wrong block table or a block reused while still referenced shows up as a mismatch.
Its "next token" is a deterministic function of the whole token history, so any scheduling
(chunks, preemption, prefix hits) must reproduce `reference_output` exactly.
"""

import random

import pytest

from qkiln.errors import RequestError
from qkiln.runtime.block_manager import KVCacheManager
from qkiln.runtime.sampling_params import SamplingParams
from qkiln.runtime.scheduler import Scheduler, SchedulerConfig
from qkiln.runtime.sequence import Sequence, SequenceStatus

VOCAB = 97
EOS = 96


def next_token(history) -> int:
    """Deterministic in the token history; never EOS unless a test asks for it."""
    h = len(history)
    for t in history[-6:]:
        h = (h * 31 + t) % 1_000_003
    return h % (VOCAB - 1)


def reference_output(prompt, params: SamplingParams, eos_ids=()) -> tuple[list[int], str]:
    """What one sequence alone, unscheduled, would produce under the same stop rules."""
    tokens, out = list(prompt), []
    for _ in range(params.max_tokens):
        out.append(next_token(tokens))
        tokens.append(out[-1])
        may_stop = len(out) > params.min_tokens
        if may_stop and (out[-1] in params.stop_token_ids or (not params.ignore_eos and out[-1] in eos_ids)):
            return out, "stop"
    return out, "length"


class PagedTokenModel:
    def __init__(self, kv: KVCacheManager):
        self.block_size = kv.block_size
        self.pool = [[None] * kv.block_size for _ in range(kv.num_blocks)]  # [num_blocks][block_size]

    def _slot(self, table, pos):
        return self.pool[table[pos // self.block_size]], pos % self.block_size

    def step(self, plan) -> dict:
        for entry in plan.scheduled:  # all writes first, as each layer does before attention
            for pos, token_id in zip(entry.positions, entry.token_ids):
                block, offset = self._slot(entry.block_table, pos)
                block[offset] = token_id
        sampled = {}
        for entry in plan.scheduled:
            end = entry.num_computed_tokens + entry.num_scheduled_tokens
            history = entry.seq.token_ids[:end]
            for pos in range(end):
                block, offset = self._slot(entry.block_table, pos)
                assert block[offset] == history[pos], f"{entry.seq_id!r} reads a wrong token at position {pos}"
            if entry.is_sampling:
                sampled[entry.seq_id] = next_token(history)
        return sampled


def make(num_blocks=64, block_size=4, prefix=True, eos=(EOS,), **config):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(**config), kv, eos_token_ids=eos), PagedTokenModel(kv)


def check_plan(sched: Scheduler, plan) -> None:
    cfg = sched.config
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(plan.scheduled) <= cfg.max_num_seqs
    assert len({e.seq_id for e in plan.scheduled}) == len(plan.scheduled)
    for e in plan.scheduled:
        end = e.num_computed_tokens + e.num_scheduled_tokens
        assert e.num_scheduled_tokens > 0 and end <= e.seq.num_tokens
        assert len(e.block_table) * sched.kv.block_size >= end
        assert e.is_sampling == (end == e.seq.num_tokens)


def step(sched, model, plans=None):
    plan = sched.schedule()
    sched.check_integrity()
    check_plan(sched, plan)
    if plans is not None:
        plans.append(plan)
    finished = sched.update(plan, model.step(plan))
    sched.check_integrity()
    return plan, finished


def run(sched, model, arrivals: dict, aborts: dict | None = None, max_steps=2000):
    """Drive to completion. arrivals/aborts: step -> sequences / seq ids. Returns (finished, plans)."""
    finished, plans, aborts = {}, [], aborts or {}
    for i in range(max_steps):
        for seq in arrivals.get(i, ()):
            sched.add(seq)
        for seq_id in aborts.get(i, ()):
            sched.abort(seq_id)
        if not sched.has_unfinished() and i > max(arrivals, default=0) and i > max(aborts, default=0):
            break
        _, done = step(sched, model, plans)
        finished.update((s.seq_id, s) for s in done)
    else:
        raise AssertionError("scheduler did not finish: starved or livelocked")
    assert sched.kv.usage == 0.0, "blocks still held after every sequence finished"
    return finished, plans


def assert_matches_reference(seqs, eos_ids=(EOS,)):
    for seq in seqs:
        expected, reason = reference_output(seq.prompt_token_ids, seq.sampling_params, eos_ids)
        assert seq.output_token_ids == expected, seq.seq_id
        assert seq.finish_reason == reason and seq.is_finished


def seq(seq_id, prompt, **params):
    return Sequence(seq_id, list(prompt), SamplingParams(**params))


def test_prefix_hit_second_sequence_reuses_blocks():
    sched, model = make(block_size=4)
    a = seq("a", range(10, 20), max_tokens=3)
    b = seq("b", list(range(10, 19)) + [5, 6], max_tokens=3)  # 9 shared tokens: 2 full blocks
    finished, plans = run(sched, model, {0: [a], 2: [b]})
    first_a = next(e for p in plans for e in p.scheduled if e.seq_id == "a")
    first_b = next(e for p in plans for e in p.scheduled if e.seq_id == "b")
    assert first_b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert first_b.block_table[:2] == first_a.block_table[:2]
    assert sched.kv.prefix_cache_hits == 8
    assert sched.kv.prefix_cache_queries == a.num_prompt_tokens + b.num_prompt_tokens
    assert_matches_reference([a, b])


def test_chunked_prefill_under_small_budget():
    sched, model = make(max_num_batched_tokens=5)
    a = seq("a", range(23), max_tokens=4)
    _, plans = run(sched, model, {0: [a]})
    chunks = [p.scheduled[0].num_scheduled_tokens for p in plans]
    assert chunks == [5, 5, 5, 5, 3, 1, 1, 1]
    assert [p.scheduled[0].is_sampling for p in plans] == [False] * 4 + [True] * 4
    assert_matches_reference([a])


def test_long_prefill_threshold_caps_one_sequences_chunk():
    sched, model = make(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    a = seq("a", range(20), max_tokens=2)
    _, plans = run(sched, model, {0: [a]})
    assert [p.num_batched_tokens for p in plans] == [8, 8, 4, 1]
    assert_matches_reference([a])


def test_decode_and_prefill_chunk_share_a_step():
    sched, model = make(max_num_batched_tokens=8)
    a = seq("a", range(3), max_tokens=8)
    b = seq("b", range(40, 60), max_tokens=2)
    finished, plans = run(sched, model, {0: [a], 2: [b]})
    mixed = plans[2]
    by_id = {e.seq_id: e for e in mixed.scheduled}
    assert [e.seq_id for e in mixed.scheduled] == ["a", "b"]  # running first
    assert by_id["a"].num_scheduled_tokens == 1 and by_id["a"].is_sampling
    assert by_id["b"].num_scheduled_tokens == 7 and not by_id["b"].is_sampling
    assert_matches_reference([a, b])


@pytest.mark.parametrize("num_blocks,budget,prompt_len,max_tokens,num_seqs,prefix", [
    (8, 16, 6, 14, 3, True),
    (4, 4, 3, 10, 2, False),  # the victim would fit again at once: it must still wait a step
])
def test_preemption_of_newest_then_identical_completion(num_blocks, budget, prompt_len, max_tokens, num_seqs,
                                                         prefix):
    sched, model = make(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, prefix=prefix)
    seqs = [seq(f"s{i}", range(10 * i, 10 * i + prompt_len), max_tokens=max_tokens) for i in range(num_seqs)]
    for s in seqs:
        sched.add(s)
    finished, num_preempted_steps = {}, 0
    while sched.has_unfinished():
        running_before = [s.seq_id for s in sched.running]
        plan, done = step(sched, model)
        finished.update((s.seq_id, s) for s in done)
        preempted = plan.preempted_seq_ids
        if preempted:
            num_preempted_steps += 1
            assert preempted == running_before[::-1][:len(preempted)]  # newest first
            assert [s.seq_id for s in sched.waiting][:len(preempted)] == preempted[::-1]
            assert all(sched.get(i).num_computed_tokens == 0 for i in preempted)
            scheduled_ids = {e.seq_id for e in plan.scheduled}
            assert scheduled_ids <= set(running_before) - set(preempted)  # no admissions, no re-admission
    assert num_preempted_steps > 0 and sched.num_preemptions > 0
    # a preempted sequence re-admitted finds its own blocks, output included: its reported prompt hit
    # stays the one of its first admission (it had read 12 cached tokens of a 6-token prompt)
    assert all(s.num_cached_tokens <= s.num_prompt_tokens for s in seqs)
    assert sorted(finished) == [s.seq_id for s in seqs]
    assert sched.kv.usage == 0.0
    assert_matches_reference(seqs)


def test_abort_mid_prefill_mid_decode_and_between_schedule_and_update():
    sched, model = make(max_num_batched_tokens=6)
    a = seq("a", range(30), max_tokens=4)  # still prefilling at step 2
    b = seq("b", range(50, 52), max_tokens=20)
    c = seq("c", range(60, 63), max_tokens=5)
    sched.add(b)
    step(sched, model)
    sched.add(a)
    sched.add(c)
    step(sched, model)
    assert 0 < a.num_computed_tokens < a.num_prompt_tokens
    assert sched.abort("a") is a and a.finish_reason == "abort"
    sched.check_integrity()
    step(sched, model)
    assert b.num_output_tokens >= 2
    plan = sched.schedule()
    assert "b" in [e.seq_id for e in plan.scheduled]
    sched.abort("b")  # the engine's client went away while the step ran
    sched.check_integrity()
    sched.update(plan, model.step(plan))
    sched.check_integrity()
    assert b.status == SequenceStatus.FINISHED_ABORTED and sched.abort("b") is None
    run(sched, model, {})
    assert_matches_reference([c])


def test_out_of_blocks_admits_only_what_fits_and_drops_nothing():
    sched, model = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    seqs = [seq(f"s{i}", range(8 * i, 8 * i + 7), max_tokens=2) for i in range(5)]  # 2 blocks each
    with pytest.raises(RequestError, match="KV slots"):
        sched.add(seq("huge", range(15), max_tokens=4))  # 18 slots > 16
    arrivals = {0: seqs}
    max_running = 0
    for s in arrivals.pop(0):
        sched.add(s)
    while sched.has_unfinished():
        plan, _ = step(sched, model)
        max_running = max(max_running, len(plan.scheduled))
        assert sum(len(e.block_table) for e in plan.scheduled) <= 4
    assert max_running == 2
    assert_matches_reference(seqs)


def test_max_num_seqs_and_fcfs_admission():
    sched, model = make(max_num_seqs=2)
    seqs = [seq(f"s{i}", range(i, i + 3), max_tokens=3 + i) for i in range(5)]
    _, plans = run(sched, model, {0: seqs})
    assert max(len(p.scheduled) for p in plans) == 2
    admitted = []
    for p in plans:
        admitted += [e.seq_id for e in p.scheduled if e.seq_id not in admitted]
    assert admitted == [s.seq_id for s in seqs]
    assert_matches_reference(seqs)


def test_stop_conditions_eos_stop_ids_min_tokens_ignore_eos():
    prompt = list(range(7))
    ref, _ = reference_output(prompt, SamplingParams(max_tokens=12))
    stop_id = ref[3]
    cases = {
        "eos": dict(max_tokens=12),
        "ignore_eos": dict(max_tokens=12, ignore_eos=True),
        "stop_id": dict(max_tokens=12, stop_token_ids=(stop_id,)),
        "min_tokens": dict(max_tokens=12, stop_token_ids=(stop_id,), min_tokens=4),
        "length": dict(max_tokens=2),
    }
    for name, params in cases.items():
        eos = (stop_id,) if name in ("eos", "ignore_eos") else ()
        sched, model = make(eos=eos)
        s = seq(name, prompt, **params)
        _, plans = run(sched, model, {0: [s]})
        assert_matches_reference([s], eos_ids=eos)
        expect_reason = {"eos": "stop", "stop_id": "stop", "length": "length"}.get(name)
        if expect_reason:
            assert s.finish_reason == expect_reason
        banned = [e.banned_token_ids for p in plans for e in p.scheduled if e.is_sampling]
        num_banned = params.get("min_tokens", 0)
        assert all(stop_id in b for b in banned[:num_banned]) and not any(banned[num_banned:])
    assert len(reference_output(prompt, SamplingParams(**cases["eos"]), (stop_id,))[0]) <= 4


def test_max_model_len_and_engine_finish():
    sched, model = make(max_model_len=12)
    with pytest.raises(RequestError, match="context"):
        sched.add(seq("long", range(13)))
    with pytest.raises(RequestError, match="empty"):
        sched.add(seq("empty", []))
    with pytest.raises(RequestError, match="max_tokens"):
        sched.add(seq("negative", range(3), max_tokens=-1))
    assert not sched.has_unfinished()
    a = seq("a", range(8), max_tokens=100)
    b = seq("b", range(20, 25), max_tokens=100)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    assert sched.finish("b", "stop") is b and b.finish_reason == "stop"  # e.g. a stop string matched
    assert sched.finish("b", "stop") is None
    run(sched, model, {})
    assert a.finish_reason == "length" and a.num_tokens == 12
    full = seq("full", range(12), max_tokens=100)  # fills the context: computed, then one token
    sched.add(full)
    run(sched, model, {})
    assert full.finish_reason == "length" and full.num_output_tokens == 1


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
def test_staggered_random_workload_matches_reference(prefix, chunked):
    rng = random.Random(1234 + prefix)
    sched, model = make(num_blocks=12, block_size=4, prefix=prefix, max_num_batched_tokens=10, max_num_seqs=4,
                        enable_chunked_prefill=chunked)
    shared = [rng.randrange(VOCAB - 1) for _ in range(9)]
    arrivals, aborts, seqs = {}, {}, []
    for i in range(14):
        prompt = (shared[:rng.randrange(10)] + [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 8))])
        s = seq(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), ignore_eos=True)
        arrivals.setdefault(rng.randrange(30), []).append(s)
        seqs.append(s)
    for s in rng.sample(seqs, 3):
        aborts.setdefault(rng.randrange(40), []).append(s.seq_id)
    finished, plans = run(sched, model, arrivals, aborts)
    if not chunked:  # a chunk that does not sample ends on a fixed position, preempted and all
        assert all((e.num_computed_tokens + e.num_scheduled_tokens) % 10 == 0
                   for p in plans for e in p.scheduled if not e.is_sampling)
    aborted = [s for s in seqs if s.finish_reason == "abort"]
    completed = [s for s in seqs if s.finish_reason != "abort"]
    assert len(completed) >= 11 and all(s.seq_id in finished for s in completed)
    assert_matches_reference(completed)
    for s in aborted:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.sampling_params)[0][:s.num_output_tokens]
    if prefix:
        assert sched.kv.prefix_cache_hits > 0


def _chunk_ends(plans, seq_id) -> list[int]:
    return [e.num_computed_tokens + e.num_scheduled_tokens for p in plans for e in p.scheduled
            if e.seq_id == seq_id and not e.is_sampling]


@pytest.mark.parametrize("threshold", [0, 6])
def test_fixed_chunks_do_not_depend_on_what_else_runs(threshold):
    """Chunked prefill off: a prompt is cut at the same positions alone and under load (with it on,
    where the budget ran out: the cut moved with the other requests, and its logprobs with it)."""
    chunk = threshold or 8
    alone_sched, model = make(max_num_batched_tokens=8, long_prefill_token_threshold=threshold,
                              enable_chunked_prefill=False)
    alone = seq("p", range(30), max_tokens=2)
    _, plans = run(alone_sched, model, {0: [alone]})
    expected = list(range(chunk, 30, chunk))  # the last chunk, to 30, samples
    assert _chunk_ends(plans, "p") == expected
    for others in ([seq(f"d{i}", range(50 + i, 53 + i), max_tokens=12) for i in range(3)],
                   [seq("early", range(70, 75), max_tokens=20), seq("late", range(80, 91), max_tokens=3)]):
        sched, model = make(max_num_batched_tokens=8, long_prefill_token_threshold=threshold,
                            enable_chunked_prefill=False)
        loaded = seq("p", range(30), max_tokens=2)
        finished, plans = run(sched, model, {0: others[:1], 1: [loaded], 2: others[1:]})
        assert _chunk_ends(plans, "p") == expected
        for p in plans:  # a chunk that waited for room made the next step prefill-only: nothing starved
            assert p.num_batched_tokens <= 8
        assert_matches_reference([loaded, *others])


def test_fixed_chunks_start_at_a_prefix_hit_and_end_on_the_fixed_positions():
    sched, model = make(block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = seq("a", range(10, 30), max_tokens=2), seq("b", list(range(10, 22)) + [1, 2, 3, 4, 5], max_tokens=2)
    _, plans = run(sched, model, {0: [a], 5: [b]})
    first_b = next(e for p in plans for e in p.scheduled if e.seq_id == "b")
    assert first_b.num_computed_tokens == 12  # three cached blocks
    assert _chunk_ends(plans, "b") == [16]  # then 16..17 in the sampling step: the fixed positions hold
    assert_matches_reference([a, b])
