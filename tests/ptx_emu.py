"""A tiny vectorized emulator for the few PTX integer / bf16x2 instructions that pdserve's inline-asm kernels use,
so their bit tricks are checked on the CPU, where neither the GPU nor Triton's interpreter can run inline asm.

Supported (PTX ISA 8.x semantics, all registers .b32, numpy uint32 arrays): mov.b32, and.b32, or.b32, xor.b32,
shl.b32, shr.b32 / shr.u32 (logical), lop3.b32 (any 8-bit LUT), prmt.b32 (default mode: selector nibbles 0-7 pick
bytes of {b, a}, bit 3 of a nibble replicates that byte's sign bit), mad.lo.u32, min.u16x2, mul.rn.bf16x2 (exact
product rounded to nearest even bf16; subnormals kept, as PTX specifies for bf16). ``.reg`` declarations and
``{`` ``}`` scopes are accepted; ``$N`` operands come from the caller. Anything else raises ValueError, so an asm
string that grows an instruction this emulator does not know fails its test instead of passing unchecked.
"""

from __future__ import annotations

import re

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)


def _bf16_to_f64(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _f64_to_bf16(v: np.ndarray) -> np.ndarray:
    """Round to nearest even bf16 bits (uint32 holding 16 bits). Products of two bf16 fit a float32 exactly
    (16 significant bits, exponents within float32's range down to its subnormals), so float32 is exact here."""
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(v)
    r = ((bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)) & np.uint64(0xFFFF)
    r = np.where(nan, np.uint64(0x7FC0), r)
    return r.astype(np.uint32)


def _lanes(x):
    return x & np.uint32(0xFFFF), x >> np.uint32(16)


def _join(lo, hi):
    return (lo & np.uint32(0xFFFF)) | (hi << np.uint32(16))


def _prmt(a, b, c):
    """prmt.b32 default mode; the selector c is an immediate."""
    src = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] + \
          [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        sel = (int(c) >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # replicate the sign bit of the selected byte
            byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for i in range(8):  # LUT bit i is the result for (a, b, c) = (i >> 2 & 1, i >> 1 & 1, i & 1) as 0xF0/0xCC/0xAA
        if (lut >> i) & 1:
            ta = a if i & 4 else ~a
            tb = b if i & 2 else ~b
            tc = c if i & 1 else ~c
            out |= ta & tb & tc
    return out


def run_ptx(asm: str, operands: dict[int, np.ndarray], n_outputs: int) -> list[np.ndarray]:
    """Run ``asm`` with ``$k`` inputs from ``operands`` (uint32 arrays of one shape); return ``$0..$(n_outputs-1)``."""
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v, dtype=np.uint32) for k, v in operands.items()}
    shape = next(iter(regs.values())).shape

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)[Uu]?", tok):
            return np.full(shape, int(tok.rstrip("Uu"), 0) & 0xFFFFFFFF, dtype=np.uint32)
        raise ValueError(f"unknown operand {tok!r}")

    body = asm.replace("{", ";").replace("}", ";")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg") or stmt.startswith("//"):
            continue
        op, _, rest = stmt.partition(" ")
        args = [t.strip() for t in rest.split(",")]
        dst, src = args[0], args[1:]
        v = [val(t) for t in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "xor.b32":
            r = v[0] ^ v[1]
        elif op == "shl.b32":
            r = (v[0].astype(np.uint64) << v[1].astype(np.uint64) & _MASK).astype(np.uint32)
        elif op in ("shr.b32", "shr.u32"):
            r = v[0] >> v[1]
        elif op == "lop3.b32":
            r = _lop3(v[0], v[1], v[2], int(src[3], 0))
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], int(src[2].rstrip("Uu"), 0))
        elif op == "mad.lo.u32":
            r = ((v[0].astype(np.uint64) * v[1].astype(np.uint64) + v[2].astype(np.uint64)) & _MASK).astype(np.uint32)
        elif op == "min.u16x2":
            (a0, a1), (b0, b1) = _lanes(v[0]), _lanes(v[1])
            r = _join(np.minimum(a0, b0), np.minimum(a1, b1))
        elif op == "mul.rn.bf16x2":
            (a0, a1), (b0, b1) = _lanes(v[0]), _lanes(v[1])
            with np.errstate(invalid="ignore", over="ignore"):  # 0 * inf = NaN, as the hardware gives
                r = _join(_f64_to_bf16(_bf16_to_f64(a0) * _bf16_to_f64(b0)),
                          _f64_to_bf16(_bf16_to_f64(a1) * _bf16_to_f64(b1)))
        else:
            raise ValueError(f"instruction {op!r} is not emulated")
        regs[dst] = r.astype(np.uint32)
    return [regs[f"${k}"] for k in range(n_outputs)]
