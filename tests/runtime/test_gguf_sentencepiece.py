"""A GGUF with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama", as Llama 2, Mistral and
TinyLlama files have): the real stories260K model written so (stories_gguf.py) tokenizes as
llama.cpp does, matches transformers' model of the same file, and scores TinyStories as a
trained model does. Skips without ../shared/models/stories260k."""

import math

import pytest
import torch

from qkiln.runtime import LLM, SamplingParams
from qkiln.runtime.gguf_reader import _open, read_metadata
from qkiln.runtime.tokenizer import Tokenizer
from stories_gguf import STORIES, write_stories_gguf

TINYSTORIES = STORIES / "../../data/tinystories/tinystories_val.txt"
TEXTS = ["Once upon a time, there was a little girl named Lily.", "a\n\n\nb\ttab",
         "émoji 🙂 and 日本語 fall back to bytes", "Tom said, \"Let's go!\" 123 + 4.5"]


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip("../shared/models/stories260k is absent")
    pytest.importorskip("gguf")
    return write_stories_gguf(tmp_path_factory.mktemp("stories"))


@pytest.fixture(scope="module")
def metadata(stories):
    """The file's GGUF metadata (copy it before changing it)."""
    return read_metadata(_open(stories))


@pytest.fixture(scope="module")
def llm(stories):
    return LLM(str(stories), dtype="fp32", num_kv_blocks=128)


@pytest.fixture(scope="module")
def story_text():
    if not TINYSTORIES.is_file():
        pytest.skip("../shared/data/tinystories is absent")
    return TINYSTORIES.read_text()[:30_000]


def spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece BPE, written out: spaces as "▁" with one prepended, characters
    outside the vocabulary as their UTF-8 byte tokens, then the adjacent pair whose join scores
    best (the leftmost of equals) is joined until no join is in the vocabulary."""
    ids = {t: i for i, t in enumerate(tokens)}
    pieces = []
    for ch in "\u2581" + text.replace(" ", "\u2581"):
        pieces += [ch] if ch in ids else [f"<0x{b:02X}>" for b in ch.encode()]
    while True:
        joins = [(scores[ids[a + b]], -i) for i, (a, b) in enumerate(zip(pieces, pieces[1:])) if a + b in ids]
        if not joins:
            return [ids[p] for p in pieces]
        i = -max(joins)[1]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


def test_text_tokenizes_as_llama_cpp_and_decodes_back(llm, metadata, story_text):
    tokenizer = llm.tokenizer
    for text in TEXTS + ["  two leading spaces", story_text[:4000]]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == spm_reference(text, metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 1  # a SentencePiece vocabulary adds BOS
    # after a special token the text gets its own leading "▁", as llama.cpp does
    hi = tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.encode("</s>hi", add_special_tokens=False) == [2] + hi
    assert tokenizer.token_name(tokenizer.encode("🙂", add_special_tokens=False)[1]) == "bytes:\\xf0"


def test_the_tokenizer_survives_an_artifact_s_tokenizer_json(llm, tmp_path, story_text):
    """Reloaded by qkiln, and by transformers (lm-eval's HF tokenizer backend reads an artifact's
    tokenizer/ so): the same ids, BOS included (transformers had added none)."""
    llm.tokenizer.save(tmp_path)
    reloaded = Tokenizer.from_dir(tmp_path)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + ["  two leading spaces", story_text[:2000]]:
        assert reloaded.encode(text) == llm.tokenizer.encode(text) == theirs.encode(text)
        assert reloaded.decode(reloaded.encode(text)) == text
    assert (theirs.bos_token, theirs.eos_token, theirs.unk_token) == ("<s>", "</s>", "<unk>")


def test_the_model_generates_as_transformers_does(llm, stories):
    """transformers' GGUF loader builds the same model from the file (its tokenizer differs only on
    text that starts with a space or follows a special token)."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(stories.parent, gguf_file=stories.name,
                                                                  dtype=torch.float32).eval()
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(stories.parent, gguf_file=stories.name)
    prompt = "Once upon a time, there was a"
    ours = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0))[0]
    assert ours.prompt_token_ids == reference_tokenizer.encode(prompt)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ours.prompt_token_ids]), max_new_tokens=40, do_sample=False)
    assert ours.token_ids == expected[0, len(ours.prompt_token_ids):].tolist()
    assert "Lily" in ours.text or len(set(ours.text.split())) > 10  # a story, not a repeated token


def test_tinystories_perplexity_is_a_trained_model_s(llm, story_text):
    """20 windows of 256 tokens (BOS + 255) from the start of tinystories_val.txt: 4.47 measured
    (llama2.c quotes ~4.2 for its own protocol); an untrained 512-token model scores ~512."""
    tokenizer = llm.tokenizer
    ids = tokenizer.encode(story_text, add_special_tokens=False)
    windows = [[tokenizer.bos_token_id] + ids[i:i + 255] for i in range(0, 20 * 255, 255)]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    nll = [-entry[token].logprob for out in outs
           for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    assert 3.5 < math.exp(sum(nll) / len(nll)) < 5.5


def test_streamed_text_is_the_decoded_text(llm):
    """Token by token (byte-fallback characters arrive in pieces), the stream spells what decoding
    the whole output spells: spaces after the prompt's last token included."""
    from qkiln.runtime.detokenizer import IncrementalDetokenizer

    tokenizer = llm.tokenizer
    prompt = tokenizer.encode("Once upon a time")
    for output in (" émoji 🙂 and 日本語 too", "\nThe end. 🙂"):
        ids = tokenizer.encode("Once upon a time" + output)[len(prompt):]
        detok, streamed = IncrementalDetokenizer(tokenizer, prompt), ""
        for i, token_id in enumerate(ids):
            detok.update([token_id], is_final=i == len(ids) - 1)
            streamed += detok.get_next_output_text(finished=i == len(ids) - 1)
        assert streamed == output


def test_unk_bos_and_eos_are_special_whatever_the_types_say(metadata):
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.encode("<unk>", add_special_tokens=False) == [0]  # matched whole, as llama.cpp does
    assert tokenizer.decode([0] + tokenizer.encode("ha", add_special_tokens=False)) == "ha"
    untyped = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.token_type"}
    assert Tokenizer.from_gguf_metadata(untyped).decode(tokenizer.encode("hi")) == "hi"  # was "<s> hi"


@pytest.mark.parametrize("key, change, message", [
    ("tokenizer.ggml.scores", lambda v: v[:-3], "scores has 509 entries for 512 tokens"),
    ("tokenizer.ggml.token_type", lambda v: v[:100], "token_type has 100 entries"),
    ("tokenizer.ggml.scores", lambda v: v[:-1] + [float("nan")], "not a finite number"),
    ("tokenizer.ggml.scores", lambda v: v[:-1] + ["x"], "not a finite number"),
    ("tokenizer.ggml.scores", None, "lacks tokenizer.ggml.scores"),
])
def test_inconsistent_sentencepiece_metadata_is_refused(metadata, key, change, message):
    from qkiln.errors import SourceModelError

    meta = dict(metadata)
    if change is None:
        del meta[key]
    else:
        meta[key] = change(list(meta[key]))
    with pytest.raises(SourceModelError, match=message):
        Tokenizer.from_gguf_metadata(meta)


def test_echoed_text_offsets_point_at_each_token_s_text(stories):
    """Over real HTTP: each echoed token's text_offset is where its text starts in the echo (a
    SentencePiece token's length counted the "▁" prepended to the text: one character late)."""
    httpx = pytest.importorskip("httpx")
    from loopback import serving_model

    text = "Lily saw a big, red ball. 🙂 She said hi"
    with serving_model(stories, dtype="fp32", num_kv_blocks=64) as (_, server):
        body = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": text, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0}).json()
    choice = body["choices"][0]
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert tokens[0] == "<s>" and offsets[:3] == [0, 0, 4]  # BOS (added, not in the text), "Lily", " saw"
    ends = offsets[1:] + [len(choice["text"])]
    for token, start, end in zip(tokens[1:], offsets[1:], ends[1:]):
        if not token.startswith("bytes:"):  # a piece of 🙂 is named by its bytes
            assert choice["text"][start:end] in (token, token.lstrip()), (token, start, end)
    assert offsets[body["usage"]["prompt_tokens"]] == len(text)  # the generated text follows the echo
