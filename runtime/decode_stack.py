"""The CPU decode fast path: all decoder layers of a decode-only step in one native call.

At batch 1 a CPU decode step of a small model is hundreds of small kernel calls, and through
Python modules and the dispatcher each costs more than many of the kernels themselves. For the
common serving configuration (every linear in a native quantized layout, q/k/v and gate/up
fused, KV caches the native attention serves (float, fp8, int4; a key offset allowed, no key
smoothing), bf16/fp16 activations) `NativeDecodeStack` hands the
whole layer loop to csrc/decode_stack.cpp, which calls the same kernels in the same order as
model.py's fused path, so the hidden states are bit-identical (tests/runtime compare them), in ONE
parallel region per step (the tiles of each linear split over the threads, barriers between
dependent phases) instead of a fork/join per kernel.

`build` says once, at engine start, whether a model qualifies (None otherwise, and the Python
path serves every step); `applies` says per step whether the step is decodes only. Up to SMALL_M
rows (cpu_linear.int4_gemv_rows for int4 weights with a dense copy) run the GEMV kernels; more run the Python
path's GEMM for them, each thread taking its share of the rows for the row-wise ops: with int8
activations loaded (opt-in) the int8-activation GEMM (csrc/cpu_gemm_w4a8.cpp; on a CPU without
AVX512-VNNI int4 weights have none and the GEMV form serves steps of any size), else (exact) the
bf16 GEMM on the dequantized weights (qkiln's panels, csrc/cpu_gemm_bf16.cpp). When this form was
measured against the Python layer loop (offline 64 x 128/128, same-process A/B, 5 rounds; the bf16
GEMM was oneDNN's then): decode step 74.2 -> 63.2 ms (537.9 -> 584.5 tok/s) with int8 activations,
103.5 -> 84.5 ms (422.2 -> 489.7 tok/s) exact. The step's embedding rows and RoPE rows are
copied natively from the model's tables (`inputs`; nn.Embedding and two index ops cost ~0.1 ms of
a batch-1 step, their code cold after the weights streamed through the caches). A
native lm_head joins the GEMV form's call (`logits`): its tiles split over the threads like the
layers', and for greedy steps each thread takes the argmax of the logits it wrote (read back by
one thread, half of them came from the other core's cache: ~0.1 ms of a ~7 ms batch-1 step).
QKILN_DECODE_STACK=0 turns the fast path off (A/B measurements).
"""

import torch

from qkiln.plugins import KVCache, cpu_native
from qkiln.plugins.cpu_attention import native_serves
from qkiln.plugins.cpu_linear import SMALL_M, int4_gemv_rows
from qkiln.plugins.env_switches import env_switch
from qkiln.plugins.packed_weights import W4A16Weight, W8A16Weight

from .model import CausalLM
from .paged_attention import AttentionMetadata
from .quantized_linear import QuantizedLinear

_DTYPES = (torch.bfloat16, torch.float16)


def _native_linear(module, ext):
    """The extension's NativeLinear for a linear in a native layout (with its int8-activation
    layout when the model was loaded with one), else None."""
    if not isinstance(module, QuantizedLinear):
        return None
    w, bias = module.packed, module.bias
    if isinstance(w, W4A16Weight) and w.target == "cpu" and cpu_native.is_native_w4a16(w.scales):
        linear = ext.NativeLinear(4, w.packed, w.scales, w.zeros, bias, w.group_size, w.in_features,
                                  w.out_features)
    elif isinstance(w, W8A16Weight) and w.target == "cpu" and w.scales.dtype == torch.float32:
        linear = ext.NativeLinear(8, w.weight, w.scales, None, bias, 0, *w.weight.shape[::-1])
    else:
        return None
    if isinstance(w, (W4A16Weight, W8A16Weight)) and w.int8_activations:
        linear.use_int8_activations()
    if w.int8_act is not None:
        a = w.int8_act
        linear.add_int8_activations(a.packed, a.scales, a.zero_scales, a.group_size)
    if w.dequantized is not None:
        linear.add_dense(w.dequantized)
    if isinstance(w, W4A16Weight) and w.amx_tables is not None:
        linear.add_amx_codes(w.amx_tables)
    if isinstance(w, W8A16Weight) and w.amx_codes:
        linear.add_amx_codes()
    return linear


def _stack_serves(cache: KVCache) -> bool:
    """A CPU cache the native attention reads (every other cache tensor is passed on)."""
    return cache.k.device.type == "cpu" and native_serves(cache.k, cache.k_channel_scale)


class NativeDecodeStack:
    def __init__(self, model: CausalLM, stack, head_rows: int = 0):
        # head_rows: the most rows `logits` serves (the head's GEMV limit; 0 without a head)
        self.model, self.stack, self.head_rows = model, stack, head_rows

    @classmethod
    def build(cls, model: CausalLM, caches: list[KVCache]) -> "NativeDecodeStack | None":
        """The stack for this model and its caches, or None when any part does not qualify."""
        if not env_switch("QKILN_DECODE_STACK", True):
            return None
        ext = cpu_native.native_ops()
        embed = model.model.embed_tokens.weight
        config = model.config
        if ext is None or embed.device.type != "cpu" or embed.dtype not in _DTYPES or \
                config.head_dim % 16 or len(caches) != config.num_hidden_layers:
            return None
        layers, weights = [], []
        for layer, cache in zip(model.model.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is None or mlp.gate_up_proj is None or attn.q_norm is not None or \
                    not _stack_serves(cache):
                return None
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            linears = [_native_linear(m, ext) for m in modules]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(lin is None for lin in linears) or any(n.dtype != embed.dtype for n in norms):
                return None
            weights += [m.packed for m in modules]  # QuantizedLinear's, now that all qualified
            layers.append(ext.StackLayer(*linears, *(n.detach() for n in norms), cache.k, cache.v,
                                         cache.k_scale, cache.v_scale, cache.k_group_scale,
                                         cache.k_group_min, cache.v_group_scale, cache.v_group_min,
                                         cache.k_offset))
        # The GEMV form's row limit is the Python path's (cpu_linear.py): lower for int4 weights
        # with a dense copy. One limit serves one model: a model mixing those with other linears
        # (no recipe makes one) keeps the Python path, which decides per linear.
        int4_dense = [isinstance(w, W4A16Weight) and w.many_rows_form for w in weights]
        if any(int4_dense) and not all(int4_dense):
            return None
        norm = model.model.norm
        max_gemv_rows = min(_gemv_rows(w) for w in weights)
        stack = ext.DecodeStack(layers, norm.weight.detach(), config.num_attention_heads,
                                config.num_key_value_heads, config.head_dim, norm.eps, max_gemv_rows)
        stack.set_inputs(embed.detach(), *model.rope.tables(embed.device, embed.dtype))
        head = _native_linear(model.lm_head, ext) if model.lm_head is not None else None
        # The head's own GEMV limit may be below the layers' (an int8 head, GEMV up to SMALL_M
        # rows, beside int4 layers that round activations at any row count): logits then serves
        # only that many.
        head_rows = min(_gemv_rows(model.lm_head.packed), max_gemv_rows) if head is not None else 0
        if head_rows >= min(max_gemv_rows, SMALL_M):
            stack.set_head(head)
        else:
            head_rows = 0
        return cls(model, stack, head_rows)

    def applies(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Decodes only (one row per sequence), few enough rows for the GEMV kernels or, for more,
        the layouts the Python path computes them with (int8 activations or dense weights), ops on."""
        return num_tokens == metadata.seq_lens.shape[0] and \
            (num_tokens <= self.stack.max_gemv_rows or self.stack.int8_activations or
             self.stack.dense_rows) and \
            cpu_native.native_ops() is not None

    def hidden_states(self, input_ids, positions, metadata: AttentionMetadata) -> torch.Tensor:
        """ids [N] -> [N, hidden] after the final norm, as CausalLM.hidden_states computes it."""
        x, cos, signed_sin = self.stack.inputs(input_ids, positions)  # [N, hidden], [N, 1, D] x 2
        return self.stack.forward(x, cos, signed_sin, metadata.slot_mapping, metadata.block_tables,
                                  metadata.seq_lens, metadata.query_start_loc)

    def serves_head(self, num_tokens: int) -> bool:
        """Whether `logits` serves a step of this many rows (which `applies` accepted)."""
        return self.stack.has_head and num_tokens <= self.head_rows

    def logits(self, input_ids, positions, metadata: AttentionMetadata,
               argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [N] -> (CausalLM.compute_logits of the hidden states [N, vocab], with `argmax` each
        row's ops.argmax [N], else None), the head in the same native call as the layers."""
        x, cos, signed_sin = self.stack.inputs(input_ids, positions)
        logits, token_ids = self.stack.logits(x, cos, signed_sin, metadata.slot_mapping,
                                              metadata.block_tables, metadata.seq_lens,
                                              metadata.query_start_loc, argmax)
        return logits, token_ids if argmax else None


# Any step: int4 weights rounding activations without the many-row panels (a CPU without
# AVX512-VNNI) take the int8-activation GEMV at every row count, in Python and here alike.
ALL_ROWS = 1 << 30


def _gemv_rows(weight) -> int:
    """The most rows the Python path (cpu_linear.py) computes this native weight with the GEMV."""
    if isinstance(weight, W4A16Weight) and weight.int8_activations and weight.int8_act is None:
        return ALL_ROWS
    if isinstance(weight, W4A16Weight) and weight.many_rows_form:
        return int4_gemv_rows(weight.dequantized, weight.amx_tables)
    return SMALL_M
