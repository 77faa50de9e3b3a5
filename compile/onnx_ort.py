"""An artifact's ONNX engine under ONNX Runtime: what a production runtime computes from the file.

ONNX Runtime has no kernel for the `qkiln` plugin nodes (a custom-op library needs its C headers,
which PyPI's wheel does not carry), so the graph is cut at each plugin node: the standard nodes
between two plugin nodes run as one ONNX Runtime session, with the initializers they read, and
each plugin node runs as qkiln's registered op (plugins/ops.py, the kernels the runtime serves
with) on the paged caches in place, which is the binding engine.json asks of a runtime.

ONNX Runtime fuses the engine's int4 DequantizeLinear -> MatMul into MatMulNBits. At its default
accuracy level (4) MatMulNBits quantizes activations to int8 on the fly; `accuracy_level=0` keeps
them float, which computes what the graph says. The level is a deployment choice, so evaluation
takes it as a parameter (`qkiln eval --engine onnxruntime --ort-accuracy-level N`).
"""

from pathlib import Path

import numpy as np
import torch

from qkiln.errors import ArtifactError
from qkiln.plugins import onnx_nodes
from qkiln.plugins.kv_cache import KVCache

from .onnx_contract import read_engine_model
from .onnx_graph import step_inputs

ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits' accuracy_level: 0 float activations .. 4 int8


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise ArtifactError("running an engine under ONNX Runtime needs onnxruntime: "
                            "pip install 'qkiln[onnx]' (in qkiln's checkout: pip install -e '.[onnx]')") from None
    return onnxruntime


class OrtEngine:
    """An engine directory stepping over paged caches it writes in place (KVCache objects)."""

    def __init__(self, engine_dir: Path, caches: list[KVCache], accuracy_level: int = 0, threads: int | None = None,
                 optimized_dir: Path | None = None):
        """optimized_dir: where ONNX Runtime writes each segment as it optimized it (fused_op_counts)."""
        from onnx import helper

        if accuracy_level not in ACCURACY_LEVELS:
            raise ArtifactError(f"ONNX Runtime accuracy level {accuracy_level} is not one of {ACCURACY_LEVELS}")
        self.ort = require_onnxruntime()
        self.accuracy_level, self.threads = accuracy_level, threads or torch.get_num_threads()
        self.optimized_dir = optimized_dir
        model = read_engine_model(engine_dir)
        self.ir_version = model.ir_version
        self.opsets = [helper.make_opsetid("", o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")]
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.segments: list[list] = [[]]  # runs of standard nodes, split by plugin nodes
        self.plugins = []
        for node in model.graph.node:
            if node.domain == onnx_nodes.DOMAIN:
                self.plugins.append(node)
                self.segments.append([])
            else:
                self.segments[-1].append(node)
        # what each segment hands on: values read by later nodes or returned as logits
        self.needed: list[list[str]] = []
        later = {"logits"}
        for i in reversed(range(len(self.segments))):
            if i < len(self.plugins):
                later |= set(self.plugins[i].input)
            self.needed.insert(0, [o for n in self.segments[i] for o in n.output if o in later])
            later |= {x for n in self.segments[i] for x in n.input}
        self.sessions: dict[int, object] = {}  # built at first use, when input dtypes are known
        self.constants: dict[str, torch.Tensor] = {}  # plugin inputs that are initializers (static scales)
        self.use(caches)

    def use(self, caches: list[KVCache]) -> None:
        """Step over these caches from now on (sessions are built once)."""
        self.caches = caches

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """INPUTS as torch tensors (step_inputs) -> logits [rows, vocab] float32; the caches are written."""
        by_name = step_inputs(*inputs)  # the same tensor objects for every layer's kernels
        values: dict[str, np.ndarray] = {n: t.numpy() for n, t in by_name.items()}
        for i, segment in enumerate(self.segments):
            if segment:
                self._standard(i, values)
            if i < len(self.plugins):
                self._plugin(self.plugins[i], values, by_name)
        return torch.from_numpy(values["logits"])

    def fused_op_counts(self) -> dict[str, int]:
        """op type -> count in the graphs ONNX Runtime optimized the segments into (after a step)."""
        import onnx

        if self.optimized_dir is None:
            raise ValueError("fused_op_counts reads the optimized segments: build the engine with optimized_dir=")
        counts: dict[str, int] = {}
        for path in sorted(Path(self.optimized_dir).glob("segment_*.onnx")):
            for node in onnx.load(str(path), load_external_data=False).graph.node:
                counts[node.op_type] = counts.get(node.op_type, 0) + 1
        return counts

    def _session(self, index: int, inputs: list[str], values: dict):
        import onnx
        from onnx import helper

        nodes = self.segments[index]
        used = {i for n in nodes for i in n.input}
        graph = helper.make_graph(
            nodes, f"segment_{index}",
            [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(values[i].dtype), None) for i in inputs],
            [], [t for name, t in self.initializers.items() if name in used])
        sub = helper.make_model(graph, ir_version=self.ir_version, opset_imports=self.opsets)
        types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(sub).graph.value_info}
        sub.graph.output.extend(helper.make_tensor_value_info(o, types[o], None) for o in self.needed[index])
        options = self.ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        # ONNX Runtime's threads spin after each run by default, on the cores qkiln's plugin kernels
        # run on next: with spinning, a SmolLM2 decode step took 754 ms instead of 40 (attention 580 vs 2)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(self.accuracy_level))
        if self.optimized_dir is not None:
            options.optimized_model_filepath = str(Path(self.optimized_dir) / f"segment_{index}.onnx")
            options.log_severity_level = 3  # its warning that the saved graph is host-specific, once per segment
        return self.ort.InferenceSession(sub.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def _standard(self, index: int, values: dict) -> None:
        nodes = self.segments[index]
        produced = {o for n in nodes for o in n.output}
        inputs = sorted({i for n in nodes for i in n.input if i and i not in self.initializers and i not in produced})
        if index not in self.sessions:
            self.sessions[index] = self._session(index, inputs, values)
        results = self.sessions[index].run(self.needed[index], {i: values[i] for i in inputs})
        values.update(zip(self.needed[index], results))

    def _plugin_input(self, name: str, values: dict, feeds: dict) -> torch.Tensor | None:
        if not name:
            return None
        if name.startswith(("cache.", "cache_out.")):  # the caches, written in place
            _, layer, field = name.split(".")
            return getattr(self.caches[int(layer)], field)
        if name in feeds:
            return feeds[name]
        if name in self.initializers:
            if name not in self.constants:
                from onnx import numpy_helper

                self.constants[name] = onnx_nodes.to_torch(numpy_helper.to_array(self.initializers[name]))
            return self.constants[name]
        return torch.from_numpy(values[name])

    def _plugin(self, node, values: dict, feeds: dict) -> None:
        args = [self._plugin_input(name, values, feeds) for name in node.input]
        if node.op_type == "CacheWrite":
            torch.ops.qkiln.cache_write(*args)
        elif node.op_type == "PagedAttention":
            scale = next(a.f for a in node.attribute if a.name == "scale")
            values[node.output[0]] = torch.ops.qkiln.paged_attention(*args, scale).numpy()
        else:
            raise ArtifactError(f"plugin node {node.op_type} is not one qkiln knows; re-export the engine")
