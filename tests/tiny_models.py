"""Tiny random Hugging Face checkpoints of each supported architecture, written to real files.

Used by tests that need a real HF directory (config.json + safetensors + tokenizer.json) without
a model hub. transformers is a test-only dependency: it writes the reference checkpoints.
"""

from pathlib import Path

import torch

TINY = dict(
    vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257,
)


def hf_config(arch: str, **overrides):
    import transformers

    kw = dict(TINY, **overrides)
    if arch == "llama":
        return transformers.LlamaConfig(rope_theta=10000.0, tie_word_embeddings=True, **kw)
    if arch == "llama3":
        return transformers.LlamaConfig(
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64),
            **kw,
        )
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **kw)
    if arch == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **kw)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=32, use_sliding_window=False, **kw)
    raise ValueError(arch)


def byte_tokenizer():
    """A real byte-level BPE tokenizer over 256 byte tokens (no merges), BOS/EOS as specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def trained_byte_level_bpe(corpus: list[str]):
    """GPT-2 / SmolLM2 style byte-level BPE trained on `corpus`, with few merges so multibyte
    characters span tokens; <eos> special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def sentencepiece_byte_fallback():
    """Llama-2 style: metaspace pieces plus <0xNN> byte-fallback tokens for unknown characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<eos>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "h", "e", "l", "o", "w", "r", "d", "c", "a", "f", "n", "i", "v", "!", ":", "\u2581h", "ll"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "h"), ("l", "l")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<eos>"])
    return tok


def write_tiny_hf_model(directory: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Random-weight HF checkpoint of `arch` in `directory`; returns the directory."""
    import json

    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # random init has tiny norms; make the norms non-trivial too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    tok = byte_tokenizer()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])  # ids 256, 257
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")}))
    return directory


CALIBRATION_SENTENCE = "It was a bright cold day in April, and the clocks were striking thirteen. "


def write_tiny_model_and_text(root: Path, text: str = CALIBRATION_SENTENCE * 200) -> tuple[Path, Path]:
    """A tiny random llama checkpoint at root/model and a calibration text file root/calib.txt."""
    model = write_tiny_hf_model(root / "model", "llama")
    calib = root / "calib.txt"
    calib.write_text(text)
    return model, calib


def simulated_greedy(artifact: Path, prompt: list[int], num_tokens: int) -> list[int]:
    """The tokens greedy decoding gives through an artifact's simulation (what its accuracy report
    measures): the reference that served or exported forms are compared with."""
    from qkiln.compile.artifact_model import load_artifact_model

    simulated = load_artifact_model(artifact)
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(simulated(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def write_tiny_gguf(path: Path, hf_dir: Path, arch: str = "llama", metadata: dict | None = None,
                    tensors: dict | None = None, token_types: dict[int, int] | None = None) -> Path:
    """The tiny HF model in `hf_dir` as llama.cpp's converter writes it (F32): GGUF tensor names, Q/K
    rows permuted for llama, its byte-level vocabulary. `metadata`: extra or replaced keys (None
    drops one); `tensors`: extra tensors; `token_types`: id -> llama.cpp token type (3 control,
    4 user-defined)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from qkiln.runtime.gguf_reader import _GLOBAL_NAMES, _LAYER_NAMES

    config = json.loads((hf_dir / "config.json").read_text())
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = [None] * config["vocab_size"]
    for token, i in vocab["model"]["vocab"].items():
        tokens[i] = token
    for added in vocab["added_tokens"]:
        tokens[added["id"]] = added["content"]
    tokens = [t if t is not None else f"<unused{i}>" for i, t in enumerate(tokens)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in vocab["model"]["merges"]]
    if not merges:  # GGUF has no empty arrays: one merge, into the last (unused) slot
        tokens[-1], merges = "ab", ["a b"]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    for i, kind in (token_types or {}).items():
        types[i] = kind
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    keys = {f"{arch}.context_length": ("uint32", config["max_position_embeddings"]),
            f"{arch}.embedding_length": ("uint32", config["hidden_size"]),
            f"{arch}.block_count": ("uint32", config["num_hidden_layers"]),
            f"{arch}.feed_forward_length": ("uint32", config["intermediate_size"]),
            f"{arch}.attention.head_count": ("uint32", heads),
            f"{arch}.attention.head_count_kv": ("uint32", kv_heads),
            f"{arch}.attention.layer_norm_rms_epsilon": ("float32", config["rms_norm_eps"]),
            f"{arch}.rope.freq_base": ("float32", config.get("rope_theta")
                                       or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            "tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "gpt2"),
            "tokenizer.ggml.bos_token_id": ("uint32", tokens.index("<|bos|>")),
            "tokenizer.ggml.eos_token_id": ("uint32", tokens.index("<|eos|>"))}
    keys |= metadata or {}
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if value is not None:
            getattr(writer, f"add_{value[0]}")(key, value[1])
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    gguf_names = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        module = None
        if base.startswith("model.layers."):
            _, _, layer, module = base.split(".", 3)
            gname = f"blk.{layer}.{layer_names[module]}.{suffix}"
        else:
            gname = f"{gguf_names[base]}.{suffix}"
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):  # convert_hf_to_gguf's permute
            n = heads if module == "self_attn.q_proj" else kv_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
    for name, w in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
