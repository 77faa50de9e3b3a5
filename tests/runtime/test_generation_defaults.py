"""The model's generation_config.json sampling values as a request's defaults (vLLM's
`generation_config="auto"`): read as vLLM reads them, kept through a build, used offline when no
SamplingParams is given and by the server for the fields a request leaves out; "vllm" turns them off."""

import json
import warnings

import httpx
import pytest

from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from loopback import serving_model
from tiny_models import write_tiny_hf_model

# temperature 0 (greedy) makes "took the model's defaults" visible as a deterministic output;
# top_k 50 is transformers' own default, so it recommends nothing (vLLM reads the diff)
GENERATION_CONFIG = {"bos_token_id": 256, "eos_token_id": 257, "do_sample": True, "temperature": 0.0,
                     "top_p": 0.9, "top_k": 50, "max_new_tokens": 7}
RECOMMENDED = {"temperature": 0.0, "top_p": 0.9, "max_tokens": 7}
ENGINE_KW = dict(num_kv_blocks=32, max_model_len=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


def test_the_values_read_are_vllm_s():
    assert ModelConfig.from_hf(_hf(), GENERATION_CONFIG).sampling_defaults == RECOMMENDED
    assert ModelConfig.from_hf(_hf(), {"temperature": 1.0, "top_k": 50, "eos_token_id": 2}).sampling_defaults is None
    assert ModelConfig.from_hf(_hf(), {"top_k": 20, "min_p": 0, "repetition_penalty": 1.05}).sampling_defaults == \
        {"top_k": 20, "min_p": 0, "repetition_penalty": 1.05}
    round_trip = ModelConfig.from_dict(ModelConfig.from_hf(_hf(), GENERATION_CONFIG).to_dict())
    assert round_trip.sampling_defaults == RECOMMENDED


def test_offline_generate_without_params_takes_them(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", **ENGINE_KW)
    assert llm.get_default_sampling_params() == SamplingParams(**RECOMMENDED)
    out = llm.generate("hello world")[0]
    greedy = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=7))[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 7
    plain = LLM(str(model_dir), dtype="fp32", generation_config="vllm", **ENGINE_KW)
    assert plain.get_default_sampling_params() == SamplingParams()


def test_the_engines_without_params_take_them_as_llm_does(model_dir):
    """LLMEngine.add_request and AsyncLLMEngine.generate fell back to SamplingParams() (16 tokens,
    temperature 1) where LLM.generate took the model's values (probe s50)."""
    import asyncio

    from qkiln.runtime.async_engine import AsyncLLMEngine

    llm = LLM(str(model_dir), dtype="fp32", **ENGINE_KW)
    expected = llm.generate("hello world")[0].token_ids
    request_id = llm.engine.add_request("hello world")
    assert llm.engine.requests[request_id].seq.sampling_params.max_tokens == 7
    llm.engine.abort_request(request_id)

    async def stream(engine):
        return [out async for out in engine.generate("hello world")][-1].token_ids

    with AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW) as engine:
        assert asyncio.run(stream(engine)) == expected


def test_an_out_of_range_value_is_left_out_with_a_warning(tmp_path):
    path = write_tiny_hf_model(tmp_path, "llama")
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0.0, "temperature": 0.5}))
    with pytest.warns(UserWarning, match="sets top_p 0.0, which is not used"):
        llm = LLM(str(path), dtype="fp32", **ENGINE_KW)
    assert llm.engine.sampling_defaults == {"temperature": 0.5}


def test_a_built_artifact_keeps_them(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    art = build(str(model_dir), preset("fp8-w8a8-rtn"), tmp_path / "a", progress=False, log=lambda m: None).path
    assert json.loads((art / "manifest.json").read_text())["architecture"]["sampling_defaults"] == RECOMMENDED
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert LLM(str(art), **ENGINE_KW).get_default_sampling_params() == SamplingParams(**RECOMMENDED)
    assert not [w for w in caught if "generation_config" in str(w.message)]


def test_the_server_fills_the_fields_a_request_leaves_out(model_dir):
    messages = [{"role": "user", "content": "hi there"}]
    with serving_model(model_dir, dtype="fp32", **ENGINE_KW) as (_, server), \
            httpx.Client(base_url=server.url, timeout=60) as client:
        left_out = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True}).json()
        greedy = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True,
                                                           "temperature": 0, "max_tokens": 7}).json()
        assert left_out["usage"]["completion_tokens"] == 7  # the model's max_new_tokens
        assert left_out["choices"][0]["message"] == greedy["choices"][0]["message"]
        # a field the request sets is its own: ten tokens, sampled at temperature 1 with seeds
        sampled = [client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True, "max_tokens": 10,
                                                        "temperature": 1.0, "seed": s}).json() for s in range(4)]
        assert {s["usage"]["completion_tokens"] for s in sampled} == {10}
        assert len({s["choices"][0]["text"] for s in sampled}) > 1
    with serving_model(model_dir, dtype="fp32", generation_config="vllm", **ENGINE_KW) as (_, server), \
            httpx.Client(base_url=server.url, timeout=60) as client:
        body = client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True}).json()
        assert body["usage"]["completion_tokens"] == 16  # OpenAI's default for completions


def _hf():
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 260, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_a_default_max_tokens_is_cut_to_fit_and_one_the_request_sets_is_not(tmp_path):
    """vLLM's rule: a left-out max_tokens is the smaller of the API's default (16 for completions)
    and the model's max_new_tokens, cut to the room the prompt leaves; a set one that does not fit
    is refused (the model's 1000 had made every request that left it out a 400)."""
    path = write_tiny_hf_model(tmp_path, "llama")
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 1000}))
    messages = [{"role": "user", "content": "hi"}]
    with serving_model(path, dtype="fp32", num_kv_blocks=8, max_model_len=64) as (engine, server), \
            httpx.Client(base_url=server.url, timeout=60) as client:
        chat = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True}).json()
        prompt_tokens = chat["usage"]["prompt_tokens"]
        assert chat["usage"]["completion_tokens"] == 64 - prompt_tokens
        short = client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True}).json()
        assert short["usage"]["completion_tokens"] == 16
        long_prompt = list(range(3, 3 + 60))
        cut = client.post("/v1/completions", json={"prompt": long_prompt, "ignore_eos": True}).json()
        assert cut["usage"]["completion_tokens"] == 4
        refused = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 16})
        assert refused.status_code == 400 and "does not fit" in refused.json()["error"]["message"]
