"""stories260K (llama2.c, ../shared/models/stories260k) written as a llama.cpp GGUF with its
SentencePiece tokenizer (`tokenizer.ggml.model` "llama": pieces, scores, token types, no merges),
as llama.cpp's convert-llama2c-to-ggml writes it: a real model with an SPM vocabulary, for tests.

llama2.c's legacy checkpoint: seven int32s (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size (negative: an untied classifier follows), seq_len), then fp32 tensors in its order.
Its RoPE rotates interleaved pairs, the layout GGUF stores Q and K in, so they go in as they are.
tok512.bin: an int32 (longest piece), then per token a float32 score, an int32 length and the
piece's UTF-8 with SentencePiece's "▁" written as " " (BOS and EOS as "\\n<s>\\n", "\\n</s>\\n").
"""

import struct
from pathlib import Path

import numpy as np

STORIES = Path(__file__).resolve().parents[1] / "../shared/models/stories260k"
# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def read_llama2c(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    raw = path.read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("7i", raw[:28])
    config = dict(dim=dim, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=abs(vocab),
                  seq_len=seq_len, tied=vocab > 0)
    kv_dim, head_size = dim * kv_heads // heads, dim // heads
    data, offset, tensors = np.frombuffer(raw, dtype=np.float32, offset=28), 0, {}

    def take(name, *shape):
        nonlocal offset
        count = int(np.prod(shape))
        tensors[name] = data[offset:offset + count].reshape(shape).copy()
        offset += count

    take("token_embd", abs(vocab), dim)
    take("attn_norm", layers, dim)
    take("attn_q", layers, dim, dim)
    take("attn_k", layers, kv_dim, dim)
    take("attn_v", layers, kv_dim, dim)
    take("attn_output", layers, dim, dim)
    take("ffn_norm", layers, dim)
    take("ffn_gate", layers, hidden, dim)
    take("ffn_down", layers, dim, hidden)
    take("ffn_up", layers, hidden, dim)
    take("output_norm", dim)
    offset += seq_len * head_size  # the precomputed RoPE table (real and imaginary halves)
    if vocab < 0:
        take("output", abs(vocab), dim)
    assert offset == data.size, f"{path}: {data.size - offset} floats left over"
    return config, tensors


def read_tok512(path: Path, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    raw, offset = path.read_bytes(), 4
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        score, length = struct.unpack_from("fi", raw, offset)
        piece = raw[offset + 8:offset + 8 + length].decode("utf-8").strip("\n")
        offset += 8 + length
        kind = UNKNOWN if i == 0 else CONTROL if piece in ("<s>", "</s>") else \
            BYTE if len(piece) == 6 and piece.startswith("<0x") else NORMAL
        tokens.append(piece.replace(" ", "\u2581") if kind == NORMAL else piece)
        scores.append(score)
        types.append(kind)
    return tokens, scores, types


def write_stories_gguf(out_dir: Path) -> Path:
    import gguf

    config, tensors = read_llama2c(STORIES / "stories260K.bin")
    tokens, scores, types = read_tok512(STORIES / "tok512.bin", config["vocab"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "stories260K.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("stories260K")
    writer.add_context_length(config["seq_len"])
    writer.add_embedding_length(config["dim"])
    writer.add_block_count(config["layers"])
    writer.add_feed_forward_length(config["hidden"])
    writer.add_head_count(config["heads"])
    writer.add_head_count_kv(config["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)  # llama2.c's rmsnorm
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    for name in ("token_embd", "output_norm", "output"):
        if name in tensors:
            writer.add_tensor(f"{name}.weight", tensors.pop(name))
    for name, stacked in tensors.items():
        for layer in range(config["layers"]):
            writer.add_tensor(f"blk.{layer}.{name}.weight", stacked[layer])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
