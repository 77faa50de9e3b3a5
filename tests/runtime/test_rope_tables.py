"""RoPE tables cover what an engine can reach (its max_model_len), not the model's whole context:
a 1M-token context's tables are 1.6 GB (fp32 and bf16) at head_dim 128. Engines sharing a model
keep theirs."""

import json

import torch

from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

CONTEXT = 1 << 20


def _greedy(engine, prompt, max_tokens):
    request = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request and out.finished:
                return out.token_ids


def test_tables_follow_the_engines_and_keep_their_output(tmp_path):
    model = write_tiny_hf_model(tmp_path / "model", "llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": CONTEXT}))
    artifact = build(str(model), preset("w4a16-rtn"), tmp_path / "a", progress=False, log=lambda m: None,
                     use_cache=False).path
    served = load_for_serving(str(artifact))
    rope = served.model.rope
    short = served.engine(max_model_len=48, num_kv_blocks=16)
    assert rope.tables(torch.device("cpu"), torch.float32)[0].shape[0] == 48  # was the whole 2^20 context
    prompt = list(range(10, 40))
    before = _greedy(short, prompt, 18)  # to position 47, the engine's last
    long = served.engine(max_model_len=96, num_kv_blocks=16)
    assert rope.tables(torch.device("cpu"), torch.float32)[0].shape[0] == 96
    assert _greedy(short, prompt, 18) == before  # its decode stack still holds the tables it was given
    assert _greedy(long, prompt, 18) == before
    assert len(_greedy(long, prompt, 66)) == 66  # to position 95
    served.engine(max_model_len=32, num_kv_blocks=16)  # smaller: nothing changes
    assert rope.tables(torch.device("cpu"), torch.float32)[0].shape[0] == 96
    # the dense path (evaluation, calibration) reaches past every engine's positions
    logits = served.model(torch.tensor([list(range(10, 138))]))
    assert logits.shape[1] == 128 and rope.tables(torch.device("cpu"), torch.float32)[0].shape[0] == CONTEXT
