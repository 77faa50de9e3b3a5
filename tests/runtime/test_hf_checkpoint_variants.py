"""Hugging Face checkpoints laid out as real ones are, beyond the tidy tiny models: each must
compute what transformers computes from the same files, or be refused naming what differs, never
load and answer wrongly. transformers is the reference."""

import json
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import processors

from qkiln.errors import SourceModelError, UnsupportedArchitectureError
from qkiln.runtime import LLM, SamplingParams
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.source import load_source
from qkiln.runtime.tokenizer import Tokenizer
from tiny_models import write_tiny_hf_model

PROMPT = [256, 72, 101, 108, 108, 111, 32, 119]


def hf_greedy(model_dir, ids, n, **kw) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def assert_greedy_as_transformers(model_dir, n: int) -> None:
    """qkiln's n greedy tokens after PROMPT (EOS ignored) are transformers'."""
    out = LLM(str(model_dir), dtype="fp32", num_kv_blocks=16).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model_dir, PROMPT, n, eos_token_id=None)


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    for key, value in changes.items():
        if value is None:
            del data[key]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("flags, post_processor_bos", [(dict(add_eos_token=True), False),
                                                      (dict(add_bos_token=True), False),
                                                      (dict(add_bos_token=False), True)])
def test_a_saved_tokenizer_gives_transformers_the_ids_qkiln_runs(tmp_path, flags, post_processor_bos):
    """transformers 5 drops add_bos_token / add_eos_token beside a tokenizer.json and follows its
    post-processor; qkiln follows the flags. A SmolLM2 with add_eos_token true put <|im_end|> after
    every prompt in qkiln, not in transformers, and its artifact's tokenizer kept the conflict, so
    lm-eval's HF tokenizer scored other ids than the server ran (probe s50). Now qkiln warns, and a
    saved tokenizer.json agrees with the flags."""
    model_dir = write_tiny_hf_model(tmp_path / "src", "llama")
    if post_processor_bos:
        backend = Tokenizer.from_dir(model_dir).backend
        backend.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                                      processors.TemplateProcessing(single="<|bos|> $A",
                                                                                    special_tokens=[("<|bos|>", 256)])])
        backend.save(str(model_dir / "tokenizer.json"))
    edit_json(model_dir / "tokenizer_config.json", **flags)
    with pytest.warns(UserWarning, match="qkiln follows tokenizer_config.json"):
        tokenizer = Tokenizer.from_dir(model_dir)
    tokenizer.save(tmp_path / "saved")
    text = "Hello world, it is a bright cold day"
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert saved(text).input_ids == tokenizer.encode(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved pair agrees: no warning
        assert Tokenizer.from_dir(tmp_path / "saved").encode(text) == tokenizer.encode(text)


def test_a_bos_declared_only_by_the_post_processor_is_added_as_transformers_adds_it(tmp_path):
    """Llama 3's layout: tokenizer_config.json has no add_bos_token; tokenizer.json's
    TemplateProcessing puts <|begin_of_text|> first."""
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    backend = Tokenizer.from_dir(model_dir).backend
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                           special_tokens=[("<|bos|>", 256)])
    backend.save(str(model_dir / "tokenizer.json"))
    edit_json(model_dir / "tokenizer_config.json", add_bos_token=None)
    text = "Hello world, it is a bright cold day"
    expected = transformers.AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    tokenizer = Tokenizer.from_dir(model_dir)
    assert expected[0] == 256 and tokenizer.encode(text) == expected
    assert tokenizer.add_bos and tokenizer.encode(text, add_special_tokens=False) == expected[1:]
    # an explicit flag still wins, as before, said in a warning
    edit_json(model_dir / "tokenizer_config.json", add_bos_token=False)
    with pytest.warns(UserWarning, match="says add_bos_token false, which tokenizer.json's post-processor does not"):
        assert Tokenizer.from_dir(model_dir).encode(text) == expected[1:]
    # two tokens in front are no BOS policy qkiln knows: neither is added, and BOS stays the config's
    backend.post_processor = processors.TemplateProcessing(single="<|eos|> <|bos|> $A", special_tokens=[
        ("<|bos|>", 256), ("<|eos|>", 257)])
    backend.save(str(model_dir / "tokenizer.json"))
    edit_json(model_dir / "tokenizer_config.json", add_bos_token=None)
    two = Tokenizer.from_dir(model_dir)
    assert not two.add_bos and two.bos_token_id == 256 and two.encode(text) == expected[1:]


def test_eos_ids_in_generation_config_stop_generation_as_in_transformers(tmp_path):
    """Llama 3 Instruct's layout: config.json names one EOS, generation_config.json adds
    end-of-turn; both stop (transformers and vLLM read the second file)."""
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    free = hf_greedy(model_dir, PROMPT, 6, eos_token_id=None)
    stop_at = next(t for t in free[2:] if t != 257)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, stop_at]}))
    expected = hf_greedy(model_dir, PROMPT, 6)
    assert expected[-1] == stop_at and len(expected) < 6
    out = LLM(str(model_dir), dtype="fp32", num_kv_blocks=16).generate({"prompt_token_ids": PROMPT},
                                                                       SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert out.stop_reason == stop_at  # not the tokenizer's EOS: vLLM reports it as a stop token
    assert load_source(str(model_dir)).config.eos_token_ids == (257, stop_at)


def test_the_tokenizer_s_eos_stops_generation_as_in_vllm(tmp_path):
    """A fine-tune's layout: config.json keeps the base model's EOS, the tokenizer names the
    end-of-turn token it was trained to emit."""
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    free = hf_greedy(model_dir, PROMPT, 6, eos_token_id=None)
    stop_at = next(t for t in free[2:] if t != 257)
    name = Tokenizer.from_dir(model_dir).backend.id_to_token(stop_at)
    edit_json(model_dir / "tokenizer_config.json", eos_token=name)
    llm = LLM(str(model_dir), dtype="fp32", num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.finish_reason == "stop"
    ignored = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert ignored[0].token_ids == free


def test_rope_inv_freq_saved_by_older_transformers_is_ignored(tmp_path):
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    weights = load_file(model_dir / "model.safetensors")
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(16)  # wrong values, unused
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert_greedy_as_transformers(model_dir, 4)


def test_a_config_without_architectures_is_read_by_its_model_type(tmp_path):
    model_dir = write_tiny_hf_model(tmp_path, "qwen2")
    edit_json(model_dir / "config.json", architectures=None)
    assert load_source(str(model_dir)).config.architecture == "qwen2"


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ({"attention_bias": True}, "o_proj bias"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_what_the_model_would_compute_differently_is_refused(tmp_path, change, message):
    """A model transformers computes otherwise than qkiln's layers would is refused by name, not
    loaded to answer wrongly (a GELU Llama loaded, and its first greedy token was another)."""
    model_dir = write_tiny_hf_model(tmp_path, "llama", **change)
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load_source(str(model_dir))


def test_qwen_sliding_window_applies_only_to_the_layers_transformers_slides():
    hf = transformers.Qwen2Config(use_sliding_window=True, sliding_window=8, num_hidden_layers=4,
                                  max_window_layers=28, max_position_embeddings=512).to_dict()
    hf["architectures"] = ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf(hf).max_position_embeddings == 512  # no layer past max_window_layers: none slides
    with pytest.warns(UserWarning, match="sliding window of 8"):
        assert ModelConfig.from_hf(hf | {"max_window_layers": 2, "layer_types": None}).max_position_embeddings == 8
    assert ModelConfig.from_hf(hf | {"use_sliding_window": False, "max_window_layers": 0,
                                     "layer_types": None}).sliding_window is None


def test_the_dense_model_refuses_more_tokens_than_its_context(tmp_path):
    """A sliding window caps the context; a longer window through the Python API had been an
    IndexError from the RoPE table."""
    from qkiln.errors import SourceModelError

    model = load_source(str(write_tiny_hf_model(tmp_path, "llama", max_position_embeddings=16))).build_model()
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape[1] == 16
    with pytest.raises(SourceModelError, match="17 tokens exceed the model's context of 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_a_stored_head_under_a_tying_config_is_used_as_transformers_uses_it(tmp_path):
    """tie_word_embeddings true, yet the checkpoint holds its own lm_head.weight: transformers warns
    and computes with the stored head; qkiln tied it (dropping the head), and its greedy text
    differed from the first token."""
    model_dir = write_tiny_hf_model(tmp_path, "mistral")  # untied: it stores its head
    edit_json(model_dir / "config.json", tie_word_embeddings=True)
    weights = load_file(model_dir / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    with pytest.warns(UserWarning, match="stores a different lm_head.weight"):
        source = load_source(str(model_dir))
    assert not source.config.tie_word_embeddings
    assert_greedy_as_transformers(model_dir, 6)


def test_rope_theta_in_rope_parameters_wins_over_a_top_level_one_as_in_transformers(tmp_path):
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    config = json.loads((model_dir / "config.json").read_text())
    params = config.get("rope_parameters") or {"rope_type": "default"}
    edit_json(model_dir / "config.json", rope_theta=10.0, rope_parameters=params | {"rope_theta": 500000.0})
    assert load_source(str(model_dir)).config.rope_theta == 500000.0
    assert_greedy_as_transformers(model_dir, 6)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling lacks low_freq_factor"),
    ({"rope_scaling": {"type": "linear"}}, "linear rope scaling lacks factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_theta is '1e4', not a positive number"),
    ({"rms_norm_eps": None}, "rms_norm_eps is None"),
    ({"max_position_embeddings": None}, "max_position_embeddings is None"),
    ({"rope_parameters": [1]}, "rope_parameters is list"),
    ({"hidden_size": ...}, "config.json has no 'hidden_size', which a llama config needs"),  # was "malformed ('hidden_size')"
])
def test_a_malformed_config_is_a_source_model_error_not_a_traceback(tmp_path, change, message):
    """Each had failed with a KeyError / TypeError / ValueError traceback (exit 1, a bug's), some only
    at the first forward; transformers refuses the incomplete rope scalings too."""
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    edit_json(model_dir / "config.json", **{k: v for k, v in change.items() if v is not None and v is not ...})
    if ... in change.values():  # a key left out
        data = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k not in change}))
    if None in change.values():
        data = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(data | change))  # an explicit null, not a missing key
    with pytest.raises(SourceModelError, match=message):
        load_source(str(model_dir))


def test_a_quantized_checkpoint_as_a_source_names_qkiln_import(tmp_path):
    """Its tensors are codes and scales: it was refused as 'weights do not fit ... config and
    tensors disagree', naming fused tensors the file does not have."""
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    edit_json(model_dir / "config.json", quantization_config={"quant_method": "compressed-tensors"})
    with pytest.raises(SourceModelError, match=r"is a quantized checkpoint \(compressed-tensors\): `qkiln import"):
        load_source(str(model_dir))


def test_folders_as_users_have_them_are_read_or_told_what_to_do(tmp_path, monkeypatch):
    """Probe s50: a LoRA adapter saved beside the weights was loaded as weights ("config and tensors
    disagree"); a tokenizer.model-only or .bin-only folder was told what it already had or nothing
    of what to do; `~` was not expanded; a hub id in the local cache was "not found"."""
    import shutil

    model_dir = write_tiny_hf_model(tmp_path / "m", "llama")
    reference = load_source(model_dir).state_dict["model.norm.weight"]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert torch.equal(load_source("~/m").state_dict["model.norm.weight"], reference)
    # the hub cache's layout: models--org--name/snapshots/<commit>/, refs/main naming the commit
    repo = tmp_path / "hub" / "models--someorg--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert torch.equal(load_source("someorg/tiny").state_dict["model.norm.weight"], reference)
    assert load_source("someorg/tiny").name == "someorg/tiny@abc123"  # provenance: not the bare commit
    with pytest.raises(SourceModelError, match="not found: .*a hub id in the local Hugging Face cache"):
        load_source("someorg/absent")

    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)}, str(model_dir / "adapter_model.safetensors"))
    (model_dir / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(SourceModelError, match="PEFT / LoRA adapter .* merge it into its base model first"):
        load_source(model_dir)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (model_dir / name).unlink()
    adapter_only = tmp_path / "my-lora"  # as PEFT saves one: no config.json
    adapter_only.mkdir()
    (adapter_only / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "org/base"}')
    with pytest.raises(SourceModelError, match=r"LoRA adapter .* merge it into its base model \(org/base\)"):
        load_source(adapter_only)
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(SourceModelError, match="pytorch_model.bin: pickled weights.*save_pretrained"):
        load_source(model_dir)
    (model_dir / "tokenizer.json").rename(model_dir / "tokenizer.model")
    with pytest.raises(SourceModelError, match="SentencePiece tokenizer.model but no tokenizer.json"):
        Tokenizer.from_dir(model_dir)


def test_a_checkpoint_another_user_cannot_read_is_said_so(other_user):
    """transformers saves model.safetensors 0600, and safetensors reports EACCES as "No such file or
    directory": a teammate's checkpoint was 'not a valid safetensors file ...; re-download it'."""
    model_dir = write_tiny_hf_model(other_user.folder / "theirs", "llama")
    (model_dir / "model.safetensors").chmod(0o600)
    load = ("from qkiln.runtime.source import load_source; from qkiln.errors import SourceModelError\n"
            "try: load_source(sys.argv[1])\n"
            "except SourceModelError as e: print(e)")
    out = other_user.python(load, model_dir)
    assert out.returncode == 0, out.stderr
    assert "model.safetensors: cannot be read (permission denied" in out.stdout and "chmod a+r" in out.stdout
    (model_dir / "model.safetensors").chmod(0o644)
    (model_dir / "tokenizer.json").chmod(0o600)  # was "not a valid tokenizer.json ...; re-download it"
    out = other_user.python(load, model_dir)
    assert "tokenizer.json: cannot be read (permission denied" in out.stdout and "chmod a+r" in out.stdout


def _file_mappings(path) -> list[tuple[int, int]]:
    """[start, end) address ranges of this process's memory maps of `path` (/proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def test_a_mapped_source_reads_its_weights_from_the_files_pages(tmp_path):
    # a build's source is held as views of the file's pages (reclaimable), a server's as copies
    model_dir = write_tiny_hf_model(tmp_path, "llama")
    weights = (model_dir / "model.safetensors").resolve()
    mapped, copied = load_source(model_dir, mapped=True), load_source(model_dir)
    ranges = _file_mappings(weights)
    inside = lambda t: any(start <= t.data_ptr() < end for start, end in ranges)  # noqa: E731
    assert ranges and all(inside(t) for t in mapped.state_dict.values())
    assert not any(inside(t) for t in copied.state_dict.values())
    assert all(torch.equal(mapped.state_dict[k], v) for k, v in copied.state_dict.items())
    mapped.check_unchanged()
    edit_json(model_dir / "config.json", rms_norm_eps=1e-5)  # a file it was read from, rewritten
    with pytest.raises(SourceModelError, match="config.json .* changed while the model was read"):
        mapped.check_unchanged()
