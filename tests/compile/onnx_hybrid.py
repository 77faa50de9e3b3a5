"""Run a qkiln ONNX engine with ONNX Runtime for every standard node and onnx's reference evaluator
(plugins/onnx_nodes.reference_ops) for the plugin nodes, which ONNX Runtime has no kernel for.

The graph is cut at each plugin node: the standard nodes between two plugin nodes become one ONNX
Runtime session (with the initializers they read), so ONNX Runtime must accept every standard node
the export writes (block-wise INT4 / UINT4 DequantizeLinear, FP8 casts, the IR version) and compute
it as the specification says. For tests; a deployment registers real kernels for the plugins.

ONNX Runtime fuses DequantizeLinear -> MatMul of 4-bit weights into MatMulNBits, which by default
(accuracy level 4) quantizes activations to int8 on the fly; the sessions here ask for level 0,
float activations, so they compute what the graph says. `fused_op_counts` tells what ONNX Runtime
made of the standard nodes."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnx.reference import ReferenceEvaluator

from qkiln.plugins import onnx_nodes


def _value_info(name: str, value: np.ndarray):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), None)


class HybridSession:
    def __init__(self, model: onnx.ModelProto, optimized_dir=None):
        self.model, self.optimized_dir = model, optimized_dir
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.segments: list[list] = [[]]  # runs of standard nodes, split by plugin nodes
        self.plugins: list = []
        for node in model.graph.node:
            if node.domain == onnx_nodes.DOMAIN:
                self.plugins.append(node)
                self.segments.append([])
            else:
                self.segments[-1].append(node)
        self._sessions: dict[int, ort.InferenceSession] = {}
        self.opsets = [helper.make_opsetid("", o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")]
        # what each segment must hand on: values read by later nodes or returned by the graph
        self.needed: list[list[str]] = []
        later = {o.name for o in model.graph.output}
        for i in reversed(range(len(self.segments))):
            if i < len(self.plugins):
                later |= set(self.plugins[i].input)
            self.needed.insert(0, [o for n in self.segments[i] for o in n.output if o in later])
            later |= {x for n in self.segments[i] for x in n.input}

    def _standard(self, index: int, values: dict) -> None:
        nodes = self.segments[index]
        if not nodes:
            return
        produced, needed = {o for n in nodes for o in n.output}, self.needed[index]
        inputs = sorted({i for n in nodes for i in n.input if i and i not in self.initializers and i not in produced})
        if index not in self._sessions:
            used = {i for n in nodes for i in n.input}
            graph = helper.make_graph(nodes, f"segment_{index}", [_value_info(i, values[i]) for i in inputs], [],
                                      [t for name, t in self.initializers.items() if name in used])
            sub = helper.make_model(graph, ir_version=self.model.ir_version, opset_imports=self.opsets)
            types = {v.name: v.type.tensor_type.elem_type
                     for v in onnx.shape_inference.infer_shapes(sub).graph.value_info}
            sub.graph.output.extend(helper.make_tensor_value_info(o, types[o], None) for o in needed)
            options = ort.SessionOptions()
            options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
            if self.optimized_dir is not None:
                options.optimized_model_filepath = str(self.optimized_dir / f"segment_{index}.onnx")
            self._sessions[index] = ort.InferenceSession(sub.SerializeToString(), options,
                                                         providers=["CPUExecutionProvider"])
        results = self._sessions[index].run(needed, {i: values[i] for i in inputs})
        values.update(zip(needed, results))

    def _plugin(self, node, values: dict) -> None:
        feeds = {i: values[i] if i in values else onnx.numpy_helper.to_array(self.initializers[i])
                 for i in node.input if i}
        graph = helper.make_graph([node], node.name, [_value_info(i, v) for i, v in feeds.items()],
                                  [helper.make_tensor_value_info(o, 0, None) for o in node.output])
        one = helper.make_model(graph, ir_version=self.model.ir_version,
                                opset_imports=self.opsets + [helper.make_opsetid(onnx_nodes.DOMAIN, 1)])
        results = ReferenceEvaluator(one, new_ops=onnx_nodes.reference_ops()).run(None, feeds)
        values.update(zip(node.output, results))

    def fused_op_counts(self) -> dict[str, int]:
        """op type -> count over the segments ONNX Runtime optimized (needs optimized_dir and a run)."""
        counts: dict[str, int] = {}
        for path in sorted(self.optimized_dir.glob("segment_*.onnx")):
            for node in onnx.load(str(path), load_external_data=False).graph.node:
                counts[node.op_type] = counts.get(node.op_type, 0) + 1
        return counts

    def run(self, output_names: list[str], feeds: dict) -> list[np.ndarray]:
        values = dict(feeds)
        for i, segment in enumerate(self.segments):
            self._standard(i, values)
            if i < len(self.plugins):
                self._plugin(self.plugins[i], values)
        return [values[name] for name in output_names]
