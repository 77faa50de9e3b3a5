"""vLLM's SamplingParams options beyond sampling itself, offline and over real HTTP: allowed_token_ids,
bad_words, skip_special_tokens, include_stop_str_in_output, detokenize, truncate_prompt_tokens,
max_tokens=None, and the prefix-cache hit a request reports (num_cached_tokens / usage)."""

import json

import pytest

from qkiln.errors import RequestError
from qkiln.runtime.bad_words import bad_words_banned, bad_words_token_ids
from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from qkiln.runtime.tokenizer import Tokenizer
from loopback import serving_client
from tiny_models import trained_byte_level_bpe, write_tiny_hf_model

ENGINE_KW = dict(num_kv_blocks=32, max_model_len=128)
GREEDY = dict(temperature=0, ignore_eos=True)
EOS = 257  # tiny_models' EOS, a special token spelled "<|eos|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="fp32", **ENGINE_KW)


def one(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params))[0]


def test_allowed_token_ids_are_the_only_choices(llm):
    allowed = [40, 41, 42]
    greedy = one(llm, "hello world", max_tokens=12, allowed_token_ids=allowed, **GREEDY)
    sampled = one(llm, "hello world", max_tokens=40, allowed_token_ids=allowed, temperature=5.0, seed=1,
                  ignore_eos=True, logprobs=2)
    assert set(greedy.token_ids) <= set(allowed) and set(sampled.token_ids) == set(allowed)
    # logprobs are the model's own (before the mask), as vLLM reports them by default
    assert all(len(entry) >= 1 for entry in sampled.logprobs)
    with pytest.raises(RequestError, match="allowed_token_ids entry 999 is outside the vocabulary"):
        one(llm, "x", allowed_token_ids=[1, 999])
    with pytest.raises(RequestError, match="non-empty list") as e:
        SamplingParams(allowed_token_ids=[])
    assert e.value.param == "allowed_token_ids"


def test_token_id_lists_are_bounded_and_checked_once():
    """Unbounded, 512 prompts x 200k stop ids held the server's event loop 80 s: each choice had
    gone through the list at every validate, then every step."""
    from qkiln.runtime.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_STOP_TOKEN_IDS, TokenIds

    params = SamplingParams(n=3, stop_token_ids=[5, 6, 5], allowed_token_ids=list(range(1000)) * 2)
    assert params.stop_token_ids == (5, 6) and len(params.allowed_token_ids) == 1000  # duplicates dropped
    choices = params.choices()
    assert all(c.allowed_token_ids is params.allowed_token_ids for c in choices)  # shared, not copied
    assert isinstance(params.allowed_token_ids, TokenIds) and params.allowed_token_ids.largest == 999
    for field, limit in (("stop_token_ids", MAX_STOP_TOKEN_IDS), ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)):
        SamplingParams(**{field: list(range(limit))})
        with pytest.raises(RequestError, match=f"{field} takes at most {limit} distinct token ids") as e:
            SamplingParams(**{field: list(range(limit + 1))})
        assert e.value.param == field
    with pytest.raises(RequestError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=[1, -2])


def test_a_ban_yields_where_it_would_leave_nothing_allowed(llm):
    """min_tokens bans EOS, allowed_token_ids allows only EOS: the row still has a token to take
    (all -inf had given token 0, or NaN probabilities)."""
    out = one(llm, "hello", max_tokens=5, allowed_token_ids=[EOS], min_tokens=2, temperature=1.0, seed=0)
    assert out.token_ids == [EOS] * 3 and out.finish_reason == "stop"


def test_bad_words_never_complete(llm):
    plain = one(llm, "hello world", max_tokens=16, **GREEDY)
    pair = plain.token_ids[:2]
    word = llm.tokenizer.decode(pair)
    out = one(llm, "hello world", max_tokens=16, bad_words=[word], **GREEDY)
    assert out.token_ids[0] == pair[0] and out.token_ids[1] != pair[1]  # banned only after its first token
    assert all(out.token_ids[i:i + 2] != pair for i in range(len(out.token_ids) - 1))
    single = llm.tokenizer.decode(plain.token_ids[:1])
    assert plain.token_ids[0] not in one(llm, "hello world", max_tokens=16, bad_words=[single], **GREEDY).token_ids


def test_bad_words_are_tokenized_as_vllm_does():
    """A word and its spelling after a space when that is another token of the same length; the
    output's tail decides which last token is banned."""
    tok = Tokenizer(trained_byte_level_bpe(["the cat sat on the mat, cat"] * 50), {"eos_token": "<eos>"})
    cat, space_cat = (tuple(tok.encode(w, add_special_tokens=False)) for w in ("cat", " cat"))
    assert len(cat) == len(space_cat) == 1 and cat != space_cat
    assert bad_words_token_ids(tok, ["  cat"]) == (cat, space_cat)
    sat_on = tuple(tok.encode("sat on", add_special_tokens=False))
    words = bad_words_token_ids(tok, ["sat on"])
    assert words[0] == sat_on
    assert bad_words_banned(words, [7, sat_on[0]]) == (sat_on[-1],) and bad_words_banned(words, [sat_on[0], 7]) == ()


def test_special_tokens_and_stop_strings_in_the_text(llm):
    eos = dict(max_tokens=4, temperature=0, logit_bias={EOS: 100})
    assert one(llm, "hi", **eos).text == "" and one(llm, "hi", **eos).token_ids == [EOS]
    # the stop token's text joins the output with include_stop_str_in_output, unless skipped as special
    assert one(llm, "hi", include_stop_str_in_output=True, **eos).text == ""
    assert one(llm, "hi", include_stop_str_in_output=True, skip_special_tokens=False, **eos).text == "<|eos|>"
    plain = one(llm, "hello world", max_tokens=12, **GREEDY)
    stop = plain.text[3:5]
    cut = one(llm, "hello world", max_tokens=12, stop=[stop], **GREEDY)
    kept = one(llm, "hello world", max_tokens=12, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    assert kept.text == cut.text + stop == plain.text[:plain.text.index(stop) + len(stop)]
    assert kept.stop_reason == cut.stop_reason == stop


def test_detokenize_off_returns_ids_only(llm):
    plain = one(llm, "hello world", max_tokens=6, logprobs=1, **GREEDY)
    bare = one(llm, "hello world", max_tokens=6, logprobs=1, detokenize=False, **GREEDY)
    assert bare.token_ids == plain.token_ids and bare.text == "" and plain.text
    assert all(lp.decoded_token is None for entry in bare.logprobs for lp in entry.values())
    with pytest.raises(RequestError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_truncate_prompt_tokens_keeps_the_last_ones(llm, model_dir):
    ids = list(range(3, 60))
    assert one(llm, {"prompt_token_ids": ids}, max_tokens=1, truncate_prompt_tokens=10).prompt_token_ids == ids[-10:]
    assert one(llm, {"prompt_token_ids": ids}, max_tokens=1, truncate_prompt_tokens=-1).prompt_token_ids == ids
    text = "the quick brown fox jumps over the lazy dog"
    assert one(llm, text, max_tokens=1, truncate_prompt_tokens=5).prompt_token_ids == \
        llm.tokenizer.encode(text)[-5:]  # this tokenizer adds no BOS
    assert one(llm, text, max_tokens=1, truncate_prompt_tokens=len(text) + 3).prompt_token_ids == \
        llm.tokenizer.encode(text)
    with pytest.raises(RequestError, match="truncate_prompt_tokens must be") as e:
        SamplingParams(truncate_prompt_tokens=0)
    assert e.value.param == "truncate_prompt_tokens"
    with pytest.raises(RequestError, match="more than the model's context of 128"):  # as vLLM refuses it
        one(llm, text, max_tokens=1, truncate_prompt_tokens=129)


def test_truncation_to_minus_one_keeps_what_a_small_kv_cache_holds(model_dir):
    """A KV cache holding less than the context (here 48 of 128 tokens): -1 kept the context's 128,
    and such a server (which reports 48 as its max_model_len) then refused the request with
    "shorten it", though the client had asked it to cut the prompt."""
    small = dict(ENGINE_KW, num_kv_blocks=3)  # 3 blocks of 16 tokens
    llm = LLM(str(model_dir), dtype="fp32", **small)
    assert llm.engine.max_request_len == 48 < llm.engine.max_model_len == 128
    ids = list(range(3, 103))  # 100 tokens
    out = one(llm, {"prompt_token_ids": ids}, max_tokens=None, truncate_prompt_tokens=-1)
    assert out.prompt_token_ids == ids[-48:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(RequestError, match="more than the 48 tokens a request may hold here") as e:
        one(llm, {"prompt_token_ids": ids}, max_tokens=1, truncate_prompt_tokens=60)
    assert e.value.param == "truncate_prompt_tokens"
    with serving_client(model_dir, **small) as client:
        scored = client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": 0,
                                                      "echo": True, "logprobs": 0})  # lm-eval's rolling windows
        assert scored.status_code == 200 and scored.json()["usage"]["prompt_tokens"] == 48, scored.text
        full = client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": 4})
        assert full.status_code == 400 and "truncate_prompt_tokens below 48" in full.json()["error"]["message"]
        cut = client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 44, "max_tokens": 4})
        assert cut.status_code == 200 and cut.json()["usage"]["completion_tokens"] == 4, cut.text
        too_long = client.post("/v1/completions", json={"prompt": "ab " * 400, "max_tokens": 1})
        message = too_long.json()["error"]["message"]
        assert too_long.status_code == 400 and "48-token limit the KV cache sets" in message, message
        assert "truncate_prompt_tokens" in message


def test_truncation_keeps_the_bos_in_front(tmp_path):
    """Left truncation keeps the special tokens the tokenizer adds, as transformers' does."""
    tok = Tokenizer(trained_byte_level_bpe(["the cat sat on the mat"] * 20), {"bos_token": "<eos>",
                                                                               "add_bos_token": True})
    full = tok.encode("the cat sat on the mat")
    assert full[0] == tok.bos_token_id
    assert tok.encode("the cat sat on the mat", keep_last=3) == [tok.bos_token_id] + full[-2:]
    assert tok.encode("the cat sat on the mat", keep_last=1) == [tok.bos_token_id]
    assert tok.encode("the cat sat on the mat", keep_last=100) == full
    for keep in range(len(full), 2 * len(full) + 1):  # more than the prompt holds: all of it
        assert tok.encode("the cat sat on the mat", keep_last=keep) == full, keep


def test_max_tokens_none_runs_to_the_end_of_the_context(llm):
    out = one(llm, {"prompt_token_ids": list(range(3, 103))}, max_tokens=None, **GREEDY)
    assert len(out.token_ids) == 28 and out.finish_reason == "length"
    with pytest.raises(RequestError, match="min_tokens 40 does not fit: the prompt takes 100 of the 128") as e:
        one(llm, {"prompt_token_ids": list(range(3, 103))}, max_tokens=None, min_tokens=40)
    assert e.value.param == "min_tokens"


def test_bad_words_and_stop_must_be_text():
    for words in (["\ud800"], ["x" * 513]):
        with pytest.raises(RequestError, match="bad_words must be") as e:
            SamplingParams(bad_words=words)
        assert e.value.param == "bad_words"
    with pytest.raises(RequestError, match="stop must be non-empty strings of valid Unicode") as e:
        SamplingParams(stop=["ok", "a\ud800"])  # no text can ever contain it: was accepted, never matched
    assert e.value.param == "stop"


def test_a_repeated_prompt_reports_its_cached_tokens(llm):
    ids = list(range(100, 150))
    first = one(llm, {"prompt_token_ids": ids}, max_tokens=2, **GREEDY)
    again = one(llm, {"prompt_token_ids": ids}, max_tokens=2, **GREEDY)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48  # three full 16-token blocks


@pytest.fixture(scope="module")
def client(model_dir):
    with serving_client(model_dir, dtype="fp32", **ENGINE_KW) as c:
        yield c


def post(client, path, **body):
    r = client.post(path, json={"model": "tiny"} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_server_takes_vllm_s_options(client, llm):
    """Each option over HTTP gives what the offline LLM gives."""
    cases = [dict(allowed_token_ids=[40, 41, 42]), dict(bad_words=["dd", "e"]), dict(truncate_prompt_tokens=4),
             dict(stop=["d"], include_stop_str_in_output=True), dict(logit_bias={str(EOS): 100},
                                                                     skip_special_tokens=False,
                                                                     include_stop_str_in_output=True)]
    for options in cases:
        body = post(client, "/v1/completions", prompt="hello world", max_tokens=8, temperature=0, **options)
        ignore_eos = "logit_bias" not in options
        params = dict(options, logit_bias={EOS: 100}) if "logit_bias" in options else options
        ref = one(llm, "hello world", max_tokens=8, temperature=0, ignore_eos=ignore_eos, **params)
        assert body["choices"][0]["text"] == ref.text, options
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids), options
    chat = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi there"}], max_tokens=2,
                truncate_prompt_tokens=5)
    assert chat["usage"]["prompt_tokens"] == 5


def test_the_server_refuses_bad_options_with_their_names(client):
    for options, param in [(dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                           (dict(truncate_prompt_tokens=500), "truncate_prompt_tokens"),
                           (dict(bad_words=["\ud800"]), "bad_words"),
                           (dict(stop=["\ud800"]), "stop"),
                           (dict(allowed_token_ids=[]), "allowed_token_ids"),
                           (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
                           (dict(stop_token_ids=list(range(5000))), "stop_token_ids"),
                           (dict(bad_words=[" "]), "bad_words")]:
        body = json.dumps({"prompt": "hi", "max_tokens": 2} | options)  # ASCII: a lone surrogate as \\ud800
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (options, r.text)
    assert client.get("/health").status_code == 200


def test_usage_reports_the_prefix_cache_hit(client):
    prompt = list(range(60, 100))
    first = post(client, "/v1/completions", prompt=prompt, max_tokens=1)["usage"]
    again = post(client, "/v1/completions", prompt=prompt, max_tokens=1)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"] == {"cached_tokens": 32} and again["prompt_tokens"] == 40


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"])
def test_switches_given_as_text_are_refused(field):
    """ignore_eos="false" was taken as true (EOS ignored) while the other switches refused it."""
    with pytest.raises(RequestError, match=f"{field} must be true or false, got 'false'"):
        SamplingParams(**{field: "false"})
