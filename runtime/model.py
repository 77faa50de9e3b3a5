"""The lean Llama-family model (Llama, SmolLM, Mistral, Qwen2 qkv bias, Qwen3 q/k norm).

Our own PyTorch definition, built from a `ModelConfig` and a state dict with Hugging Face
parameter names, without importing `transformers`. It is shape-agnostic over leading dims:
dense evaluation passes ids [B, T]; the paged runtime passes flattened ids [N]. Linear layers
come from a `linear_factory`, so quantized or simulated layers replace `nn.Linear` without
touching this file. Numerics follow HF's eager implementation (RMSNorm in fp32, RoPE tables
in fp32) so fp32 logits match within 1e-4 relative.

Serving may build q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` per layer (names in
`fused`, see fusion.py); evaluation and calibration use the separate HF projections. Decode runs
this file's Python once per layer per step, so forward paths avoid ops that are not needed: the
RoPE tables are gathered once per forward, q and k are rotated together when fused.

For bf16/fp16 activations on CPU or CUDA (fused_ops.use_fused_ops) a forward runs the layers'
`fused=True` path instead: vLLM-style residual stream (fused add + RMSNorm in place), RoPE in
place on the qkv output, fused SiLU-and-mul; same rounding as the torch path, fewer ops.
"""

from collections.abc import Callable

import torch
from torch import nn

from qkiln.errors import SourceModelError
from qkiln.plugins import ops

from .attention import DenseAttention
from .config import ModelConfig
from .fused_ops import use_fused_ops
from .rope import RotaryEmbedding, apply_rope

LinearFactory = Callable[[str, int, int, bool], nn.Module]


def default_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * x.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, make_linear: LinearFactory, fused=frozenset()):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        prefix = f"model.layers.{layer_id}.self_attn."
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if prefix + "qkv_proj" in fused:
            self.qkv_proj = make_linear(prefix + "qkv_proj", hidden, q_size + 2 * kv_size, bias)
        else:
            self.qkv_proj = None
            self.q_proj = make_linear(prefix + "q_proj", hidden, q_size, bias)
            self.k_proj = make_linear(prefix + "k_proj", hidden, kv_size, bias)
            self.v_proj = make_linear(prefix + "v_proj", hidden, kv_size, bias)
        self.o_proj = make_linear(prefix + "o_proj", q_size, hidden, False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos_sin, backend, fused: bool = False) -> torch.Tensor:
        lead, hq, hkv = x.shape[:-1], self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(*lead, hq + 2 * hkv, self.head_dim)
            q, k, v = qkv[..., :hq, :], qkv[..., hq:hq + hkv, :], qkv[..., hq + hkv:, :]
        else:
            q = self.q_proj(x).view(*lead, hq, self.head_dim)
            k = self.k_proj(x).view(*lead, hkv, self.head_dim)
            v = self.v_proj(x).view(*lead, hkv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused and self.qkv_proj is not None and self.q_norm is None:
            ops.rotary_embedding(qkv, *cos_sin, hq + hkv)  # in place: q and k heads in one call
        elif fused:
            ops.rotary_embedding(q, *cos_sin, hq)
            ops.rotary_embedding(k, *cos_sin, hkv)
        elif self.qkv_proj is not None and self.q_norm is None:
            qk = apply_rope(qkv[..., :hq + hkv, :], cos_sin)  # q and k heads in one pass
            q, k = qk[..., :hq, :], qk[..., hq:, :]
        else:
            q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        out = backend.attend(self.layer_id, q, k, v)  # [..., Hq, D]
        return self.o_proj(out.reshape(*lead, hq * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, make_linear: LinearFactory, fused=frozenset()):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        prefix = f"model.layers.{layer_id}.mlp."
        if prefix + "gate_up_proj" in fused:
            self.gate_up_proj = make_linear(prefix + "gate_up_proj", hidden, 2 * inter, False)
        else:
            self.gate_up_proj = None
            self.gate_proj = make_linear(prefix + "gate_proj", hidden, inter, False)
            self.up_proj = make_linear(prefix + "up_proj", hidden, inter, False)
        self.down_proj = make_linear(prefix + "down_proj", inter, hidden, False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused and self.gate_up_proj is not None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, make_linear: LinearFactory, fused=frozenset()):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, make_linear, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_id, make_linear, fused)

    def forward(self, x, cos_sin, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h, residual, cos_sin, backend):
        """vLLM-style: (h, residual) -> (h, residual), where the torch path's x is h + residual
        (rounded); residual None: h is the embedding. Mutates its inputs."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = h, ops.rms_norm(h, norm.weight, norm.eps)
        else:
            ops.fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn(h, cos_sin, backend, fused=True)
        norm = self.post_attention_layernorm
        ops.fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, fused=True), residual


class Backbone(nn.Module):
    """`model.*` in HF naming: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, make_linear: LinearFactory, fused=frozenset(), init_weights: bool = True):
        super().__init__()
        # Where the weights are loaded next (build_model) skip nn.Embedding's normal_ init: on the
        # meta device its arithmetic imports torch._dynamo (~2 s of every model load); on a real one
        # (an artifact's quantized linears hold real tensors) it drew from the caller's global RNG
        # and filled a tensor that was thrown away (0.7 s and 113 MB for SmolLM2)
        skip_init = not init_weights or torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size, device="meta") if skip_init else None)
        self.layers = nn.ModuleList(DecoderLayer(config, i, make_linear, fused)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, make_linear: LinearFactory = default_linear, fused=frozenset(),
                 init_weights: bool = True):
        """init_weights False: the embedding is left unmade (meta) for weights assigned next."""
        super().__init__()
        self.config = config
        self.model = Backbone(config, make_linear, fused, init_weights)
        self.rope = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = make_linear("lm_head", config.hidden_size, config.vocab_size, False)

    def hidden_states(self, input_ids, positions, backend) -> torch.Tensor:
        """[...] ids -> [..., hidden] after the final norm."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)  # shared by every layer
        if use_fused_ops(x):
            residual, norm = None, self.model.norm
            for layer in self.model.layers:
                x, residual = layer.forward_fused(x, residual, cos_sin, backend)
            ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
            return x
        for layer in self.model.layers:
            x = layer(x, cos_sin, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # the cast is a no-op but where the build holds bf16 (compile/upcast.py)
            return hidden @ self.model.embed_tokens.weight.t().to(hidden.dtype)
        return self.lm_head(hidden)

    def forward(self, input_ids, positions=None, backend=None) -> torch.Tensor:
        """Dense convenience path: ids [B, T] -> logits [B, T, vocab]."""
        return self.compute_logits(self.dense_hidden_states(input_ids, positions, backend))

    def dense_hidden_states(self, input_ids, positions=None, backend=None) -> torch.Tensor:
        """ids [B, T] -> [B, T, hidden] after the final norm, on dense attention by default: the
        forward pass without its logits, which a scorer computes a slice at a time."""
        if positions is None:
            if input_ids.shape[-1] > self.config.max_position_embeddings:  # RoPE's table ends there: an IndexError
                raise SourceModelError(f"{input_ids.shape[-1]} tokens exceed the model's context of "
                                       f"{self.config.max_position_embeddings}; score shorter windows")
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
            if input_ids.shape[-1] > self.rope.max_positions:  # an engine fitted the tables to fewer
                self.rope.fit(self.config.max_position_embeddings)  # once, not per length: tables are kept
        return self.hidden_states(input_ids, positions, backend or DenseAttention())
