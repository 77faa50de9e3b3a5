"""GGUF metadata the converters write, read as the model it describes (probe s34): RoPE scaling keys
and Llama 3.1's rope_freqs tensor (ignored: a scaled model computed unscaled RoPE), user-defined
tokens, add_eos, Qwen2's pre-tokenizer, and damaged or split files refused in one line."""

import math

import pytest
import torch

from qkiln.errors import SourceModelError, UnsupportedArchitectureError
from qkiln.runtime.source import load_source
from tiny_models import write_tiny_gguf, write_tiny_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def _logits(source, n=80):
    ids = torch.arange(n).remainder(250).unsqueeze(0)
    with torch.no_grad():
        return source.build_model(torch.float32)(ids)


def test_a_plain_gguf_is_the_hf_model(hf_dir, tmp_path):
    gguf = load_source(write_tiny_gguf(tmp_path / "m.GGUF", hf_dir))  # upper-case suffix as some hubs name it
    assert gguf.config.rope_scaling is None
    assert torch.allclose(_logits(gguf), _logits(load_source(hf_dir)), atol=1e-5)


def test_a_gguf_is_known_by_its_magic_not_its_name(hf_dir, tmp_path):
    """Ollama keeps its GGUFs as blobs/sha256-<hex>: 'neither a .gguf file nor ...' (probe s50); and a
    file of a newer GGUF version was told to "re-download it", which gives the same file."""
    blob = write_tiny_gguf(tmp_path / "m.gguf", hf_dir).rename(tmp_path / "sha256-0123abcd")
    assert torch.equal(_logits(load_source(blob)), _logits(load_source(write_tiny_gguf(tmp_path / "n.gguf", hf_dir))))
    data = bytearray(blob.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")  # the version field after the magic
    (tmp_path / "v99.gguf").write_bytes(bytes(data))
    with pytest.raises(SourceModelError, match="newer format than this `gguf` package reads.*upgrade gguf"):
        load_source(tmp_path / "v99.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SourceModelError, match="neither a GGUF file"):
        load_source(tmp_path / "notes.txt")


def test_named_chat_templates_are_kept(hf_dir, tmp_path):
    """llama.cpp writes a model's named templates as tokenizer.chat_template.NAME: only the default was read."""
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata={
        "tokenizer.chat_template": ("string", "{{ messages[0].content }}"),
        "tokenizer.chat_template.tool_use": ("string", "tools: {{ messages[0].content }}")})
    tokenizer = load_source(path).tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == "hi"
    assert tokenizer.apply_chat_template(messages, template_kwargs={"tools": [{"name": "f"}]}) == "tools: hi"


def test_linear_rope_scaling_keys_are_applied(hf_dir, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata={"llama.rope.scaling.type": ("string", "linear"),
                                                                   "llama.rope.scaling.factor": ("float32", 4.0)})
    scaled = load_source(path)
    assert scaled.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    plain = load_source(hf_dir)
    assert not torch.allclose(_logits(scaled), _logits(plain), atol=1e-3)  # positions really are scaled


def test_unsupported_rope_scaling_is_refused_not_ignored(hf_dir, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata={"llama.rope.scaling.type": ("string", "yarn"),
                                                                   "llama.rope.scaling.factor": ("float32", 4.0)})
    with pytest.raises(UnsupportedArchitectureError, match="rope scaling 'yarn' is not supported"):
        load_source(path).build_model()


def _llama3_divisors(theta, head_dim, factor, original, low=1.0, high=4.0):
    """convert_hf_to_gguf.py's rope_freqs for a Llama 3.1 rope_scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


@pytest.mark.parametrize("original, expected_type", [(8192, "llama3"), (100, "freq_factors")])
def test_rope_freqs_become_the_llama3_scaling(hf_dir, tmp_path, original, expected_type):
    """Llama 3.1 / 3.2 GGUFs carry rope_freqs.weight (it was refused as a tensor with no place): the
    published parameters are recovered as HF's llama3 scaling; other divisors are applied as they are."""
    from qkiln.runtime.rope import inverse_frequencies

    src = load_source(hf_dir)
    theta, head_dim = src.config.rope_theta, src.config.head_dim
    divisors = _llama3_divisors(theta, head_dim, 8.0, original)
    gguf = load_source(write_tiny_gguf(tmp_path / "m.gguf", hf_dir, tensors={"rope_freqs.weight": divisors}))
    assert gguf.config.rope_scaling["rope_type"] == expected_type
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert torch.allclose(inverse_frequencies(gguf.config), base / torch.tensor(divisors), rtol=1e-5)
    assert "rope_freqs.weight" not in gguf.state_dict


def test_tokenizer_metadata(hf_dir, tmp_path):
    src = load_source(hf_dir)
    user = src.tokenizer.backend.token_to_id("<|eos|>") - 1  # some plain token, re-typed user-defined below
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, token_types={user: 4},
                           metadata={"tokenizer.ggml.add_eos_token": ("bool", True),
                                     "tokenizer.ggml.pre": ("string", "qwen2")})
    tok = load_source(path).tokenizer
    piece = tok.backend.id_to_token(user)
    assert tok.encode(f"a{piece}b")[1] == user  # matched whole, not split into bytes
    assert tok.encode("hi 123")[-1] == tok.eos_token_id  # add_eos_token
    assert tok.decode(tok.encode("Naïve 2024 café", add_special_tokens=False)) == "Naïve 2024 café"


@pytest.mark.parametrize("metadata, message", [
    ({"llama.embedding_length": None}, "lacks llama.embedding_length"),
    ({"llama.attention.head_count": None}, "lacks llama.attention.head_count"),
    ({"llama.attention.layer_norm_rms_epsilon": None}, "lacks llama.attention.layer_norm_rms_epsilon"),
    ({"tokenizer.ggml.bos_token_id": ("uint32", 10**6)}, "bos_token_id is 1000000, outside the vocabulary"),
    ({"llama.attention.head_count_kv": ("uint32", 1)}, "config .* and its tensors disagree"),
    ({"split.count": ("uint16", 2), "split.no": ("uint16", 0)}, r"shard 1 of 2 .* \(llama-gguf-split --merge"),
])
def test_damaged_metadata_is_a_one_line_error(hf_dir, tmp_path, metadata, message):
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata=metadata)
    with pytest.raises(SourceModelError, match=message):
        load_source(path).build_model()


def test_generation_ends_where_llama_cpp_ends_it(hf_dir, tmp_path):
    """EOS, EOT and EOM ids, and end-of-turn tokens by their text (llama-vocab.cpp): a Llama 3
    Instruct file's <|eom_id|>, a Qwen one's <|endoftext|> beside its EOS <|im_end|>."""
    from qkiln.runtime import LLM, SamplingParams
    from qkiln.runtime.gguf_reader import _end_of_generation_ids

    meta = {"tokenizer.ggml.tokens": ["<|endoftext|>", "a", "<|im_end|>", "b", "<|eom_id|>"],
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 3}
    assert _end_of_generation_ids(meta) == (2, 3, 0, 4)
    free = LLM(str(hf_dir), dtype="fp32", num_kv_blocks=16).generate(
        {"prompt_token_ids": [256, 72, 105]}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    eot = next(t for t in free[2:] if t != 257)
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata={"tokenizer.ggml.eot_token_id": ("uint32", eot)})
    out = LLM(str(path), dtype="fp32", num_kv_blocks=16).generate(
        {"prompt_token_ids": [256, 72, 105]}, SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.token_ids == free[:free.index(eot) + 1] and out.finish_reason == "stop"


def test_a_llama3_vocabulary_takes_whole_tokens_before_merging_and_adds_bos():
    """llama.cpp's LLAMA3 pre-tokenizer type (llama-bpe): a pre-token that is a vocabulary entry is
    that token even when no merge reaches it (Llama 3's tokenizer.json: ignore_merges), and BOS is
    added when the file does not say."""
    from tokenizers.pre_tokenizers import ByteLevel

    from qkiln.runtime.tokenizer import Tokenizer

    tokens = sorted(ByteLevel.alphabet()) + ["Ġw", "Ġworld", "<|begin_of_text|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["Ġ w"],
            "tokenizer.ggml.bos_token_id": len(tokens) - 1}
    llama3 = Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.encode(" world") == [len(tokens) - 1, tokens.index("Ġworld")]
    gpt2 = Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.pre": "gpt-2"})
    assert gpt2.encode(" world") == [tokens.index(t) for t in ("Ġw", "o", "r", "l", "d")]
    no_bos = Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode(" world") == [tokens.index("Ġworld")]


def test_recommended_sampling_becomes_the_request_defaults(hf_dir, tmp_path):
    """general.sampling.* (convert_hf_to_gguf.py writes the model's recommendations there) are the
    defaults llama.cpp starts from; penalty_repeat, windowed there, is not repetition_penalty."""
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata={
        "general.sampling.temp": ("float32", 0.5), "general.sampling.top_k": ("int32", 20),
        "general.sampling.top_p": ("float32", 0.75), "general.sampling.penalty_repeat": ("float32", 1.1)})
    assert load_source(path).config.sampling_defaults == {"temperature": 0.5, "top_k": 20, "top_p": 0.75}
    assert load_source(write_tiny_gguf(tmp_path / "plain.gguf", hf_dir)).config.sampling_defaults is None


def test_partial_rotary_is_refused(hf_dir, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_dir, metadata={"llama.rope.dimension_count": ("uint32", 16)})
    with pytest.raises(UnsupportedArchitectureError, match="rope.dimension_count is 16, not the head size 32"):
        load_source(path)
    assert load_source(write_tiny_gguf(tmp_path / "ok.gguf", hf_dir,
                                       metadata={"llama.rope.dimension_count": ("uint32", 32)})).config.head_dim == 32
