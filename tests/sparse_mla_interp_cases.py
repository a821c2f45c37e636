"""Interpreter correctness cases for pd.kernels.sparse_mla_decode, run in a subprocess by
tests/test_sparse_mla_decode.py (TRITON_INTERPRET must be set before triton decorates the kernels, so it
cannot share a process with the AOT-compile tests). Prints one JSON line per case."""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from pd.kernels.sparse_mla_decode import sparse_mla_decode  # noqa: E402
from pd.kernels.sparse_mla_reference import BYTES_PER_TOKEN, quantize_kv, sparse_mla_decode_ref  # noqa: E402


def _cache(pages, ps, g):
    kv = torch.randn(pages * ps, 512, generator=g) * 0.7
    kc = quantize_kv(kv, ps)
    return kc, kc[:, : ps * BYTES_PER_TOKEN].view(pages, ps, 1, BYTES_PER_TOKEN)


def run_case(name, b, s, h, topk, ps, *, holes=False, lengths=None, sink=False, extra=False, splits=None,
             view2d=False, block_h=None, config=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = 3
    kc, kc4 = _cache(pages, ps, g)
    q = torch.randn(b, s, h, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, pages * ps, (b, s, topk), generator=g, dtype=torch.int32)
    if holes:
        idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
        idx[0, 0, :] = -1 if b > 1 else idx[0, 0, :]  # one row with no usable token (when B > 1)
    tl_len = torch.tensor(lengths, dtype=torch.int32) if lengths is not None else None
    snk = torch.randn(h, generator=g) if sink else None
    kw, rkw = dict(topk_length=tl_len, attn_sink=snk), dict(topk_length=tl_len, attn_sink=snk, page_size=ps)
    if extra:
        ekc, ekc4 = _cache(2, 64, g)
        eidx = torch.randint(0, 128, (b, s, 20), generator=g, dtype=torch.int32)
        eidx[..., 3] = -1
        elen = torch.tensor([20] + [7] * (b - 1), dtype=torch.int32)
        kw.update(extra_k_cache=ekc4, extra_indices=eidx, extra_topk_length=elen)
        rkw.update(extra_k_cache=ekc, extra_indices=eidx, extra_topk_length=elen, extra_page_size=64)
    out = lse = None
    out, lse = sparse_mla_decode(q, kc if view2d else kc4, idx, num_splits=splits, block_h=block_h, config=config,
                                 **kw)
    ro, rl = sparse_mla_decode_ref(q, kc, idx, **rkw)
    nz = ro.norm().item()
    rel = ((out.float() - ro).norm() / ro.norm()).item() if nz > 0 else (out.float().abs().max().item())
    same_inf = bool(torch.equal(torch.isinf(lse), torch.isinf(rl)))
    fin = torch.isfinite(rl)
    lse_err = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    return dict(name=name, rel=rel, lse_err=lse_err, same_inf=same_inf, nan=bool(torch.isnan(out).any()),
                empty_rows_zero=bool((out.float()[torch.isinf(rl).transpose(1, 2)] == 0).all()))


CHUNKED = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "CHUNKED": True}
PIPELINED = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PIPELINE": 3}

CASES = [
    ("s1_h16", dict(b=2, s=1, h=16, topk=40, ps=64)),
    ("s2_h32_holes_len", dict(b=2, s=2, h=32, topk=48, ps=64, holes=True, lengths=[33, 48])),
    ("s2_h16_len0_sink", dict(b=2, s=2, h=16, topk=32, ps=64, lengths=[0, 19], sink=True)),
    ("s1_h32_split3_sink", dict(b=1, s=1, h=32, topk=150, ps=64, sink=True, splits=3)),
    ("s2_h16_extra_sink_split2", dict(b=2, s=2, h=16, topk=64, ps=64, extra=True, sink=True, splits=2,
                                      lengths=[50, 64], holes=True)),
    ("s1_h16_extra_direct_len0", dict(b=2, s=1, h=16, topk=24, ps=64, extra=True, lengths=[0, 24])),
    ("s1_h16_page256_2d", dict(b=1, s=1, h=16, topk=40, ps=256, view2d=True)),
    # the chunked kernel (sm_90's default for 64-head programs), forced here
    ("chunked_s2_h64_holes_len_sink", dict(b=2, s=2, h=64, topk=48, ps=64, holes=True, lengths=[33, 48], sink=True,
                                           block_h=64, config=CHUNKED)),
    # the pipelined kernel with 64-head programs (sm_90's default there; 16-head cases above run it by default)
    ("pipelined_s2_h64_holes_len_sink_split2", dict(b=2, s=2, h=64, topk=80, ps=256, holes=True, lengths=[70, 80],
                                                    sink=True, splits=2, block_h=64, config=PIPELINED)),
    ("chunked_s1_h32_extra_split2_len0", dict(b=2, s=1, h=32, topk=64, ps=256, extra=True, splits=2, lengths=[0, 50],
                                              sink=True, block_h=32, config=CHUNKED)),
]

if __name__ == "__main__":
    names = sys.argv[1:]
    for i, (name, kw) in enumerate(CASES):
        if names and name not in names:
            continue
        print(json.dumps(run_case(name, seed=i, **kw)), flush=True)
