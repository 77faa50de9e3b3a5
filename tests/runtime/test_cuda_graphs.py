"""CUDA-graph decode runner: bucket rule, padded staging, and padded == eager logits.

On CPU the padded static-buffer forward runs eagerly (`use_graphs=False`), which checks the
padding rule with the CPU ops; the graph capture and replay themselves run only on a GPU.
"""

import pytest
import torch

from qkiln.runtime.config import ModelConfig
from qkiln.runtime.cuda_graphs import BATCH_BUCKETS, GraphRunner, bucket_for, is_pure_decode
from qkiln.runtime.engine import EngineConfig, LLMEngine
from qkiln.runtime.model import CausalLM
from qkiln.runtime.runner import ModelRunner
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import byte_tokenizer

BLOCK_SIZE = 4
CONFIG = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=128)


def test_bucket_is_the_smallest_that_fits():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 16, 17, 200, 256)] == [1, 2, 4, 8, 16, 32, 256, 256]
    assert bucket_for(257) is None and bucket_for(0) is None
    assert bucket_for(3, (8, 2)) == 8 and bucket_for(9, (8, 2)) is None


def _engine(device="cpu", dtype=torch.float32, num_prompts=3):
    """An engine whose next plan is pure decode for `num_prompts` sequences of varied length."""
    torch.manual_seed(0)
    model = CausalLM(CONFIG).to(device=device, dtype=dtype).eval()
    engine = LLMEngine(model, byte_tokenizer(), EngineConfig(
        kv_dtype="fp32" if dtype == torch.float32 else "bf16", num_kv_blocks=64,
        block_size=BLOCK_SIZE, max_num_seqs=8, device=device))
    for n in (5, 9, 14, 3, 7)[:num_prompts]:
        engine.add_request(torch.randint(0, 256, (n,)).tolist(),
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the prefills, each sampling its first token
    return model, engine


def test_plans_with_prefill_are_not_pure_decode():
    _, engine = _engine()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    plan = engine.scheduler.schedule()  # 3 decodes + 1 prefill
    assert not is_pure_decode(plan)
    runner = GraphRunner(engine.model, engine.caches, BLOCK_SIZE, "cpu", max_model_len=64)
    assert runner.decode_bucket(plan) is None


def test_staged_inputs_match_the_eager_runner_and_pad_the_rest():
    model, engine = _engine()
    plan = engine.scheduler.schedule()
    assert is_pure_decode(plan) and len(plan.scheduled) == 3
    runner = GraphRunner(model, engine.caches, BLOCK_SIZE, "cpu", max_model_len=64)
    assert runner.decode_bucket(plan) == 4
    n = runner.inputs.stage(plan, BLOCK_SIZE, 4)
    staged = runner.inputs.host_views(4)
    ids, positions, metadata, *_ = ModelRunner(model, engine.caches, BLOCK_SIZE).prepare(plan)
    assert n == 3
    assert torch.equal(staged["input_ids"][:3], ids) and torch.equal(staged["positions"][:3], positions)
    assert torch.equal(staged["slot_mapping"][:3], metadata.slot_mapping)
    assert torch.equal(staged["seq_lens"][:3], metadata.seq_lens)
    width = metadata.block_tables.shape[1]
    assert torch.equal(staged["block_tables"][:3, :width], metadata.block_tables)
    assert not staged["block_tables"][:, width:].any()
    assert staged["input_ids"][3] == 0 and staged["slot_mapping"][3] == -1
    assert staged["seq_lens"][3] == 1 and not staged["block_tables"][3].any()
    assert staged["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    # All sections are views of one buffer, so one copy uploads them.
    base = runner.inputs.host.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in staged.values())


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_padded_decode_equals_eager_and_padding_writes_nothing(num_prompts):
    model, engine = _engine(num_prompts=num_prompts)
    plan = engine.scheduler.schedule()
    eager = ModelRunner(model, engine.caches, BLOCK_SIZE).execute(plan)
    before = [(c.k.clone(), c.v.clone()) for c in engine.caches]
    runner = GraphRunner(model, engine.caches, BLOCK_SIZE, "cpu", max_model_len=64,
                         use_graphs=False)
    padded = runner.execute_padded(plan)
    assert padded.shape == eager.shape == (num_prompts, CONFIG.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    real_slots = [s.block_table[s.num_computed_tokens // BLOCK_SIZE] * BLOCK_SIZE
                  + s.num_computed_tokens % BLOCK_SIZE for s in plan.scheduled]
    is_real = torch.zeros(engine.caches[0].k.shape[:2], dtype=torch.bool).flatten()
    is_real[real_slots] = True
    for (k, v), cache in zip(before, engine.caches):
        for old, new in ((k, cache.k), (v, cache.v)):
            old, new = old.flatten(0, 1), new.flatten(0, 1)  # [slots, Hkv, D]
            assert torch.equal(old[~is_real], new[~is_real])  # padding wrote nothing
            torch.testing.assert_close(old[is_real], new[is_real], rtol=1e-4, atol=1e-5)


def test_cpu_runner_falls_back_to_eager():
    model, engine = _engine()
    plan = engine.scheduler.schedule()
    runner = GraphRunner(model, engine.caches, BLOCK_SIZE, "cpu", max_model_len=64)
    assert not runner.use_graphs
    eager = ModelRunner(model, engine.caches, BLOCK_SIZE).execute(plan)
    assert torch.equal(runner.execute(plan), eager) and not runner.graphs


def test_engine_with_graph_runner_generates_like_the_eager_engine():
    """Swapped into the engine (padded path on CPU): same greedy tokens to the end."""
    outputs = []
    for use_padded in (False, True):
        model, engine = _engine(num_prompts=5)
        if use_padded:
            engine.runner = GraphRunner(model, engine.caches, BLOCK_SIZE, "cpu", max_model_len=64,
                                        max_num_seqs=8, use_graphs=False, pad_decode=True)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            engine.check_integrity()
        outputs.append(done)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graph_replay_equals_eager():
    model, engine = _engine("cuda", torch.bfloat16, num_prompts=5)
    runner = GraphRunner(model, engine.caches, BLOCK_SIZE, "cuda", max_model_len=64,
                         max_num_seqs=8)
    eager_runner = ModelRunner(model, engine.caches, BLOCK_SIZE, "cuda")
    for _ in range(3):  # capture once, then replay with new lengths
        plan = engine.scheduler.schedule()
        eager = eager_runner.execute(plan)
        replayed = runner.execute(plan)
        assert runner.graphs and set(runner.graphs) <= set(BATCH_BUCKETS)
        torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
        tokens = dict(zip((s.seq_id for s in plan.sampling), eager.argmax(-1).tolist()))
        engine.scheduler.update(plan, tokens)
