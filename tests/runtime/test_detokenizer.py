"""Incremental detokenization on real (tiny, in-memory) tokenizers, and stop-string handling."""

import pytest

from qkiln.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from tiny_models import sentencepiece_byte_fallback, trained_byte_level_bpe

CORPUS = ["hello world, the quick brown fox", "naïve café, smörgåsbord and crème brûlée",
          "日本語のテキスト 😀 emoji 🚀 rockets", "hello hello world world"] * 3
TEXT = "hello wörld: 日本語 🚀 café naïve 😀!"


@pytest.fixture(scope="module")
def byte_level():
    return trained_byte_level_bpe(CORPUS)


@pytest.fixture(scope="module")
def byte_fallback():
    return sentencepiece_byte_fallback()


def stream(tok, prompt_ids, output_ids, **kwargs):
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    pieces, stop_str = [], None
    for i, token_id in enumerate(output_ids):
        stop_str = detok.update([token_id], is_final=i == len(output_ids) - 1)
        pieces.append(detok.get_next_output_text(finished=stop_str is not None or i == len(output_ids) - 1))
        if stop_str is not None:
            break
    return detok, pieces, stop_str


@pytest.mark.parametrize("tokenizer", ["byte_level", "byte_fallback"])
def test_incremental_pieces_concatenate_to_the_full_decode(tokenizer, request):
    tok = request.getfixturevalue(tokenizer)
    prompt = tok.encode("hello ").ids
    output = tok.encode(TEXT).ids[1:]  # not from a word start, as generation is
    full = tok.decode(prompt + output)
    expected = full[len(tok.decode(prompt)):]
    detok, pieces, _ = stream(tok, prompt, output)
    assert "".join(pieces) == expected == detok.output_text
    assert "\ufffd" not in expected and not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some token ended mid-character and its text was held back
    assert len(output) > len(expected.encode()) / 4  # the text really was split into small pieces


@pytest.mark.parametrize("tokenizer", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize("spells_bytes", [True, False], ids=["qkiln_tokenizer", "decode_only"])
def test_output_after_a_prompt_that_ends_in_multibyte_characters(tokenizer, spells_bytes, request):
    """The first decode window starts 5 prompt tokens back; with byte-fallback pieces that could be
    inside a character, and the decoder then spelled the whole run of byte pieces, the output's
    included, as U+FFFD ("中文" + "字 hello" came out "\ufffd\ufffd\ufffd hello")."""
    from qkiln.runtime.tokenizer import Tokenizer as QkilnTokenizer

    raw = request.getfixturevalue(tokenizer)
    tok = QkilnTokenizer(raw, {"eos_token": "<eos>"}) if spells_bytes else raw  # token_bytes, or decode only
    num_split = 0
    for text in ("中文字 hello", "ok 👍🏽👍 fine", "日本語のテキスト 😀 emoji", "é中 ok"):
        ids = raw.encode(text).ids
        for cut in range(1, len(ids)):
            prompt, output = ids[:cut], ids[cut:]
            before = raw.decode(prompt)
            # A prompt that ends inside a character shows it as U+FFFD; the output that finishes it
            # owns the whole character (it was lost: the same length as the U+FFFD, "no new text").
            stem = before.rstrip("\ufffd")
            if stem != before and tokenizer == "byte_fallback":
                # Its decoder spells a whole run of byte pieces U+FFFD while any of it is unfinished,
                # the prompt's complete characters too: they are the prompt's tokens before the
                # character's lead byte, and the ones after it up to the end, decoded alone.
                if not spells_bytes:
                    continue  # only token bytes tell where the character starts
                lead = next(k for k in range(cut - 1, -1, -1) if not raw.decode(prompt[:k]).endswith("\ufffd"))
                stem = raw.decode(prompt[:lead])
            num_split += stem != before
            detok, pieces, _ = stream(tok, prompt, output)
            assert "".join(pieces) == detok.output_text == raw.decode(ids)[len(stem):], (text, cut)
    assert num_split >= 5 or not spells_bytes


def test_skip_special_tokens(byte_level):
    eos = byte_level.token_to_id("<eos>")
    prompt = byte_level.encode("hi").ids
    output = byte_level.encode(" café").ids + [eos] + byte_level.encode(" 🚀").ids
    skipped = "".join(stream(byte_level, prompt, output, skip_special_tokens=True)[1])
    kept = "".join(stream(byte_level, prompt, output, skip_special_tokens=False)[1])
    assert skipped == " café 🚀" and kept == " café<eos> 🚀"


def test_is_final_flushes_an_unfinished_character(byte_level):
    prompt = byte_level.encode("hi").ids
    rocket = byte_level.encode("🚀").ids
    assert len(rocket) > 1
    detok = IncrementalDetokenizer(byte_level, prompt)
    detok.update(rocket[:1])
    assert detok.output_text == ""
    detok.update(rocket[1:2], is_final=True)
    assert detok.output_text.endswith("\ufffd")


def test_find_stop_string_earliest_and_only_in_new_text():
    assert find_stop_string("abc STOP def END", 8, ["END", "STOP"]) == ("END", 13)
    assert find_stop_string("abc STOP def END", 12, ["END", "STOP"]) == ("STOP", 4)
    assert find_stop_string("abc STOP def END", 12, ["STOP"], include_stop_str=True) == ("STOP", 8)
    assert find_stop_string("abc STO", 2, ["STOP"]) is None
    assert find_stop_string("abcSTOP", 1, ["STOP"]) == ("STOP", 3)  # spans old and new text
    assert find_stop_string("STOP and more", 3, ["STOP"]) is None  # completed earlier, already handled


@pytest.mark.parametrize("include_stop_str", [False, True])
def test_stream_never_shows_part_of_a_cut_stop_string(byte_level, include_stop_str):
    prompt = byte_level.encode("hi").ids
    output = byte_level.encode(" hello world ### rest of text").ids
    detok, pieces, stop_str = stream(byte_level, prompt, output, stop=["###"], include_stop_str=include_stop_str)
    assert stop_str == "###"
    expected = " hello world ###" if include_stop_str else " hello world "
    assert detok.output_text == expected and "".join(pieces) == expected


def test_min_tokens_defers_stop_strings(byte_level):
    prompt = byte_level.encode("hi").ids
    output = byte_level.encode("STOP a STOP b").ids
    num_first = len(byte_level.encode("STOP").ids)
    detok, pieces, stop_str = stream(byte_level, prompt, output, stop=["STOP"], min_tokens=num_first)
    assert stop_str == "STOP" and detok.output_text == "STOP a "


@pytest.mark.parametrize("tokenizer", ["byte_level", "byte_fallback"])
def test_token_bytes_spell_the_text_where_lone_decodes_cannot(tokenizer, request):
    """Logprobs name tokens by `token_bytes` / `token_name`: decoding a lone token that holds part
    of a character gives U+FFFD, which loses the bytes OpenAI's logprobs `bytes` field carries."""
    from qkiln.runtime.tokenizer import Tokenizer as QkilnTokenizer

    tok = QkilnTokenizer(request.getfixturevalue(tokenizer), {"eos_token": "<eos>"})
    ids = tok.encode(TEXT) + [tok.eos_token_id]
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # the case this is for
    spelled = b"".join(tok.token_bytes(i) for i in ids).decode("utf-8")
    # SentencePiece spells the leading space its normalizer added; its decoder strips it
    assert spelled == (" " if tokenizer == "byte_fallback" else "") + TEXT + "<eos>"
    names = [tok.token_name(i) for i in ids]
    partial = [n for n in names if n.startswith("bytes:")]
    assert partial and all(n.encode("ascii") for n in partial) and "\ufffd" not in "".join(names)
    assert tok.special_token_ids == {tok.eos_token_id}
