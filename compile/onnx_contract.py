"""engine.json: what a runtime needs to drive an ONNX engine without reading qkiln's source.

A deployer binds the graph's inputs and caches, implements (or links) the two plugin nodes, and
turns logits into text: this file says how for each, in the engine's own numbers (shapes, dtypes,
formulas, limits). `files` holds the sha256 of the graph and its weights, so an engine folder on
its own (`qkiln export --format onnx`) can be checked (`qkiln verify ENGINE_DIR`).

The cache encodings restate plugins/kv_cache.py (the source of truth, tested bit for bit against
every kernel); a plugin that writes caches qkiln's runtime also reads must match them exactly.
"""

from pathlib import Path

from qkiln.errors import ArtifactError
from qkiln.plugins import onnx_nodes
from qkiln.runtime.config import ModelConfig

from .artifact import MANIFEST_NAME, UNFINISHED_RE, Manifest

# 2: logits_indices, plugin signatures, encodings, limits, tokens, file hashes; 3: no KV group size
# but an int4 cache's, key_offset and BOS / EOS semantics; 4: `digest`, the sha256 of engine.json's
# own content (as the manifest's), so an edited contract is refused in an engine folder on its own
CONTRACT_VERSION = 4
OPSET = 21  # block-wise DequantizeLinear with INT4 / UINT4
# IR 10 came with opset 21 and the 4-bit types: the oldest that holds this graph, so the widest
# range of runtimes reads it (onnx 1.23 writes IR 14 by default, which ONNX Runtime 1.31 refuses)
IR_VERSION = 10
MODEL_FILE, DATA_FILE, CONTRACT_FILE = "model.onnx", "model.onnx.data", "engine.json"
INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")

# what each graph input means (runtime/paged_attention.py feeds the same)
INPUT_SEMANTICS = {
    "input_ids": "the step's tokens, all sequences flattened: sequence s owns rows "
                 "query_start_loc[s] .. query_start_loc[s + 1], its last positions",
    "positions": "each token's position in its sequence (RoPE), in 0 .. max_positions - 1",
    "slot_mapping": "where each token's K/V is written: block_id * block_size + offset; -1: not written",
    "block_tables": "each sequence's cache blocks in order; rows padded with any valid block id",
    "seq_lens": "each sequence's context length including this step's tokens",
    "query_start_loc": "prefix sums of the sequences' token counts, starting at 0",
    "logits_indices": "the rows of input_ids whose next-token logits to compute, in order: each sampling "
                      "sequence's last row when serving, every row when scoring; logits has one row each",
}

_KV_ENCODINGS = {
    "bf16": "K and V stored as bfloat16 (round to nearest even)",
    "fp16": "K and V stored as float16 (round to nearest even)",
    "fp32": "K and V stored as float32",
    "fp8": "stored = float8e4m3fn(clip(x / scale[h], -448, 448)) with k_scale / v_scale [num_kv_heads] float32 "
           "(static, from calibration; initializers model.layers.{i}.self_attn.k_scale / v_scale feeding the "
           "plugin nodes); read back as float(stored) * scale[h]",
    "int4": "in float32 arithmetic, per (slot, kv head, group of group_size channels): min = float16 rounded "
            "down from the group's minimum, scale = float16 rounded up from max(2^-23, (max - min) / 15) with that "
            "rounded min, q = clamp(round half to "
            "even((x - min) / scale), 0, 15); k / v bytes hold two codes, byte j = q[2j] | q[2j + 1] << 4 "
            "(low nibble = even channel); k_group_scale / k_group_min (and v_) float16 [num_blocks, block_size, "
            "num_kv_heads, head_dim / group_size] are cache tensors the CacheWrite node writes; read back as "
            "q * scale + min",
}

_PLUGIN_NODES = {
    "CacheWrite": {
        "inputs": ["key [N, num_kv_heads, head_dim] float32", "value [N, num_kv_heads, head_dim] float32",
                   "k_cache", "v_cache", "k_scale (fp8) or ''", "v_scale (fp8) or ''",
                   "k_group_scale (int4) or ''", "k_group_min (int4) or ''", "v_group_scale (int4) or ''",
                   "v_group_min (int4) or ''", "k_channel_scale [num_kv_heads, head_dim] float32 or ''",
                   "slot_mapping [N] int64"],
        "outputs": ["k_cache after the write", "v_cache after the write",
                    "(int4 only) k_group_scale, k_group_min, v_group_scale, v_group_min after the write"],
        "attributes": {"kv_dtype": "bf16 | fp16 | fp32 | fp8 | int4", "group_size": "int4 channels per group, "
                       "else 0", "plugin_namespace": onnx_nodes.DOMAIN, "plugin_version": onnx_nodes.PLUGIN_VERSION},
        "semantics": "row n of key / value is encoded (kv_cache.encoding) into slot slot_mapping[n] of every "
                     "cache tensor; a key is divided by k_channel_scale first when given; slot -1 is skipped. "
                     "The outputs are the inputs written in place: bind each to its input's buffer",
    },
    "PagedAttention": {
        "inputs": ["query [N, num_heads, head_dim] float32", "k_cache (as written)", "v_cache (as written)",
                   "k_scale", "v_scale", "k_group_scale", "k_group_min", "v_group_scale", "v_group_min",
                   "k_channel_scale (each as CacheWrite's, '' where absent)", "block_tables [S, B] int32",
                   "seq_lens [S] int32", "query_start_loc [S + 1] int32"],
        "outputs": ["out [N, num_heads, head_dim] float32"],
        "attributes": {"kv_dtype": "as CacheWrite's", "scale": "softmax scale, head_dim ** -0.5",
                       "plugin_namespace": onnx_nodes.DOMAIN, "plugin_version": onnx_nodes.PLUGIN_VERSION},
        "semantics": "for sequence s, its query rows query_start_loc[s] .. query_start_loc[s + 1] are the "
                     "last q_len of its seq_lens[s] positions; row j attends causally to positions "
                     "0 .. seq_lens[s] - q_len + j, read through block_tables[s] (position p in block "
                     "block_tables[s][p // block_size], offset p % block_size), keys multiplied back by "
                     "k_channel_scale; query head h reads kv head h // (num_heads / num_kv_heads); "
                     "softmax(scale * q.k) v accumulated in at least float32",
    },
}


def engine_contract(manifest: Manifest, config: ModelConfig, kv: dict, cache_io: list[dict],
                    int4_zero_points: bool, key_smoothing: bool, key_offset: bool) -> dict:
    """engine.json's content but `files` (added by onnx_graph.write_onnx_engine once written)."""
    return {
        "contract_version": CONTRACT_VERSION, "format": "onnx", "ir_version": IR_VERSION,
        "opset": OPSET, "plugin_domain": onnx_nodes.DOMAIN, "plugin_version": onnx_nodes.PLUGIN_VERSION,
        "plugins": list(_PLUGIN_NODES), "plugin_nodes": _PLUGIN_NODES,
        "model": MODEL_FILE, "external_data": DATA_FILE, "activation_dtype": "float32",
        "artifact": {"name": manifest.name, "recipe": manifest.recipe.get("name"),
                     "source_sha256": manifest.source.get("sha256"),
                     "tokenizer": "the artifact's tokenizer/ folder (tokenizer.json; tokenizer_config.json holds "
                                  "the chat template)"},
        "tokens": {"vocab_size": config.vocab_size, "bos_token_id": config.bos_token_id,
                   "eos_token_ids": list(config.eos_token_ids),
                   "bos": "put before a prompt when the artifact's tokenizer adds it (tokenizer_config.json's "
                          "add_bos_token, else tokenizer.json's post-processor); generation also stops at the "
                          "tokenizer's eos_token"},
        "max_positions": config.max_position_embeddings,
        "attention": {"num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
                      "head_dim": config.head_dim, "scale": config.head_dim ** -0.5},
        "kv_cache": kv_cache_shape(kv, config) | {
            "encoding": _kv_encoding(kv, manifest), "key_smoothing": key_smoothing, "key_offset": key_offset,
            "key_offset_semantics": "when true, the graph subtracts a per-channel offset from keys before "
                                    "CacheWrite and never adds it back: each query's scores all shift by "
                                    "q . offset, which softmax cancels; a runtime does nothing about it",
            "block_size": "any size >= 1, the same for every cache tensor (qkiln's runtime uses 16)"},
        "int4_zero_points": int4_zero_points,
        "inputs": list(INPUTS), "outputs": ["logits"],
        "semantics": INPUT_SEMANTICS | {"logits": "[len(logits_indices), vocab_size] float32"},
        "cache": cache_io,
        "aliasing": "each cache_out.* is its cache.* written in place: bind them to one buffer",
        "onnxruntime": "int4 linears are DequantizeLinear -> MatMul, which ONNX Runtime fuses into MatMulNBits; "
                       "set the session config entry session.qdq_matmulnbits_accuracy_level to 0 to compute them "
                       "with float activations as the artifact does (ONNX Runtime's default, 4, rounds "
                       "activations to int8). fp8 and int8 weights are dequantized each step (not fused)",
    }


def kv_cache_shape(kv: dict, config: ModelConfig) -> dict:
    """The part of engine.json's kv_cache entry that says which caches the engine takes: what an
    engine of another model or cache differs in (onnx_check.check_contract compares it)."""
    return {"dtype": kv["dtype"], "group_size": kv_group_size(kv), "num_layers": config.num_hidden_layers,
            "num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}


def kv_group_size(kv: dict) -> int | None:
    """Channels per scale group of an int4 cache; other caches have none (a scheme's unused
    default had gone into fp8 engines as 16)."""
    return int(kv["group_size"]) if kv["dtype"] == "int4" else None


def _kv_encoding(kv: dict, manifest: Manifest) -> str:
    text = _KV_ENCODINGS[kv["dtype"]]
    if not manifest.kv_cache:  # no KV scheme: the runtime's default cache, not the artifact's float32 simulation
        text += ("; the artifact has no KV scheme, so this is the runtime's default cache: its recorded accuracy "
                 "was measured with K/V in float32")
    return text


def rewrite_hint(engine_dir) -> str:
    """How to put a good engine where `engine_dir`'s is: one built into an artifact (its
    engines/onnx/) is part of what the manifest hashes, so it comes back with a rebuild; one on its
    own is exported again."""
    engines = Path(engine_dir).absolute().parent
    if UNFINISHED_RE.fullmatch(engines.parent.name):  # a build checking the engine it wrote
        return "rerun the build, and report it as a qkiln bug if it fails again"
    if engines.name == "engines" and (engines.parent / MANIFEST_NAME).is_file():
        return (f"rebuild the artifact (qkiln build ... --engine onnx --force), or export an engine beside it "
                f"(qkiln export {engines.parent} --format onnx -o DIR)")
    return "re-export it from its artifact (qkiln export ARTIFACT --format onnx -o DIR)"


def read_engine_model(engine_dir: Path):
    """An engine's model.onnx as an onnx ModelProto, its weights read from model.onnx.data here; a
    damaged file is an ArtifactError.

    The weights are read by offset from DATA_FILE itself rather than by onnx.load, which refuses a
    data file with more than one hard link: a backup made with `cp -al`, `rsync --link-dest` or a
    deduplicating store had made every engine, the original too, unreadable. A tensor may name no
    other file, so a model cannot point outside its folder either."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    try:
        model = onnx.load(str(Path(engine_dir) / MODEL_FILE), load_external_data=False)
        external = [t for t in _all_tensors(model.graph) if uses_external_data(t)]
        if external:
            with open(Path(engine_dir) / DATA_FILE, "rb") as data:
                for tensor in external:
                    _read_external(tensor, ExternalDataInfo(tensor), data)
        return model
    except ArtifactError:
        raise
    except Exception as e:  # onnx and protobuf raise their own types (DecodeError, ...)
        raise ArtifactError(f"the ONNX engine in {engine_dir} cannot be read ({type(e).__name__}: {e}); "
                            f"{rewrite_hint(engine_dir)}") from None


def _all_tensors(graph):
    """Every tensor of a graph that may hold its data outside it: initializers, and tensors in node
    attributes, subgraphs included (what onnx.load reads external data into)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for subgraph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_tensors(subgraph)


def _read_external(tensor, info, data) -> None:
    """Move one tensor's bytes from the open data file into the tensor (as onnx.load would)."""
    import onnx

    if info.location != DATA_FILE:
        raise ArtifactError(f"tensor {tensor.name!r} of the ONNX engine names data file {info.location!r}; an engine "
                            f"keeps its weights in {DATA_FILE} beside model.onnx: re-export it")
    data.seek(info.offset or 0)
    raw = data.read() if info.length is None else data.read(info.length)
    if info.length is not None and len(raw) != info.length:
        raise ArtifactError(f"{DATA_FILE} ends before tensor {tensor.name!r} (offset {info.offset}, length "
                            f"{info.length}): the file is truncated; re-export the engine")
    tensor.raw_data = raw
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]
