"""Where sparse-MLA decode's error against the fp64 reference comes from (CPU, torch emulation; no GPU needed).

  python benchmarks/kernels/sparse_mla_error_budget.py [--batch 8] [--heads 16] [--topk 512] [--tile 32]

Emulates the kernel's arithmetic in fp64 on the benchmark's inputs (make_inputs: random latent * 0.5 quantized
to the DSv4 FP8 layout, random bf16 q), one rounding at a time: the dequantized K is exact in bf16 and the dots
accumulate in fp32 (far below the rest), so the candidates are P rounded to bf16 for the PV dot (per tile of
``--tile`` tokens, relative to the running max, as the online softmax does), the denominator summed from the
unrounded or the rounded P, and the bf16 output. Prints ||out - ref|| / ||ref|| against the fp64 reference and
against that reference rounded to bf16 (the API's output dtype) for each combination.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sparse_mla_bench", os.path.join(HERE, "sparse_mla_decode.py"))
bm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bm)


def emulate(q, k, scale, tile, round_p, l_from_rounded):
    """q [R, H, 512] fp64, k [R, T, 512] fp64 -> out [R, H, 512] fp64 by the online softmax over tiles."""
    r, h, _ = q.shape
    m = torch.full((r, h), float("-inf"), dtype=torch.float64)
    l = torch.zeros(r, h, dtype=torch.float64)
    acc = torch.zeros(r, h, 512, dtype=torch.float64)
    for t0 in range(0, k.shape[1], tile):
        kt = k[:, t0:t0 + tile]
        s = torch.einsum("rhd,rtd->rht", q, kt) * scale
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        pr = p.to(torch.bfloat16).double() if round_p else p
        l = l * alpha + (pr if l_from_rounded else p).sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("rht,rtd->rhd", pr, kt)
        m = m_new
    return acc / l[..., None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--tile", type=int, default=32)
    args = ap.parse_args()
    ps = 64
    q, kc, idx, _ = bm.make_inputs(args.batch, 1, args.heads, args.topk, ps, 8 * args.topk, "cpu", seed=1)
    ref, _ = bm.sparse_mla_decode_ref(q, kc, idx, page_size=ps)
    ref = ref[:, 0].double()
    deq = bm._ref.dequantize_kv(kc, ps).double()  # [tokens, 512], exact
    k = deq[idx[:, 0].long()]
    qd = q[:, 0].double()
    scale = 512 ** -0.5
    ref_bf16 = ref.to(torch.bfloat16).double()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    rows = [("fp64 emulation (check: ~0)", False, False, False),
            ("bf16 output only", False, False, True),
            ("bf16 P only (l from unrounded P)", True, False, False),
            ("bf16 P, l from rounded P", True, True, False),
            ("bf16 P + bf16 output (the kernel, FlashMLA)", True, False, True),
            ("bf16 P, l from rounded P, bf16 output", True, True, True)]
    print(f"B={args.batch} H={args.heads} topk={args.topk} tile={args.tile}: rel error vs fp64 ref | vs ref in bf16")
    for name, rp, lr, ro in rows:
        out = emulate(qd, k, scale, args.tile, rp, lr)
        if ro:
            out = out.to(torch.bfloat16).double()
        print(f"  {name:48s} {rel(out, ref):.3e} | {rel(out, ref_bf16):.3e}")


if __name__ == "__main__":
    main()
