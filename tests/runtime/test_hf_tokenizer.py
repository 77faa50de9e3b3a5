"""`LLM.get_tokenizer()` answers the calls a script ported from vLLM makes on a transformers
tokenizer as transformers' own tokenizer of the same files answers them, defaults included."""

import pytest
import transformers

from qkiln.runtime.hf_tokenizer import TransformersStyleTokenizer
from qkiln.runtime.llm import LLM
from tiny_models import write_tiny_hf_model

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo, wörld"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    llm = LLM(str(path), dtype="fp32", num_kv_blocks=8, max_model_len=64)
    return llm.get_tokenizer(), transformers.AutoTokenizer.from_pretrained(path)


def test_the_calls_answer_as_transformers_does(pair):
    ours, theirs = pair
    assert isinstance(ours, TransformersStyleTokenizer)
    for call in (lambda t: t.apply_chat_template(MESSAGES, return_dict=False),  # ids, no generation prompt
                 lambda t: dict(t.apply_chat_template(MESSAGES, return_dict=True, add_generation_prompt=True)),
                 lambda t: t.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                 lambda t: t.apply_chat_template([MESSAGES, MESSAGES[1:]], tokenize=False),
                 lambda t: t.encode("héllo <|eos|> there"),
                 lambda t: t("héllo")["input_ids"],
                 lambda t: t(["a b", "héllo"])["input_ids"],
                 lambda t: t.decode([256, 72, 73, 257]),  # special tokens kept by default
                 lambda t: t.decode([256, 72, 73, 257], skip_special_tokens=True),
                 lambda t: t.batch_decode([[72, 73], [257]]),
                 lambda t: t.convert_ids_to_tokens([72, 257]),
                 lambda t: t.convert_tokens_to_ids("<|eos|>"),
                 lambda t: (t.eos_token, t.eos_token_id, t.bos_token, t.bos_token_id, len(t), t.vocab_size),
                 lambda t: (t.all_special_ids, t.all_special_tokens, t.special_tokens_map, t.model_max_length),
                 lambda t: t.tokenize("héllo <|eos|> there"),
                 lambda t: t.convert_tokens_to_string(t.tokenize("héllo wörld")),
                 lambda t: t.encode("hello world", truncation=True, max_length=3),
                 lambda t: t(["abc def", "x"], truncation=True, max_length=2)["input_ids"]):
        assert call(ours) == call(theirs)


def test_all_special_ids_are_the_named_ones_as_in_transformers(tmp_path):
    """An added special token that no role names (SmolLM2 has 14 such) is not in all_special_ids."""
    import tokenizers

    path = write_tiny_hf_model(tmp_path, "llama")
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<|extra|>"])
    tok.save(str(path / "tokenizer.json"))
    ours = LLM(str(path), dtype="fp32", num_kv_blocks=8, max_model_len=64).get_tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    assert ours.all_special_ids == theirs.all_special_ids == [256, 257]
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.decode([258], skip_special_tokens=True) == theirs.decode([258], skip_special_tokens=True) == ""


def test_tokenized_by_default_as_transformers_4_did(pair):
    """transformers 5 returns a dict by default, 4 (which vLLM pins) the ids: scripts were written for 4."""
    ours, theirs = pair
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(MESSAGES)["input_ids"]


def test_what_it_cannot_return_is_refused(pair):
    ours, _ = pair
    with pytest.raises(Exception, match="return_tensors"):
        ours.apply_chat_template(MESSAGES, return_tensors="pt")
