"""Round-to-nearest integer weight quantization and the integer grid every algorithm shares.

Owns `QuantizedWeight` (codes + fp32 scales/zeros) and the grid math: per-group
parameters from a min/max, codes from parameters, and dequantization. GPTQ and AWQ call these
functions so that one dequantization and one packing serve every algorithm. Pure torch, no I/O.

Grid (matches compressed-tensors / GPTQ layouts; `quant/scheme.py` has the rationale):

    w_hat = (q - zero) * scale            per element, fp32
    symmetric:  q in [-2^(b-1), 2^(b-1)-1] (int8 codes), zero = 0, scale = amax / ((qmax-qmin)/2)
    asymmetric: q in [0, 2^b - 1]         (uint8 codes), scale = (max - min) / (qmax - qmin)
                zero_point "int":   zero = clamp(round(-min/scale)), range widened to include 0
                zero_point "float": zero = -min/scale exactly (w_hat = q*scale + min)

Groups run along in_features; the last group is shorter when group_size does not divide it:

    in_features = 576, group_size = 128
    | g0: 0..127 | g1: 128..255 | g2: 256..383 | g3: 384..511 | g4: 512..575 (64 wide) |

Observers: "minmax" takes each group's [min, max]; "mse" shrinks it over a grid and keeps the
factor with the least weight error (llm-compressor's MSE observer), clipping a few outliers.

Invariant: with "minmax" every element's dequantization error is at most scale/2 of its group
(nothing is clipped); with "mse" that holds for the elements inside the shrunk range.
"""

from __future__ import annotations

import math

import torch

from qkiln.quant.pack import pack_int4, unpack_int4
from qkiln.quant.scheme import WeightScheme

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class QuantizedWeight:
    """An integer-quantized linear weight. Row = output channel, column = input channel.

    Built from unpacked codes [out, in] (int8 when symmetric, uint8 when asymmetric), and `qweight`
    gives them back so; 4-bit codes are held two a byte in between (`packed_int4`): a build holds
    every layer's codes until the artifact is written, a byte a parameter unpacked.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int | None, num_bits: int, g_idx: torch.Tensor | None = None):
        codes = qweight if num_bits != 4 else _pack_codes(qweight)
        self._hold(codes, qweight.shape, qweight.dtype, scales, zeros, group_size, num_bits, g_idx)

    @classmethod
    def from_packed_int4(cls, packed: torch.Tensor, in_features: int, scales: torch.Tensor,
                         zeros: torch.Tensor | None, group_size: int | None) -> "QuantizedWeight":
        """From codes as `packed_int4` holds them (an artifact's), without unpacking them."""
        if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != (in_features + 1) // 2:
            raise ValueError(f"packed int4 codes are uint8 [out, {(in_features + 1) // 2}], got "
                             f"{packed.dtype} {list(packed.shape)}")
        weight = cls.__new__(cls)
        weight._hold(packed, torch.Size([packed.shape[0], in_features]), torch.int8 if zeros is None else torch.uint8,
                     scales, zeros, group_size, 4, None)
        return weight

    def _hold(self, codes, shape, code_dtype, scales, zeros, group_size, num_bits, g_idx) -> None:
        self._codes = codes  # 4 bits: packed_int4's layout; 8 bits: as given
        self.shape = shape  # [out, in]
        self.code_dtype = code_dtype  # of the unpacked codes: int8 symmetric, uint8 asymmetric
        self.scales = scales  # [out, num_groups] fp32
        self.zeros = zeros  # [out, num_groups] fp32 (integral when zero_point="int"); None if symmetric
        self.group_size = group_size  # None: one group per row
        self.num_bits = num_bits
        self.g_idx = g_idx  # [in] group of each column, only for foreign act-order layouts

    @property
    def qweight(self) -> torch.Tensor:
        """[out, in] codes, int8 (symmetric) or uint8 (asymmetric); 4-bit ones unpacked anew per call."""
        if self.num_bits != 4:
            return self._codes
        codes = unpack_int4(self._codes)[:, :self.shape[1]]  # uint8 0..15
        return (codes.to(torch.int16) - 8).to(torch.int8) if self.code_dtype == torch.int8 else codes

    @property
    def packed_int4(self) -> torch.Tensor:
        """4-bit codes as the artifact stores them: uint8 [out, ceil(in/2)], two a byte, low nibble
        first, symmetric ones offset by 8 (0..15), an odd last column padded with code 0."""
        if self.num_bits != 4:
            raise ValueError(f"packed_int4 holds 4-bit codes; these are {self.num_bits}-bit")
        return self._codes

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in] weight the codes stand for."""
        in_features = self.shape[1]
        scale = expand_groups(self.scales, self.group_size, in_features, self.g_idx)
        zero = None if self.zeros is None else expand_groups(self.zeros, self.group_size, in_features, self.g_idx)
        return dequantize_codes(self.qweight, scale, zero)

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={tuple(self.shape)}, num_bits={self.num_bits}, group_size={self.group_size}, "
                f"symmetric={self.zeros is None})")


def _pack_codes(q: torch.Tensor) -> torch.Tensor:
    codes = q.to(torch.int16) + (8 if q.dtype == torch.int8 else 0)  # 0..15 either way
    if q.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return pack_int4(codes.to(torch.uint8))


def qrange(num_bits: int, symmetric: bool) -> tuple[int, int]:
    if symmetric:
        return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    return 0, (1 << num_bits) - 1


def num_groups(in_features: int, group_size: int | None) -> int:
    return 1 if group_size is None else math.ceil(in_features / group_size)


def group_ranges(in_features: int, group_size: int | None) -> list[tuple[int, int]]:
    """[start, end) column range of every group; the last one may be shorter."""
    size = in_features if group_size is None else group_size
    return [(start, min(start + size, in_features)) for start in range(0, in_features, size)]


def expand_groups(params: torch.Tensor, group_size: int | None, in_features: int,
                  g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """[out, num_groups] per-group values -> [out, in] per-column values."""
    if g_idx is not None:
        return params[:, g_idx.long()]
    if group_size is None:
        return params[:, :1].expand(-1, in_features)
    return params.repeat_interleave(group_size, dim=1)[:, :in_features]


def group_minmax(W: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of W [out, in] -> two [out, num_groups] tensors."""
    out_features, in_features = W.shape
    size = in_features if group_size is None else group_size
    num = num_groups(in_features, group_size)
    pad = num * size - in_features
    if pad:
        # replicate the last column: it already belongs to the last group, so min/max are unchanged
        W = torch.cat([W, W[:, -1:].expand(-1, pad)], dim=1)
    grouped = W.reshape(out_features, num, size)  # [out, num_groups, group_size]
    return tuple(torch.aminmax(grouped, dim=2))  # one pass over W


def round_up_to(t: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Round fp32 values up to ones representable in `scale_dtype`, returned as fp32.

    Scales round up, not to nearest: a smaller scale would leave a group's extremes off the grid.
    """
    return _round_toward(t, scale_dtype, math.inf)


def round_down_to(t: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Round fp32 values down to ones representable in `scale_dtype`, returned as fp32."""
    return _round_toward(t, scale_dtype, -math.inf)


def _round_toward(t: torch.Tensor, scale_dtype: str, direction: float) -> torch.Tensor:
    dtype = _TORCH_DTYPES[scale_dtype]
    if dtype == torch.float32:
        return t
    rounded = t.to(dtype)
    wrong_side = rounded.float() < t if direction > 0 else rounded.float() > t
    stepped = torch.nextafter(rounded, torch.full_like(rounded, direction))
    return torch.where(wrong_side, stepped, rounded).float()


def qparams_from_minmax(wmin: torch.Tensor, wmax: torch.Tensor, scheme: WeightScheme
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero (None when symmetric) for groups with the given min / max."""
    qmin, qmax = qrange(scheme.num_bits, scheme.symmetric)
    eps = torch.finfo(torch.float32).eps
    wmin, wmax = wmin.float(), wmax.float()
    if scheme.symmetric:
        amax = torch.maximum(wmin.abs(), wmax.abs())
        scale = round_up_to((amax / ((qmax - qmin) / 2)).clamp(min=eps), scheme.scale_dtype)
        return scale, None
    if scheme.zero_point == "int":
        wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    scale = (wmax - wmin) / (qmax - qmin)
    # a constant group has no range: use its magnitude so the constant lands on the grid exactly
    constant = torch.maximum(wmin.abs(), wmax.abs()) / (qmax - qmin)
    scale = torch.where(scale > 0, scale, constant).clamp(min=eps)
    scale = round_up_to(scale, scheme.scale_dtype)
    zero = qmin - wmin / scale
    if scheme.zero_point == "int":
        zero = zero.round().clamp(qmin, qmax)
    return scale, zero


# MSE observer grid (llm-compressor's defaults): shrink factors 1, 0.99, ..., 0.81; error |w - w_hat|^2.4
_MSE_GRID, _MSE_MAX_SHRINK, _MSE_NORM = 100, 0.2, 2.4


def compute_qparams(W: torch.Tensor, scheme: WeightScheme, group_size: int | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group scale and zero [out, num_groups] for W [out, in] with the scheme's observer.

    `group_size` is given, not read from the scheme: None is one group per row (GPTQ passes it for
    the one group it is looking at).
    "mse" shrinks each group's [min, max] over a grid and keeps the factor with the least
    sum |w - w_hat|^2.4 over the group (a clipping search on the weights alone).
    """
    W = W.float()
    wmin, wmax = group_minmax(W, group_size)
    scales, zeros = qparams_from_minmax(wmin, wmax, scheme)
    if scheme.observer == "minmax":
        return scales, zeros
    qmin, qmax = qrange(scheme.num_bits, scheme.symmetric)
    best_err = None
    for i in range(int(_MSE_MAX_SHRINK * _MSE_GRID) + 1):
        shrink = 1.0 - i / _MSE_GRID
        s, z = qparams_from_minmax(wmin * shrink, wmax * shrink, scheme)
        s_full = expand_groups(s, group_size, W.shape[1])
        z_full = None if z is None else expand_groups(z, group_size, W.shape[1])
        err = (dequantize_codes(quantize_codes(W, s_full, z_full, qmin, qmax), s_full, z_full) - W).abs()
        err = group_sums(err.pow(_MSE_NORM), group_size)  # [out, num_groups]
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        scales = torch.where(better, s, scales)
        if zeros is not None:
            zeros = torch.where(better, z, zeros)
    return scales, zeros


def group_sums(values: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Sum of values [out, in] over each group -> [out, num_groups] (partial last group included)."""
    out_features, in_features = values.shape
    size = in_features if group_size is None else group_size
    num = num_groups(in_features, group_size)
    padded = torch.nn.functional.pad(values, (0, num * size - in_features))  # zeros add nothing
    return padded.reshape(out_features, num, size).sum(dim=2)


def quantize_codes(W: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   qmin: int, qmax: int) -> torch.Tensor:
    """Codes (still fp32) for W given per-element (or broadcastable) scale and zero."""
    scaled = W / scale if zero is None else W / scale + zero
    return scaled.round().clamp(qmin, qmax)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    q = q.float()
    return q * scale if zero is None else (q - zero) * scale


def code_dtype(symmetric: bool) -> torch.dtype:
    return torch.int8 if symmetric else torch.uint8


def quantize_with_qparams(W: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                          scheme: WeightScheme) -> QuantizedWeight:
    """Codes for W [out, in] on a given grid (per-group scales / zeros [out, num_groups])."""
    W = W.float()
    in_features = W.shape[1]
    qmin, qmax = qrange(scheme.num_bits, scheme.symmetric)
    scale = expand_groups(scales, scheme.group_size, in_features)
    zero = None if zeros is None else expand_groups(zeros, scheme.group_size, in_features)
    q = quantize_codes(W, scale, zero, qmin, qmax).to(code_dtype(scheme.symmetric))  # [out, in]
    return QuantizedWeight(q, scales, zeros, scheme.group_size, scheme.num_bits)


# Rows are quantized independently, so a block of them at a time: the observers' fp32 temporaries
# over a whole [vocab, hidden] head (an 836M-parameter model's: ~0.9 GB) were a build's peak.
RTN_BLOCK_ROWS = 4096


def quantize_rtn(W: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    """Round-to-nearest: group parameters from the scheme's observer, then nearest codes."""
    if scheme.type != "int":
        raise ValueError("quantize_rtn handles integer schemes; use quant.fp8 for float weights")
    blocks = [_quantize_rows(W[start:start + RTN_BLOCK_ROWS].float(), scheme)
              for start in range(0, max(W.shape[0], 1), RTN_BLOCK_ROWS)]  # one block of none
    if len(blocks) == 1:
        return blocks[0]
    zeros = None if blocks[0].zeros is None else torch.cat([b.zeros for b in blocks])
    return QuantizedWeight(torch.cat([b.qweight for b in blocks]), torch.cat([b.scales for b in blocks]), zeros,
                           scheme.group_size, scheme.num_bits)


def _quantize_rows(W: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    scales, zeros = compute_qparams(W, scheme, scheme.group_size)
    return quantize_with_qparams(W, scales, zeros, scheme)


def fake_quantize_rtn(W: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """RTN quantize-dequantize, fp32 [out, in]."""
    return quantize_rtn(W, scheme).dequantize()
