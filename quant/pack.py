"""Bit layouts: 4-bit codes two per byte, and 4-/8-bit codes packed into int32 words.

Owns packing and unpacking only; which dimension is packed is the caller's choice (`dim`).
Invariant: `unpack(pack(q)) == q` bit for bit, for every code in range.

Two codes per uint8 (low nibble first):

    codes  q0 q1 | q2 q3 | ...        byte i = q[2i] | q[2i+1] << 4

Eight 4-bit codes per int32 word:

    order "gptq" (sequential): nibble j (bits 4j..4j+3) holds code j of the 8
    order "awq"  (interleaved): nibbles 0..7 hold codes 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's layout)

Signed codes (int8 in [-8, 7]) are stored as two's-complement nibbles and sign-extended on unpack
(`signed=True`). Layouts that store symmetric codes offset by +8 (GPTQ, compressed-tensors) pack
`q + 8` as unsigned instead.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_last(t: torch.Tensor, dim: int, per_unit: int) -> torch.Tensor:
    t = t.movedim(dim, -1)
    if t.shape[-1] % per_unit:
        raise ValueError(f"dimension of size {t.shape[-1]} is not a multiple of {per_unit}: pad it first")
    return t.reshape(*t.shape[:-1], t.shape[-1] // per_unit, per_unit)


def _check_range(q: torch.Tensor, num_bits: int) -> None:
    if q.is_floating_point():
        raise ValueError("pack integer codes, not floats")
    # int8 holds signed codes; every other integer dtype holds unsigned ones
    if q.dtype == torch.int8:
        low, high = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    else:
        low, high = 0, (1 << num_bits) - 1
    if q.numel() and (int(q.min()) < low or int(q.max()) > high):
        raise ValueError(f"codes outside the {num_bits}-bit range [{low}, {high}]")


def pack_int4(q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """4-bit codes (uint8 in [0, 15] or int8 in [-8, 7]) -> uint8 with `dim` halved."""
    _check_range(q, 4)
    pairs = _to_last(q.to(torch.int16) & 0xF, dim, 2)  # [..., n/2, 2]
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed.movedim(-1, dim)


def unpack_int4(packed: torch.Tensor, dim: int = -1, signed: bool = False) -> torch.Tensor:
    """uint8 -> codes with `dim` doubled: uint8 in [0, 15], or int8 in [-8, 7] when signed."""
    p = packed.movedim(dim, -1)  # uint8 throughout: a load unpacks every int4 linear
    p = p.view(torch.uint8) if p.dtype == torch.int8 else p.to(torch.uint8)
    q = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], -1)
    if signed:
        q = q.view(torch.int8) - ((q >= 8).to(torch.int8) << 4)
    return q.movedim(-1, dim)


def pack_int32(q: torch.Tensor, dim: int = -1, num_bits: int = 4, order: str = "gptq") -> torch.Tensor:
    """Codes -> int32 words of 32/num_bits codes each, along `dim` (GPTQ packs along in_features)."""
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    if order not in ("gptq", "awq") or (order == "awq" and num_bits != 4):
        raise ValueError(f"order must be 'gptq', or 'awq' with 4 bits; got {order!r}")
    _check_range(q, num_bits)
    per_word = 32 // num_bits
    mask = (1 << num_bits) - 1
    groups = _to_last(q.to(torch.int64) & mask, dim, per_word)  # [..., n/per_word, per_word]
    if order == "awq":
        groups = groups[..., list(AWQ_ORDER)]
    shifts = torch.arange(per_word, dtype=torch.int64, device=q.device) * num_bits
    words = (groups << shifts).sum(dim=-1)  # disjoint bit fields: sum == bitwise or, in [0, 2^32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_int32(words: torch.Tensor, dim: int = -1, num_bits: int = 4, order: str = "gptq",
                 signed: bool = False) -> torch.Tensor:
    """int32 words -> codes (uint8, or sign-extended int8 when signed), inverse of `pack_int32`."""
    if num_bits not in (4, 8) or order not in ("gptq", "awq") or (order == "awq" and num_bits != 4):
        raise ValueError(f"unsupported num_bits {num_bits} / order {order!r}")
    per_word = 32 // num_bits
    mask = (1 << num_bits) - 1
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64, device=words.device) * num_bits
    fields = (w.unsqueeze(-1) >> shifts) & mask  # [..., n_words, per_word]
    if order == "awq":
        inverse = [AWQ_ORDER.index(i) for i in range(per_word)]
        fields = fields[..., inverse]
    q = fields.reshape(*w.shape[:-1], -1)
    if signed:
        q = torch.where(q >= 1 << (num_bits - 1), q - (1 << num_bits), q)
    return q.to(torch.int8 if signed else torch.uint8).movedim(-1, dim)
