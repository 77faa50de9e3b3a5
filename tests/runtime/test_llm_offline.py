"""The offline `LLM`: a call that fails part-way (a refused prompt, an interrupt) leaves nothing
behind, so the next call works; mismatched prompt / params lists are refused, not truncated."""

import dataclasses

import pytest
import torch

from qkiln.errors import QkilnError, RequestError, TargetUnavailableError
from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(write_tiny_hf_model(tmp_path_factory.mktemp("m"), "llama")), dtype="fp32",
               num_kv_blocks=32, max_model_len=128)


def test_a_refused_prompt_in_a_batch_leaves_the_llm_usable(llm):
    expected = llm.generate(["abc"], GREEDY)[0].token_ids
    with pytest.raises(RequestError, match="context"):
        llm.generate(["abc", "x" * 500], GREEDY)  # the second is longer than the context
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0
    assert llm.generate(["abc"], GREEDY)[0].token_ids == expected


def test_nan_logits_raise_instead_of_answering(tmp_path):
    """A model whose activations overflow gave NaN logits, and argmax made them token 0 each step."""
    from safetensors.torch import load_file, save_file

    from qkiln.runtime.engine import NonFiniteLogitsError

    model = write_tiny_hf_model(tmp_path, "llama3")  # untied: token 7's logit stays finite for the others
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.embed_tokens.weight"][7] = float("nan")
    save_file(tensors, str(model / "model.safetensors"))
    llm = LLM(str(model), dtype="fp32", num_kv_blocks=32, max_model_len=128)
    for params in (GREEDY, SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=2)):
        with pytest.raises(NonFiniteLogitsError, match=r"not finite \(NaN or inf\) for request '[^']+' at output token 1:") \
                as failed:
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, 7]}, [6, 5]], params)
        assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0
        # the overflowing prompt threw the batch's other outputs away; they ran to the end
        good, bad, other = failed.value.outputs
        assert bad is None and "prompt(s) 1 of 3 failed" in failed.value.__notes__[0]
        alone = llm.generate([{"prompt_token_ids": [5, 6]}, [6, 5]], params)
        assert [good.outputs[0].token_ids, other.outputs[0].token_ids] == [a.outputs[0].token_ids for a in alone]
        assert len(good.outputs[0].token_ids) == 5


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_an_overflowing_prompt_leaves_no_nan_in_a_shared_prefix(tmp_path, monkeypatch, kernels):
    """A NaN at one position of a prefill chunk reached the chunk's earlier rows (a hidden key has
    probability 0, but 0 * NaN is NaN), whose KV the prefix cache then kept under clean tokens:
    every later request sharing that prefix failed too, until the block was evicted."""
    from safetensors.torch import load_file, save_file

    from qkiln.plugins import cpu_attention, cpu_native
    from qkiln.runtime.engine import NonFiniteLogitsError

    if kernels == "torch":
        monkeypatch.setattr(cpu_attention, "_native_for", lambda *a: None)
    elif cpu_native.native_extension() is None:
        pytest.skip("qkiln's native CPU kernels are not built here")
    model = write_tiny_hf_model(tmp_path, "llama3")
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.embed_tokens.weight"][200] = float("nan")  # stands in for an fp16 overflow
    save_file(tensors, str(model / "model.safetensors"))
    llm = LLM(str(model), dtype="fp32", num_kv_blocks=64, max_num_batched_tokens=24)
    shared = list(range(10, 26))  # one block: a system prompt, say
    bad, good = shared + [30, 31, 32, 200] + list(range(40, 60)), shared + list(range(100, 130))
    expected = llm.generate([{"prompt_token_ids": good}], GREEDY)[0].outputs[0].token_ids
    llm.engine.kv_manager.reset_prefix_cache()
    with pytest.raises(NonFiniteLogitsError):
        llm.generate([{"prompt_token_ids": bad}], GREEDY)  # computes the shared block, in one chunk with 200
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": good}], GREEDY)[0]
        assert out.num_cached_tokens >= 16 and out.outputs[0].token_ids == expected  # the bad one's block, then its own


def test_a_non_finite_prompt_logprob_raises(tmp_path):
    """Logits that overflow at one prompt position only (the sampled row is finite) were returned as
    a NaN prompt logprob of rank 0."""
    from safetensors.torch import load_file, save_file

    from qkiln.runtime.engine import NonFiniteLogitsError

    model = write_tiny_hf_model(tmp_path, "llama3")
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.embed_tokens.weight"][7] = 0  # token 7's hidden state lies along channel 0 ...
    tensors["model.embed_tokens.weight"][7, 0] = 1.0
    tensors["lm_head.weight"][100] = 0  # ... where token 100's logit is 1e38 x that channel: inf there only
    tensors["lm_head.weight"][100, 0] = 1e38
    save_file(tensors, str(model / "model.safetensors"))
    llm = LLM(str(model), dtype="fp32", num_kv_blocks=32, max_model_len=128)
    prompt = {"prompt_token_ids": [5, 7, 9, 10]}
    with pytest.raises(NonFiniteLogitsError, match=r"not finite \(NaN or inf\) for request '[^']+' at prompt token 3 "):
        llm.generate([prompt], dataclasses.replace(GREEDY, prompt_logprobs=0))
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0
    assert len(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids) == 5  # its output row is finite


def test_an_interrupt_leaves_the_llm_usable(llm, monkeypatch):
    expected = llm.generate(["hello"], GREEDY)[0].token_ids
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello", "world"], GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0
    assert llm.generate(["hello"], GREEDY)[0].token_ids == expected


def test_a_progress_bar_by_default_as_in_vllm(llm, capsys):
    llm.generate(["abc", "def"], GREEDY)
    bar = capsys.readouterr().err
    assert "generate" in bar and "2/2" in bar
    llm.generate(["abc"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    made = []

    class Bar:  # vLLM takes a tqdm-like factory (a notebook's, a logger's): called, then update and close
        def __init__(self, total, desc, dynamic_ncols):  # what vLLM passes, no more (unit= broke one)
            made.append(total)

        def update(self, n=1):
            made.append(n)

        def close(self):
            made.append("closed")

    llm.generate(["abc", "def"], GREEDY, use_tqdm=Bar)
    assert made[0] == 2 and sum(made[1:-1]) == 2 and made[-1] == "closed"


def test_an_empty_token_list_is_named_as_empty(llm):
    with pytest.raises(RequestError, match="prompt 1 is empty"):
        llm.generate(["a", []], GREEDY)


def test_params_list_must_match_the_prompts(llm):
    with pytest.raises(RequestError, match="3 prompts but 1 SamplingParams"):
        llm.generate(["a", "b", "c"], [GREEDY])
    assert len(llm.generate(["a", "b"], [GREEDY, GREEDY])) == 2
    assert len(llm.generate(["a", "b"], (GREEDY, GREEDY))) == 2  # a tuple too, as vLLM takes any sequence


def test_prompts_in_vllm_s_forms(llm):
    import numpy as np
    import torch

    ids = llm.tokenizer.encode("hello")
    expected = llm.generate("hello", GREEDY)[0].token_ids
    for prompt in ({"prompt": "hello"}, {"prompt_token_ids": ids}, np.array(ids), torch.tensor(ids), tuple(ids),
                   [np.int64(t) for t in ids]):
        assert llm.generate(prompt, sampling_params=GREEDY)[0].token_ids == expected, type(prompt)
    assert [o.token_ids for o in llm.generate(np.array([ids, ids]), GREEDY)] == [expected, expected]
    for bad, message in ((None, "got NoneType"), ([None], "prompt 0 must be"), ({"text": "hi"}, "got keys"),
                         ([{"prompt_token_ids": "hi"}], "got keys")):
        with pytest.raises(RequestError, match=message):
            llm.generate(bad, GREEDY)
    assert not llm.engine.has_unfinished()


def test_unknown_llm_options_are_named_before_loading():
    with pytest.raises(TypeError, match="no option gpu_memory_utilization; .* max_num_seqs"):
        LLM("no-such-model", gpu_memory_utilization=0.9)
    with pytest.raises(TypeError, match="model must be a path or a name .* got NoneType"):  # was "'None' not found"
        LLM(None)
    # a bad value too: "no-such-model" would fail to load, so these are checked first (were after a
    # load of seconds to minutes)
    for bad, message in ((dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
                         (dict(kv_dtype="int3"), "kv_dtype must be 'auto'"),
                         (dict(generation_config="off"), "generation_config must be"),
                         (dict(device="gpu"), "device 'gpu': qkiln runs on 'cpu' or 'cuda'")):
        with pytest.raises(QkilnError, match=message):
            LLM("no-such-model", **bad)
    if not torch.cuda.is_available():  # was torch's AssertionError, after the whole load
        with pytest.raises(TargetUnavailableError, match="no CUDA GPU"):
            LLM("no-such-model", device="cuda")


def test_api_values_of_the_wrong_kind_are_request_errors(llm):
    # each had escaped as a builtin TypeError / KeyError from deep inside
    with pytest.raises(RequestError, match="stop must be a string or a list of strings, got int 5"):
        SamplingParams(stop=5)
    with pytest.raises(RequestError, match="bad_words must be"):
        SamplingParams(bad_words=7)
    with pytest.raises(RequestError, match="messages must be one conversation.*got dict"):
        llm.chat({"role": "user", "content": "hi"})
    with pytest.raises(RequestError, match="chat_template_kwargs must be a dict"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs=5)
    for prompt in ("hi \ud800", {"prompt": "hi \ud800"}):
        with pytest.raises(RequestError, match="prompt 0 holds a lone UTF-16 surrogate at character 3"):
            llm.generate(prompt, use_tqdm=False)
    with pytest.raises(RequestError, match="a message's content holds a lone UTF-16 surrogate"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], use_tqdm=False)
    assert SamplingParams(stop={"a"}).stop == ("a",) and SamplingParams(stop=(s for s in ["b"])).stop == ("b",)


def test_an_interrupt_after_sampling_aborts_the_requests_not_yet_answered(llm):
    """Tokens are appended when the step's outputs are made: an interrupt there left the text a token
    short of the tokens, and a finished request in `requests` for good (its id "in use") (probe s50)."""
    engine = llm.engine
    first = engine.add_request("hello", GREEDY, "first")
    second = engine.add_request("world", dataclasses.replace(GREEDY, max_tokens=1), "second")
    postprocess = engine._postprocess

    def interrupted(s, *args):
        if s.seq_id == second:
            raise KeyboardInterrupt
        return postprocess(s, *args)

    engine._postprocess = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        del engine._postprocess
    assert second not in engine.requests and first in engine.requests  # the one answered goes on
    engine.abort_request(first)
    assert not engine.has_unfinished() and engine.kv_manager.usage == 0.0
    engine.add_request("world", GREEDY, "second")  # its id is free again
    engine.abort_request("second")


def test_arrival_time_is_vllm_s_wall_clock_time(llm):
    """It was time.perf_counter(): a vLLM caller's time.time() gave latencies of -1.8e9 s."""
    import time

    engine = llm.engine
    engine.add_request("hello", dataclasses.replace(GREEDY, max_tokens=2), "late", arrival_time=time.time() - 2.0)
    while engine.has_unfinished():
        finished = [out for out in engine.step() if out.finished]
    assert 2.0 <= finished[0].metrics["e2e"] < 60 and finished[0].metrics["queue"] < 2.0


def test_the_offline_api_imports_from_the_top_package_as_vllm_s_does():
    import qkiln
    from qkiln import SamplingParams as TopSamplingParams

    assert qkiln.LLM is LLM and TopSamplingParams is SamplingParams


def test_two_threads_share_one_llm(llm):
    """Each call stepped the shared engine and took the other's outputs (a KeyError, a cache_write error)."""
    from concurrent.futures import ThreadPoolExecutor

    expected = {p: llm.generate(p, GREEDY)[0].token_ids for p in ("abc", "hello world")}
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: llm.generate([p] * 3, GREEDY), ["abc", "hello world"] * 2))
    assert [[o.token_ids for o in outs] for outs in got] == [[expected[p]] * 3 for p in ["abc", "hello world"] * 2]


def test_chat_renders_the_template_without_a_second_bos(tmp_path):
    """A template that starts with bos_token, with a tokenizer that adds BOS (Llama, Mistral): encoding the
    rendered text as a prompt put two BOS tokens first; chat() tokenizes it as the server does."""
    import json

    model = write_tiny_hf_model(tmp_path / "m", "llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True, "chat_template": template}))
    llm = LLM(str(model), dtype="fp32", num_kv_blocks=32, max_model_len=128)
    bos = llm.tokenizer.bos_token_id
    conversation = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(conversation, GREEDY)
    assert out.prompt_token_ids.count(bos) == 1 and out.prompt_token_ids[0] == bos
    text = llm.tokenizer.apply_chat_template(conversation)
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert [o.prompt_token_ids for o in llm.chat([conversation, conversation], GREEDY)] == [out.prompt_token_ids] * 2
    # vLLM's tools: variables of the template, which describes them to the model
    tooled = "{% for t in tools or [] %}[tool {{ t['name'] }}]{% endfor %}" + template
    (out,) = llm.chat(conversation, GREEDY, chat_template=tooled, tools=[{"name": "weather"}])
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False).startswith("[tool weather]")


def test_a_kv_fp8_artifact_serves_with_another_kv_dtype(tmp_path, monkeypatch):
    """--kv-dtype / kv_dtype overrides the artifact's cache: its fp8 scales have no place in a bf16
    or int4 cache (they crashed the engine's start)."""
    import dataclasses

    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset
    from tiny_models import write_tiny_model_and_text

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, text = write_tiny_model_and_text(tmp_path)
    recipe = preset("w4a16-rtn+kv-fp8")
    recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, source=str(text),
                                                                         num_samples=2, seq_len=32))
    artifact = build(str(model), recipe, tmp_path / "a", progress=False, log=lambda m: None).path
    outputs = {kv: LLM(str(artifact), dtype="fp32", kv_dtype=kv, num_kv_blocks=16).generate(["abc"], GREEDY)[0]
               for kv in ("fp8", "bf16", "int4")}
    assert all(len(out.token_ids) == 5 for out in outputs.values())


def test_loading_and_seeded_sampling_leave_the_caller_s_random_state_and_default_dtype_alone(tmp_path, monkeypatch):
    """An eval job seeds torch for its own draws: loading an artifact drew from torch's global RNG
    (its embedding's and unquantized linears' random init, thrown away at once), and a request with
    its own seed drew one number a step from it too. Under a caller's bf16 default dtype, a kv-fp8
    cache's calibrated key offsets were rounded to bf16."""
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset
    from tiny_models import write_tiny_model_and_text

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, text = write_tiny_model_and_text(tmp_path)
    recipe = preset("kv-fp8").with_overrides(calibration={"source": str(text), "num_samples": 2, "seq_len": 32})
    artifact = build(str(model), recipe, tmp_path / "a", progress=False, log=lambda m: None).path  # linears unquantized

    def untouched(action) -> bool:
        torch.manual_seed(0)
        want = torch.rand(4)
        torch.manual_seed(0)
        action()
        return torch.equal(torch.rand(4), want)

    holder = {}
    assert untouched(lambda: holder.setdefault("llm", LLM(str(artifact), dtype="fp32", num_kv_blocks=16)))
    llm = holder["llm"]
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    assert untouched(lambda: llm.generate(["abc"], seeded))
    assert untouched(lambda: llm.generate(["abc"], GREEDY))
    torch.set_default_dtype(torch.bfloat16)
    try:
        bf16_default = LLM(str(artifact), dtype="fp32", num_kv_blocks=16)
    finally:
        torch.set_default_dtype(torch.float32)
    offsets = [c.k_offset for c in bf16_default.engine.caches]
    assert all(o.dtype == torch.float32 for o in offsets)
    assert all(torch.equal(a, b.k_offset) for a, b in zip(offsets, llm.engine.caches))


def test_an_int4_cache_chosen_at_serve_time_has_a_build_s_groups(tmp_path):
    """`--kv-dtype int4` / kv_dtype="int4" without a KV scheme used groups of 32 channels, a `+kv-int4`
    build 16 (what README's accuracy table and the kv-dtypes benchmark measured)."""
    from qkiln.quant.scheme import KVCacheScheme

    llm = LLM(str(write_tiny_hf_model(tmp_path, "llama")), dtype="fp32", kv_dtype="int4", num_kv_blocks=8)
    assert llm.engine.config.kv_group_size == KVCacheScheme().group_size == 16
    assert len(llm.generate(["abc"], GREEDY)[0].token_ids) == 5


def test_a_sliding_window_caps_the_context():
    """qkiln has no sliding-window attention: a model with a window shorter than its context is
    served up to the window, where full and sliding attention agree (it attended past it silently)."""
    import warnings

    from qkiln.runtime.config import ModelConfig

    hf = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 260, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "sliding_window": 64}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ModelConfig.from_hf(hf).max_position_embeddings == 64
    assert any("sliding window of 64" in str(w.message) for w in caught)
    assert ModelConfig.from_hf(hf | {"sliding_window": None}).max_position_embeddings == 1024


@pytest.mark.parametrize("bad, message", [
    (dict(num_kv_blocks=0), "num_kv_blocks must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(max_model_len=1), "max_model_len must be an integer >= 2"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),  # was the scheduler's AssertionError
    (dict(max_num_batched_tokens=-4), "max_num_batched_tokens must be an integer >= 1"),
    (dict(max_model_len=4096), "max_model_len 4096 exceeds the model's context of 1024"),  # was capped silently
    # switches read from a config as text: "false" was truthy, so prefix caching stayed on
    (dict(enable_prefix_caching="false"), "enable_prefix_caching must be True or False, got 'false'"),
    (dict(enable_chunked_prefill=0), "enable_chunked_prefill must be True or False, got 0"),
    (dict(enforce_eager="no"), "enforce_eager must be True or False"),
])
def test_engine_settings_out_of_range_are_refused(tmp_path, bad, message):
    from qkiln.errors import QkilnError

    model = write_tiny_hf_model(tmp_path, "llama")
    with pytest.raises(QkilnError, match=message):
        LLM(str(model), dtype="fp32", **({"num_kv_blocks": 8} | bad))


@pytest.mark.parametrize("name, text", [("config.json", "{"), ("tokenizer_config.json", "{not json"),
                                        ("tokenizer_config.json", "[1, 2]"), ("model.safetensors.index.json", "{")])
def test_a_malformed_model_file_is_named(tmp_path, name, text):
    """tokenizer_config.json was read unguarded: a JSONDecodeError traceback."""
    from qkiln.errors import SourceModelError

    model = write_tiny_hf_model(tmp_path, "llama")
    (model / name).write_text(text)
    with pytest.raises(SourceModelError, match=name.replace(".", r"\.")):
        LLM(str(model), dtype="fp32", num_kv_blocks=8)


def test_a_long_prefill_chunk_cap_lets_later_requests_start(tmp_path):
    """long_prefill_token_threshold was a scheduler setting no engine passed on: a 100-token prompt
    took the whole budget of 16 for 7 steps before a short request behind it started."""
    model = write_tiny_hf_model(tmp_path, "llama")
    first_token_step = {}
    for cap in (0, 8):
        engine = LLM(str(model), dtype="fp32", num_kv_blocks=32, max_num_batched_tokens=16,
                     long_prefill_token_threshold=cap).engine
        long = engine.add_request(list(range(1, 101)), GREEDY)
        short = engine.add_request([5, 6, 7], GREEDY)
        step = 0
        while short not in first_token_step.setdefault(cap, {}):
            step += 1
            for out in engine.step():
                first_token_step[cap].setdefault(out.request_id, step)
        engine.abort_request(long)
        engine.abort_request(short)
    assert first_token_step[0][short] >= 7 and first_token_step[8][short] == 1


def _one_token_at_a_time(llm, prompt_ids, steps, bias_from=lambda tokens: None, **params):
    """Greedy tokens from `steps` one-token requests, each prompt extended by the tokens so far
    (and biased by `bias_from(tokens so far)`)."""
    ids, out = list(prompt_ids), []
    for _ in range(steps):
        bias = bias_from(out)
        token = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                                   logit_bias=bias, **params))[0].token_ids[0]
        ids.append(token)
        out.append(token)
    return out


def test_the_engine_penalizes_the_tokens_of_the_request_so_far(llm):
    """Through prefill and decode steps, the penalties count the right tokens: a repetition penalty
    (prompt and output) equals one-token requests on the growing prompt, and frequency / presence
    penalties (output only) equal those requests with the penalty written as a logit bias."""
    prompt = llm.tokenizer.encode("the cat sat on the mat and the cat")
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    repeated = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                     repetition_penalty=5.0))[0].token_ids
    assert repeated == _one_token_at_a_time(llm, prompt, 12, repetition_penalty=5.0)

    def as_bias(tokens):  # OpenAI's formula over the output so far, 1.5 x count + 0.5 once
        return {t: -(1.5 * tokens.count(t) + 0.5) for t in set(tokens)} or None

    penalized = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                      frequency_penalty=1.5, presence_penalty=0.5))[0].token_ids
    assert penalized == _one_token_at_a_time(llm, prompt, 12, bias_from=as_bias)
    assert len(set(penalized)) > len(set(plain)) and len(set(repeated)) > len(set(plain)), (plain, penalized, repeated)


def test_logit_bias_forces_and_bans_through_the_engine(llm):
    prompt = llm.tokenizer.encode("hello")
    plain = llm.generate([prompt], GREEDY)[0].token_ids
    assert llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True,
                                                 logit_bias={"17": 100}))[0].token_ids == [17] * 5
    banned = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                   logit_bias={t: -100 for t in plain}))[0].token_ids
    assert not set(banned) & set(plain)
    with pytest.raises(RequestError, match="logit_bias token 99999 is outside the vocabulary"):
        llm.generate([prompt], SamplingParams(logit_bias={99999: 1}))


def test_n_choices_are_the_seeded_requests_one_by_one(llm):
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=1)
    out = llm.generate(["abc", "xyz"], dataclasses.replace(sampled, n=3))
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[1].outputs] == [0, 1, 2]
    for prompt, result in zip(["abc", "xyz"], out):
        alone = [llm.generate(prompt, dataclasses.replace(sampled, seed=7 + j))[0] for j in range(3)]
        assert [c.token_ids for c in result.outputs] == [a.token_ids for a in alone]
        assert [c.cumulative_logprob for c in result.outputs] == pytest.approx([a.cumulative_logprob for a in alone])
        assert result.prompt == prompt and result.prompt_token_ids == alone[0].prompt_token_ids
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # the seeds differ, so do the samples
    assert isinstance(out[0].request_id, str) and out[0].request_id != out[1].request_id
    # n == 1 reads as before: the first choice's fields on the prompt's output
    assert out[0].text == out[0].outputs[0].text and out[0].finish_reason == "length"


def test_n_scores_the_prompt_once(llm):
    ids = list(range(3, 3 + 40))
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, n=4)
    hits = llm.engine.kv_manager.prefix_cache_hits
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    single = llm.generate({"prompt_token_ids": ids}, dataclasses.replace(params, n=1))[0]
    assert out.prompt_logprobs == single.prompt_logprobs and out.prompt is None
    assert [c.token_ids for c in out.outputs] == [single.token_ids] * 4
    # choices 1..3 took the prompt's two full 16-token blocks from choice 0
    assert llm.engine.kv_manager.prefix_cache_hits - hits >= 3 * 32


@pytest.mark.parametrize("n", [0, 129, 2.0, True])
def test_n_out_of_range_is_refused_naming_it(n):
    with pytest.raises(RequestError, match="n must be an integer in \\[1, 128\\]") as e:
        SamplingParams(n=n)
    assert e.value.param == "n"


def test_seed_plus_n_past_the_generator_s_range_is_refused():
    with pytest.raises(RequestError, match="seed \\+ n - 1") as e:
        SamplingParams(seed=2**64 - 2, n=3)
    assert e.value.param == "seed"
    assert [c.seed for c in SamplingParams(seed=-2, n=3).choices()] == [-2, -1, 0]  # -1 stays a seed here


def test_the_engine_takes_one_choice_per_request(llm):
    with pytest.raises(RequestError, match="one choice per request"):
        llm.engine.add_request("abc", SamplingParams(n=2))
    assert not llm.engine.has_unfinished()


def test_a_prompt_may_fill_the_context(llm):
    """Its logprobs are scored and one token follows it, ending on "length" (as in vLLM); a prompt
    past the context is refused."""
    ids = [(7 * i) % 200 + 3 for i in range(128)]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == 128 and all(e is not None for e in out.prompt_logprobs[1:])
    with pytest.raises(RequestError, match="129 tokens"):
        llm.generate({"prompt_token_ids": ids + [5]}, GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0


def test_scripts_ported_from_vllm_are_refused_where_they_would_run_differently(llm):
    """From a probe porting vLLM scripts: each of these had run, silently otherwise than asked."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "hi\nthere"}]
    # content parts are joined as the server joins them (the template had printed their Python repr)
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.chat(plain, GREEDY)[0].prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestError, match="only text content parts"):
        llm.chat(image, GREEDY)
    with pytest.raises(RequestError, match="multi_modal_data needs a multimodal model"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": object()}}, GREEDY)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(AttributeError, match="no option 'logits_processors'"):
        params.logits_processors = [print]  # had been set and ignored
    with pytest.raises(RequestError, match="sampling_params must be a SamplingParams"):
        llm.generate("hi", {"max_tokens": 2})
    with pytest.raises(RequestError, match="prompt 0 is empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)


def test_vllm_dtype_names_load(tmp_path):
    import torch

    model = write_tiny_hf_model(tmp_path, "llama")
    for dtype, expected in (("half", torch.float16), ("float", torch.float32), (torch.float32, torch.float32)):
        assert next(LLM(str(model), dtype=dtype, num_kv_blocks=8).engine.model.parameters()).dtype == expected


def test_vllm_s_constructor_options(tmp_path):
    """LLM(seed=) makes requests without a seed reproducible run to run; trust_remote_code,
    tensor_parallel_size 1 and kv_cache_dtype are taken as vLLM scripts pass them."""
    path = str(write_tiny_hf_model(tmp_path, "llama"))
    sampled = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def draws(seed):
        llm = LLM(path, dtype="fp32", num_kv_blocks=16, seed=seed, trust_remote_code=True, tensor_parallel_size=1)
        return [o.token_ids for o in llm.generate(["abc", "xyz"], sampled)]

    first = draws(5)
    assert draws(5) == first and draws(6) != first
    assert LLM(path, dtype="fp32", num_kv_blocks=16, kv_cache_dtype="fp8_e4m3").engine.kv_dtype == "fp8"
    assert LLM(path, dtype="fp32", num_kv_blocks=16, kv_cache_dtype="bfloat16").engine.kv_dtype == "bf16"
    for options, error in [(dict(tensor_parallel_size=2), "one device"), (dict(tensor_parallel_size=True), "one"),
                           (dict(kv_cache_dtype="fp8_e5m2"), "e4m3"),
                           (dict(kv_cache_dtype="fp8", kv_dtype="int4"), "not both"),
                           (dict(seed="1"), "seed must be an integer")]:
        with pytest.raises((TypeError, ValueError, QkilnError), match=error):
            LLM(path, dtype="fp32", num_kv_blocks=16, **options)


def test_switches_take_numpy_bools_and_none_as_vllm_s_configs_do(tmp_path):
    """None is vLLM's default for enable_prefix_caching / enable_chunked_prefill; a script's numpy
    bools are bools (both were refused when text was)."""
    import numpy as np

    llm = LLM(str(write_tiny_hf_model(tmp_path, "llama")), dtype="fp32", num_kv_blocks=8,
              enable_prefix_caching=None, enable_chunked_prefill=np.False_, enforce_eager=np.True_)
    config = llm.engine.config
    assert (config.enable_prefix_caching, config.enable_chunked_prefill, config.enforce_eager) == (True, False, True)
    assert SamplingParams(ignore_eos=np.True_).ignore_eos is True

