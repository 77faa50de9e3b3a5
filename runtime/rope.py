"""Rotary position embeddings (Su et al. 2021) with the config's theta and scaling.

Supports the scaling types the Llama family ships: none/default, `linear` (position
interpolation) and `llama3` (frequency-dependent, Llama 3.1+). Anything else is refused at
load time rather than silently computed wrong. Layout is the "rotate half" convention of
Hugging Face checkpoints (GGUF's interleaved Q/K rows are un-permuted by the loader).
"""

import math

import torch

from qkiln.errors import UnsupportedArchitectureError

from .config import ModelConfig


def base_inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    # on the CPU even inside `torch.device("meta")` (model construction): real values, and no meta
    # arithmetic, which imports torch._dynamo (~2 s of every model load)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    inv_freq = base_inverse_frequencies(config.rope_theta, config.head_dim)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return llama3_frequencies(inv_freq, scaling)
    if kind == "freq_factors":  # a GGUF's rope_freqs divisors that no llama3 parameter set reproduces
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    raise UnsupportedArchitectureError(
        f"rope scaling {kind!r} is not supported (supported: default, linear, llama3); qkiln cannot serve this "
        "model's positions correctly"
    )


def llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Caches cos/sin for positions 0 .. max_positions - 1 (computed in fp32): the model's context,
    or what an engine asked for with fit()."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)
        self.context = config.max_position_embeddings
        self.max_positions = self.context
        self._fitted = False
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list[tuple[torch.Tensor, ...]] = []

    def fit(self, num_positions: int) -> None:
        """Cover positions up to num_positions (an engine's max_model_len) rather than the whole
        context: tables of a 1M-token context are 1.6 GB (fp32 and bf16) at head_dim 128, for a
        server limited to 8k. Engines sharing a model get the largest; tables they were handed stay
        alive (a decode stack or a CUDA graph holds their addresses)."""
        num_positions = min(num_positions, self.context)
        if self._fitted and num_positions <= self.max_positions:
            return
        if self._cos_sin is not None and num_positions <= self.max_positions:
            self._fitted = True  # already built for more (a forward ran before any engine)
            return
        if self._cos_sin is not None:
            self._retired += [self._cos_sin, *self._by_dtype.values()]
        self.max_positions, self._fitted = num_positions, True
        self._cos_sin, self._by_dtype = None, {}

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [max_pos, 1, D] in `dtype`: computed in fp32, rounded once."""
        if self._cos_sin is None or self._cos_sin[0].device != device:
            t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))  # [max_pos, head_dim/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
            half = emb.shape[-1] // 2
            sin = emb.sin()
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._cos_sin = (emb.cos().unsqueeze(1), signed_sin.unsqueeze(1))  # fp32 [max_pos, 1, D]
            self._by_dtype = {}
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = tuple(t.to(dtype) for t in self._cos_sin)
        return self._by_dtype[dtype]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, signed sin) [..., 1, D] in `dtype`; computed once per forward.

        The sin's first half is negated, so rotate_half(x) * sin == x.roll(D/2) * signed_sin:
        one roll instead of slice, negate and concatenate (this runs for every layer). Both are
        rows of tables kept in `dtype` (negating and rounding commute, so this equals rounding
        per step; the per-step version cost ~0.1 ms of a ~6 ms CPU decode step).
        """
        cos, signed_sin = self.tables(positions.device, dtype)
        return cos[positions], signed_sin[positions]

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q: [..., Hq, D], k: [..., Hkv, D], positions: [...] -> rotated (q, k) in input dtype."""
        cos_sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos_sin), apply_rope(k, cos_sin)


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [..., H, D] (any heads, e.g. q and k side by side) -> x rotated (rotate-half layout)."""
    cos, signed_sin = cos_sin
    # Not addcmul: rounding the two products separately, like HF's eager code, keeps bf16 results
    # identical to the reference (one fused rounding flipped SmolLM2's greedy first token).
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
