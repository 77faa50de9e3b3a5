"""An artifact as an ONNX engine: one serving step of the paged runtime as an ONNX graph.

The graph is built node by node from the manifest and the artifact's canonical tensors, the way
TensorRT-LLM's builder and ONNX Runtime GenAI's model builder write theirs; torch.onnx's exporter
cannot carry the mutating paged-cache ops (its dynamo path has no translation for
auto_functionalized). Standard ops (opset 21) for everything but the cache, which the plugin
nodes of plugins/onnx_nodes.py read and write:

    inputs   input_ids, positions, slot_mapping [N] int64; block_tables [S, B], seq_lens [S],
             query_start_loc [S + 1] int32; logits_indices [L] int64; per layer `cache.{i}.{field}`
             in the cache's storage dtype (k, v; int4 adds k_group_scale, k_group_min,
             v_group_scale, v_group_min)
    outputs  logits [L, vocab] float32 (the rows logits_indices names: a server asks for the
             sampled rows only); `cache_out.{i}.{field}`, the caches after this step's write

Activations are float32. Weights keep their stored precision. int4 and fp8 linears are
DequantizeLinear of codes laid out [in, out] (block-wise along in_features for groups) feeding
MatMul: the weight-only pattern ONNX Runtime fuses into MatMulNBits and TensorRT Model Optimizer
writes for TensorRT. int8 linears dequantize per channel into Gemm(transB=1) on the stored
[out, in] codes; dense weights stay bf16 [out, in] behind a Cast into Gemm(transB=1). fp8 linears
quantize activations per token, or with a static recipe's calibrated scale, as the runtime does.
Symmetric int4 is INT4 without a zero point; asymmetric int4 is UINT4 with its integral zero
points, which ONNX Runtime takes and TensorRT's dequantize layer refuses (engine.json says which).

The file: `model.onnx` with its weights in `model.onnx.data` (external data: protobuf's 2 GB limit)
and `engine.json`, the contract a runtime drives it by (onnx_contract.py). Same artifact, same bytes.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qkiln.errors import ArtifactError
from qkiln.plugins import onnx_nodes
from qkiln.plugins.kv_cache import FP8_MAX
from qkiln.quant.pack import unpack_int4
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.rope import RotaryEmbedding

from .artifact import Manifest, manifest_digest, sha256_file
from .onnx_contract import CONTRACT_FILE, DATA_FILE, INPUTS, IR_VERSION, MODEL_FILE, OPSET, engine_contract, kv_group_size

_FP8_MIN_SCALE = 1e-12  # the runtime's per-token fp8 scale floor (plugins/reference.py)
_FLOAT = 1  # onnx.TensorProto.FLOAT; onnx itself is imported where used (the extra is optional)


@dataclass
class OnnxEngine:
    model: object  # onnx.ModelProto, weights inline
    contract: dict


class _Graph:
    """Nodes and initializers in creation order; every name unique and readable."""

    def __init__(self):
        self.nodes, self.initializers, self._count, self._names = [], [], 0, set()

    def op(self, op_type: str, inputs, outputs: int | list[str] = 1, domain: str = "", **attrs):
        from onnx import helper

        if isinstance(outputs, int):
            self._count += 1
            outputs = [f"{op_type.lower()}_{self._count}" + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=f"{op_type}_{len(self.nodes)}",
                                           domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(self, name: str, array) -> str:
        """An initializer; a name already defined is reused (shape constants, shared weights)."""
        from onnx import numpy_helper

        if name not in self._names:
            self._names.add(name)
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name


def build_onnx_engine(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> OnnxEngine:
    """manifest + canonical tensors (compile/artifact_tensors.py) -> the step graph and its contract."""
    import onnx
    from onnx import TensorProto, helper

    config = ModelConfig.from_dict(manifest.architecture)
    kv = manifest.kv_cache or {"dtype": "bf16"}
    linears = manifest.quantization.get("linears", {})
    g = _Graph()
    builder = _Builder(g, config, tensors, linears, kv)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["num_tokens"]) for n in INPUTS[:3]]
    inputs += [helper.make_tensor_value_info("block_tables", TensorProto.INT32, ["num_seqs", "max_blocks"]),
               helper.make_tensor_value_info("seq_lens", TensorProto.INT32, ["num_seqs"]),
               helper.make_tensor_value_info("query_start_loc", TensorProto.INT32, ["num_seqs_plus_1"]),
               helper.make_tensor_value_info("logits_indices", TensorProto.INT64, ["num_logits"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["num_logits", config.vocab_size])]
    cache_io = []
    for i in range(config.num_hidden_layers):
        for field, (dtype, last) in builder.cache_fields().items():
            shape = ["num_blocks", "block_size", config.num_key_value_heads, last]
            inputs.append(helper.make_tensor_value_info(f"cache.{i}.{field}", dtype, shape))
            outputs.append(helper.make_tensor_value_info(f"cache_out.{i}.{field}", dtype, shape))
            cache_io.append({"input": f"cache.{i}.{field}", "output": f"cache_out.{i}.{field}",
                             "dtype": TensorProto.DataType.Name(dtype), "shape": shape})
    builder.step()
    graph = helper.make_graph(g.nodes, f"qkiln_{manifest.name}_step", inputs, outputs, g.initializers)
    model = helper.make_model(graph, ir_version=IR_VERSION, producer_name="qkiln", producer_version=_qkiln_version(),
                              opset_imports=[helper.make_opsetid("", OPSET),
                                             helper.make_opsetid(onnx_nodes.DOMAIN, onnx_nodes.DOMAIN_VERSION)])
    model.doc_string = "one serving step of a qkiln artifact over its paged KV cache; see engine.json"
    onnx.helper.set_model_props(model, {"qkiln.artifact": manifest.name, "qkiln.kv_cache": kv["dtype"]})
    first_attention = "model.layers.0.self_attn."
    contract = engine_contract(
        manifest, config, kv, cache_io,
        int4_zero_points=any(f"{n}.zeros" in tensors for n, e in linears.items() if e.get("format") == "int4"),
        key_smoothing=first_attention + "k_channel_scale" in tensors, key_offset=first_attention + "k_offset" in tensors)
    return OnnxEngine(model, contract)


def step_inputs(*inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """A step's INPUTS by name; without logits_indices, every row's logits (scoring)."""
    if len(inputs) == len(INPUTS) - 1:
        inputs = (*inputs, torch.arange(len(inputs[0])))
    return dict(zip(INPUTS, inputs, strict=True))


def write_onnx_engine(engine: OnnxEngine, out_dir: Path) -> list[Path]:
    """model.onnx + model.onnx.data + engine.json into out_dir (which must exist)."""
    import onnx

    out_dir = Path(out_dir)
    model = onnx.ModelProto()
    model.CopyFrom(engine.model)  # the external-data conversion rewrites tensors in place
    onnx.save_model(model, out_dir / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)  # small constants (shapes, axes, eps) stay inline, so
    # checkers and shape inference that read the file by path (the only way past 2 GB) see them
    (out_dir / DATA_FILE).chmod(0o644)  # onnx creates it owner-only; an engine is meant to be shared
    files = {name: sha256_file(out_dir / name) for name in (MODEL_FILE, DATA_FILE)}
    contract = engine.contract | {"files": files}
    contract["digest"] = manifest_digest(contract)  # the manifest's rule: canonical JSON without the digest
    (out_dir / CONTRACT_FILE).write_text(json.dumps(contract, indent=2, sort_keys=True) + "\n")
    return [out_dir / MODEL_FILE, out_dir / DATA_FILE, out_dir / CONTRACT_FILE]


class _Builder:
    def __init__(self, g: _Graph, config: ModelConfig, tensors: dict, linears: dict, kv: dict):
        self.g, self.config, self.tensors, self.linears, self.kv = g, config, tensors, linears, kv
        self.rope: list[str] = []  # the step's (cos, signed sin) rows [N, 1, D], shared by every layer

    def cache_fields(self) -> dict:
        from onnx import TensorProto

        d, kv_dtype = self.config.head_dim, self.kv["dtype"]
        if kv_dtype == "int4":
            groups = d // self.kv["group_size"]
            return {"k": (TensorProto.UINT8, d // 2), "v": (TensorProto.UINT8, d // 2),
                    **{f: (TensorProto.FLOAT16, groups) for f in onnx_nodes.INT4_WRITTEN}}
        dtype = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16, "fp32": TensorProto.FLOAT,
                 "fp8": TensorProto.FLOAT8E4M3FN}[kv_dtype]
        return {"k": (dtype, d), "v": (dtype, d)}

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ArtifactError(f"artifact lacks tensor {name!r}; rebuild the artifact")
        return self.tensors[name]

    def step(self) -> None:
        g, c = self.g, self.config
        table = self.weight("model.embed_tokens.weight")
        x = g.op("Cast", [g.op("Gather", [table, "input_ids"])], to=_FLOAT)
        cos, sin = RotaryEmbedding(c).tables(torch.device("cpu"), torch.float32)  # [max_pos, 1, D]
        self.rope = [g.op("Gather", [g.const(name, t.numpy()), "positions"])
                     for name, t in (("rope.cos", cos), ("rope.signed_sin", sin))]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            x = g.op("Add", [x, self.attention(i, self.rms_norm(x, p + "input_layernorm.weight"))])
            x = g.op("Add", [x, self.mlp(p + "mlp.", self.rms_norm(x, p + "post_attention_layernorm.weight"))])
        h = g.op("Gather", [self.rms_norm(x, "model.norm.weight"), "logits_indices"], axis=0)  # the rows asked for
        if "lm_head" in self.linears or not c.tie_word_embeddings:
            self.linear("lm_head", h, outputs=["logits"])
        else:
            g.op("Gemm", [h, g.op("Cast", [table], to=_FLOAT)], outputs=["logits"], transB=1)

    def weight(self, name: str) -> str:
        """A high-precision tensor as an initializer in its stored dtype (bf16 weights, fp32 norms)."""
        return self.g.const(name, onnx_nodes.to_numpy(self.tensor(name)))

    def rms_norm(self, x: str, weight: str) -> str:
        g = self.g
        eps = g.const("rms_norm.eps", np.array(self.config.rms_norm_eps, dtype=np.float32))
        mean = g.op("ReduceMean", [g.op("Mul", [x, x]), self._axes_last()], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, eps])])])
        w = self.weight(weight)
        if self.tensors[weight].dtype != torch.float32:
            w = g.op("Cast", [w], to=_FLOAT)
        return g.op("Mul", [w, g.op("Mul", [x, inv])])

    def _axes_last(self) -> str:
        return self.g.const("axes.last", np.array([-1], dtype=np.int64))

    def _shape(self, *dims: int) -> str:
        return self.g.const("shape." + "x".join(str(d) for d in dims), np.array(dims, dtype=np.int64))

    def attention(self, i: int, h: str) -> str:
        g, c = self.g, self.config
        p = f"model.layers.{i}.self_attn."
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = g.op("Reshape", [self.linear(p + "q_proj", h), self._shape(-1, hq, d)])
        k = g.op("Reshape", [self.linear(p + "k_proj", h), self._shape(-1, hkv, d)])
        v = g.op("Reshape", [self.linear(p + "v_proj", h), self._shape(-1, hkv, d)])
        if c.qk_norm:
            q, k = self.rms_norm(q, p + "q_norm.weight"), self.rms_norm(k, p + "k_norm.weight")
        q, k = self.apply_rope(q), self.apply_rope(k)
        if p + "k_offset" in self.tensors:  # the cache stores key - offset (plugins/kv_cache.offset_key)
            k = g.op("Sub", [k, self.weight(p + "k_offset")])
        kv_dtype = self.kv["dtype"]
        params = self.cache_params(i)  # CACHE_PARAMS name -> graph value; absent ones are ""
        fields = onnx_nodes.written_fields(kv_dtype)
        written = [f"cache_out.{i}.{f}" for f in fields]
        g.op("CacheWrite", [k, v, f"cache.{i}.k", f"cache.{i}.v", *params.values(), "slot_mapping"],
             outputs=written, domain=onnx_nodes.DOMAIN, kv_dtype=kv_dtype,
             group_size=kv_group_size(self.kv) or 0, **onnx_nodes.plugin_attributes())
        after = params | dict(zip(fields, written))  # attention reads the caches as written
        out = g.op("PagedAttention", [q, after["k"], after["v"], *(after[n] for n in onnx_nodes.CACHE_PARAMS),
                                      "block_tables", "seq_lens", "query_start_loc"],
                   domain=onnx_nodes.DOMAIN, kv_dtype=kv_dtype, scale=float(d ** -0.5),
                   **onnx_nodes.plugin_attributes())
        return self.linear(p + "o_proj", g.op("Reshape", [out, self._shape(-1, hq * d)]))

    def cache_params(self, i: int) -> dict[str, str]:
        """The cache-write / attention parameters after k and v: int4 group scales and minimums are
        cache inputs, static scales are initializers (fp8 defaults to 1, as allocate_kv_cache)."""
        p, kv_dtype = f"model.layers.{i}.self_attn.", self.kv["dtype"]
        params = dict.fromkeys(onnx_nodes.CACHE_PARAMS, "")
        if kv_dtype == "int4":
            params |= {f: f"cache.{i}.{f}" for f in onnx_nodes.INT4_WRITTEN}
        if kv_dtype == "fp8":
            ones = torch.ones(self.config.num_key_value_heads)
            params |= {name: self.g.const(p + name, self.tensors.get(p + name, ones).float().numpy())
                       for name in ("k_scale", "v_scale")}
        if p + "k_channel_scale" in self.tensors:
            params["k_channel_scale"] = self.weight(p + "k_channel_scale")
        return params

    def apply_rope(self, x: str) -> str:
        """runtime/rope.apply_rope: x * cos + roll(x, D/2) * signed_sin, with roll as two slices."""
        g, half = self.g, self.config.head_dim // 2
        first = g.op("Slice", [x, self._shape(0), self._shape(half), self._axes_last()])
        second = g.op("Slice", [x, self._shape(half), self._shape(2 * half), self._axes_last()])
        rolled = g.op("Concat", [second, first], axis=-1)
        cos, sin = self.rope
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rolled, sin])])

    def mlp(self, p: str, h: str) -> str:
        g = self.g
        gate, up = self.linear(p + "gate_proj", h), self.linear(p + "up_proj", h)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # SiLU(gate) * up
        return self.linear(p + "down_proj", act)

    def linear(self, name: str, x: str, outputs: int | list[str] = 1) -> str:
        """Dense and int8 linears are Gemm(transB=1) on the stored [out, in] weight. int4 and fp8 ones
        are DequantizeLinear of the codes laid out [in, out] (blocks along in_features, axis 0) into
        MatMul: the weight-only pattern ONNX Runtime fuses into MatMulNBits, which reads the 4-bit
        codes packed (an int4 DequantizeLinear -> Gemm(transB=1) is not fused: it dequantized the
        whole weight every step, 44x as long for a 576 x 1536 linear), and the layout TensorRT Model
        Optimizer writes."""
        g = self.g
        bias = [] if name + ".bias" not in self.tensors else [self.float_weight(name + ".bias")]
        entry = self.linears.get(name)
        if entry is None:
            return g.op("Gemm", [x, self.float_weight(name + ".weight"), *bias], outputs=outputs, transB=1)
        fmt = entry.get("format")
        if fmt == "int4":
            weight = self.int4_weight(name, entry)
        elif fmt == "int8":  # [out, in] into Gemm, which ONNX Runtime does not fuse: its 8-bit MatMulNBits
            # at float accuracy took 8x as long as dequantize + Gemm (SmolLM2's lm_head, ORT 1.31)
            weight = g.op("DequantizeLinear", [g.const(name + ".qweight", self.tensor(name + ".qweight").numpy()),
                                               g.const(name + ".scales", self.tensor(name + ".scales").reshape(-1)
                                                       .float().numpy())], axis=0)
            return g.op("Gemm", [x, weight, *bias], outputs=outputs, transB=1)
        elif fmt == "fp8":
            weight = self.fp8_weight(name, entry)
            x = self.fp8_activation(x, name + ".input_scale" if entry.get("activations") == "static" else None)
        else:
            raise ArtifactError(f"linear {name} has format {fmt!r}, which the ONNX export does not know; "
                                "export with the qkiln version that built the artifact")
        if not bias:
            return g.op("MatMul", [x, weight], outputs=outputs)
        return g.op("Add", [g.op("MatMul", [x, weight]), *bias], outputs=outputs)

    def float_weight(self, name: str) -> str:
        w = self.weight(name)
        return w if self.tensors[name].dtype == torch.float32 else self.g.op("Cast", [w], to=_FLOAT)

    def int4_weight(self, name: str, entry: dict) -> str:
        """[in, out] INT4 codes (UINT4 with zero points) and [blocks, out] scales. A per-channel
        weight is written as blocks of the largest power of two (16..256) dividing in_features,
        each with its row's scale: the same numbers, in the block shape MatMulNBits takes."""
        import ml_dtypes

        in_features = entry["in_features"]
        codes = unpack_int4(self.tensor(name + ".qweight"))[:, :in_features].T  # [in, out] 0..15
        scales = self.tensor(name + ".scales").float().T  # [groups, out]
        zeros = self.tensors.get(name + ".zeros")
        zeros = None if zeros is None else zeros.T
        block = entry.get("group_size")
        if not block:
            block = next((b for b in (256, 128, 64, 32, 16) if in_features % b == 0), in_features)
            scales = scales.repeat(in_features // block, 1)
            zeros = None if zeros is None else zeros.repeat(in_features // block, 1)
        if zeros is None:  # stored +8: INT4 codes, no zero point
            inputs = [self.g.const(name + ".qweight", (codes.to(torch.int8) - 8).numpy().astype(ml_dtypes.int4)),
                      self.g.const(name + ".scales", scales.numpy())]
        else:
            if not torch.equal(zeros, zeros.round()) or zeros.min() < 0 or zeros.max() > 15:
                raise ArtifactError(f"linear {name} has zero points that are not integers in 0..15, which "
                                    "ONNX's DequantizeLinear cannot hold; rebuild with weights.zero_point: int")
            inputs = [self.g.const(name + ".qweight", codes.numpy().astype(ml_dtypes.uint4)),
                      self.g.const(name + ".scales", scales.numpy()),
                      self.g.const(name + ".zeros", zeros.to(torch.uint8).numpy().astype(ml_dtypes.uint4))]
        return self.g.op("DequantizeLinear", inputs, axis=0, block_size=block)

    def fp8_weight(self, name: str, entry: dict) -> str:
        """[in, out] e4m3 codes; per-channel scales along out (axis 1), group scales [groups, out]."""
        scales = self.tensor(name + ".weight_scale").float()  # [out, groups]
        q = self.g.const(name + ".weight", onnx_nodes.to_numpy(self.tensor(name + ".weight").T))
        if scales.shape[1] == 1:
            return self.g.op("DequantizeLinear", [q, self.g.const(name + ".weight_scale", scales.reshape(-1).numpy())],
                             axis=1)
        return self.g.op("DequantizeLinear", [q, self.g.const(name + ".weight_scale", scales.T.numpy())], axis=0,
                         block_size=entry.get("group_size") or entry["in_features"])

    def fp8_activation(self, x: str, static_scale: str | None) -> str:
        """fp8 activations as the artifact's simulation computes them: x / scale clipped to +-448,
        rounded to e4m3 and widened back (Gemm takes floats). The scale is the calibrated
        per-tensor one (static) or, per token, max(amax / 448, 1e-12) (dynamic)."""
        from onnx import TensorProto

        g = self.g
        top = g.const("fp8.max", np.array(FP8_MAX, dtype=np.float32))
        bottom = g.const("fp8.neg_max", np.array(-FP8_MAX, dtype=np.float32))
        if static_scale is not None:
            scale = g.const(static_scale, self.tensor(static_scale).float().reshape(()).numpy())
        else:
            floor = g.const("fp8.min_scale", np.array(_FP8_MIN_SCALE, dtype=np.float32))
            amax = g.op("ReduceMax", [g.op("Abs", [x]), self._axes_last()], keepdims=1)
            scale = g.op("Max", [g.op("Div", [amax, top]), floor])
        clipped = g.op("Clip", [g.op("Div", [x, scale]), bottom, top])
        q = g.op("Cast", [clipped], to=TensorProto.FLOAT8E4M3FN)
        return g.op("Mul", [g.op("Cast", [q], to=_FLOAT), scale])


def _qkiln_version() -> str:
    import importlib.metadata as md

    return md.version("qkiln")

