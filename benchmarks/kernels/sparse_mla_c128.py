"""Device benchmark: sparse-MLA decode of DeepSeek-V4's c128 layers, SGLang 0.5.23's sm_120 Triton kernel vs ours
(run on the GPU machine, not in CI).

  SGLANG_SM120_TRITON=.sgl/flash_mla_sm120_triton.py python benchmarks/kernels/sparse_mla_c128.py [--out DIR]
      [--quick] [--heads 16,64] [--batches 1,16,64,128] [--contexts 32768,131072]

A c128 layer's decode call (``DeepseekV4AttnBackend._forward_attention`` -> ``flash_mla_with_kvcache_sm120``), per
query token: the SWA cache (256-token pages; the last SWA_WINDOW = 128 tokens, topk_length 128) plus the layer's
compressed cache (256 / 128 = 2 tokens per page, page stride 1728 bytes; every compressed block so far, context /
128 entries, extra_topk_length = context // 128) and the sink. Until page 2 was supported, our plugin handed these
calls to SGLang's function. Timed per (H, B, context):
  (a) ``flash_mla_sparse_decode_triton`` (SGLang's file, path in $SGLANG_SM120_TRITON) on that layout, at the native
      head count: the plugin pads q to 64 heads only for SGLang's FlashInfer backend (kernels/sglang_sparse_mla.py
      ``_needs_pad``), not for this one;
  (b) ours (``sparse_mla_decode``) on the same inputs;
  (c) ours on a c4 layer (SWA 128 + the indexer's top-512 of context / 4 compressed tokens, 64-token pages) and on
      a SWA-only layer (ratio 0), for the per-step totals.
Before timing: every c128 shape's output of (a) vs (b), and at B = min(B, 8) rows (a), (b) and (c) vs the fp64
reference (``sparse_mla_decode_ref``). Times: median of CUDA-graph replays with 4 input sets cycled
(benchmarks/kernels/sparse_mla_decode.py ``bench``). Per decode step, attention over DSv4-Flash's 43 layers with
the layer counts of --layers (default 21 c4, 20 c128, 2 SWA-only: the checkpoint's compress_ratios, [0, 0] then
4 / 128 alternating) with the c128 layers on (a) vs on (b).

Writes sparse_mla_c128.json (with ``targets``) and sparse_mla_c128.md to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sparse_mla_decode as smb  # noqa: E402  (this folder: its bench / rel / loaders)
from results_io import md_header, run_info, write_result  # noqa: E402

sparse_mla_decode, quantize_kv = smb.sparse_mla_decode, smb.quantize_kv
sparse_mla_decode_ref = smb.sparse_mla_decode_ref
BYTES_PER_TOKEN, ROT, view4, rel, lse_err = smb.BYTES_PER_TOKEN, smb.ROT, smb.view4, smb.rel, smb.lse_err
SWA_WINDOW, SWA_PAGE, C128_PAGE, C4_PAGE, C4_TOPK = 128, 256, 2, 64, 512
SCALE = 512 ** -0.5
C4_POOL_MAX = 1 << 20  # compressed tokens of the c4 test pool (topk 512 drawn from it per row)


def _cache(tokens, page, dev, g):
    pages = triton.cdiv(tokens, page)
    kv = torch.randn(pages * page, 512, device=dev, generator=g) * 0.5
    kc = quantize_kv(kv, page)
    del kv
    return kc, view4(kc, page)


def layer_inputs(h, n, ctx, dev, seed):
    """n = ROT * B query rows. Returns dict(q, sink, swa=(kc, kc4, idx, len), c128=(...), c4=(...))."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(n, 1, h, 512, device=dev, generator=g).to(torch.bfloat16)
    sink = (torch.randn(h, device=dev, generator=g) + 2).float()
    # SWA: each row's window is 128 consecutive slots of a 256-token-page pool (crossing a page boundary at random)
    kc, kc4 = _cache((n + 1) * SWA_PAGE, SWA_PAGE, dev, g)
    start = torch.randint(0, n * SWA_PAGE, (n, 1), device=dev, generator=g)
    swa_idx = (start + torch.arange(SWA_WINDOW, device=dev)).int().view(n, 1, SWA_WINDOW).contiguous()
    swa_len = torch.full((n,), SWA_WINDOW, dtype=torch.int32, device=dev)
    # c128: row r owns ctx / 256 pages of 2 compressed tokens (one per 256-token page of the full pool), scattered
    n_c = ctx // 128
    pages_per_row = triton.cdiv(n_c, C128_PAGE)
    ekc, ekc4 = _cache(n * pages_per_row * C128_PAGE, C128_PAGE, dev, g)
    perm = torch.randperm(n * pages_per_row, device=dev, generator=g).view(n, pages_per_row)
    c128_idx = (perm[:, :, None] * C128_PAGE + torch.arange(C128_PAGE, device=dev)).view(n, -1)[:, :n_c]
    width = triton.cdiv(n_c, 64) * 64  # SGLang pads the rows to a multiple of 64 with -1
    c128_idx = torch.nn.functional.pad(c128_idx, (0, width - n_c), value=-1).int().view(n, 1, width).contiguous()
    c128_len = torch.full((n,), n_c, dtype=torch.int32, device=dev)
    # c4: the indexer's top-512 of ctx / 4 compressed tokens (64-token pages), distinct per row
    pool = min(n * ctx // 4, C4_POOL_MAX)
    ckc, ckc4 = _cache(pool, C4_PAGE, dev, g)
    c4_idx = torch.cat([torch.rand(min(64, n - r), pool, device=dev, generator=g).topk(C4_TOPK, 1).indices
                        for r in range(0, n, 64)]).int().view(n, 1, C4_TOPK).contiguous()
    c4_len = torch.full((n,), C4_TOPK, dtype=torch.int32, device=dev)
    return dict(q=q, sink=sink, swa=(kc, kc4, swa_idx, swa_len), c128=(ekc, ekc4, c128_idx, c128_len),
                c4=(ckc, ckc4, c4_idx, c4_len))


def _rows(t, sl):
    return None if t is None else t[sl]


def ours_call(d, extra, sl):
    kc, kc4, idx, ln = d["swa"]
    kw = dict(topk_length=ln[sl], attn_sink=d["sink"], softmax_scale=SCALE)
    if extra is not None:
        ekc, ekc4, eidx, eln = d[extra]
        kw.update(extra_k_cache=ekc4, extra_indices=eidx[sl], extra_topk_length=eln[sl])
    return sparse_mla_decode(d["q"][sl], kc4, idx[sl], **kw)


def sglang_call(sgl, d, sl):
    kc, kc4, idx, ln = d["swa"]
    ekc, ekc4, eidx, eln = d["c128"]
    return sgl(d["q"][sl], kc4, idx[sl], ln[sl], d["sink"], 512, SCALE, ekc4, eidx[sl], eln[sl])


def reference(d, extra, sl):
    kc, _, idx, ln = d["swa"]
    kw = dict(topk_length=ln[sl], attn_sink=d["sink"], softmax_scale=SCALE, page_size=SWA_PAGE)
    if extra is not None:
        ekc, _, eidx, eln = d[extra]
        kw.update(extra_k_cache=ekc, extra_indices=eidx[sl], extra_topk_length=eln[sl],
                  extra_page_size=C128_PAGE if extra == "c128" else C4_PAGE)
    return sparse_mla_decode_ref(d["q"][sl], kc, idx[sl], **kw)


def graph_check(d, b):
    """Our c128 call captured once, replayed on input set 1 copied into its buffers: bitwise the eager result."""
    kc, kc4, idx, ln = d["swa"]
    ekc, ekc4, eidx, eln = d["c128"]
    sq, si, se = d["q"][:b].clone(), idx[:b].clone(), eidx[:b].clone()
    kw = dict(topk_length=ln[:b], attn_sink=d["sink"], softmax_scale=SCALE, extra_k_cache=ekc4,
              extra_topk_length=eln[:b])
    sparse_mla_decode(sq, kc4, si, extra_indices=se, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        go, _ = sparse_mla_decode(sq, kc4, si, extra_indices=se, **kw)
    sl = slice(b, 2 * b)
    sq.copy_(d["q"][sl])
    si.copy_(idx[sl])
    se.copy_(eidx[sl])
    g.replay()
    eo, _ = sparse_mla_decode(d["q"][sl], kc4, idx[sl], extra_indices=eidx[sl], **kw)
    torch.cuda.synchronize()
    return (go.float() - eo.float()).abs().max().item()


def run_shape(h, b, ctx, dev, sgl, quick, check_rows):
    d = layer_inputs(h, ROT * b, ctx, dev, seed=h * 1000 + b + ctx // 1024)
    row = dict(H=h, B=b, context=ctx, swa_topk=SWA_WINDOW, c128_topk=d["c128"][2].shape[-1], c4_topk=C4_TOPK)
    sl0 = slice(0, b)
    o_ours, l_ours = ours_call(d, "c128", sl0)
    # the reference at up to check_rows rows (it dequantizes the whole pool in fp64)
    c = slice(0, min(b, check_rows))
    ro, rl = reference(d, "c128", c)
    row["ours_vs_ref_rel"] = rel(o_ours[c], ro)
    row["ours_lse_err"] = lse_err(l_ours[c], rl)
    co, cl = ours_call(d, "c4", c)
    cro, crl = reference(d, "c4", c)
    row["ours_c4_vs_ref_rel"], row["ours_c4_lse_err"] = rel(co, cro), lse_err(cl, crl)
    del ro, rl, cro, crl
    ok = row["ours_vs_ref_rel"] < 2.5e-3 and row["ours_lse_err"] < 1e-3 and row["ours_c4_vs_ref_rel"] < 2.5e-3
    if sgl is not None:
        o_sgl, _ = sglang_call(sgl, d, sl0)
        row["sglang_vs_ours_rel"] = rel(o_sgl, o_ours)
        row["sglang_vs_ref_rel"] = rel(o_sgl[c], reference(d, "c128", c)[0])
        ok = ok and row["sglang_vs_ours_rel"] < 1e-2 and row["sglang_vs_ref_rel"] < 1e-2
    if b >= 2 and ROT >= 2:
        row["graph_replay_max_abs_diff"] = graph_check(d, b)
        ok = ok and row["graph_replay_max_abs_diff"] == 0.0
    row["ok"] = bool(ok)
    torch.cuda.synchronize()
    sls = [slice(i * b, (i + 1) * b) for i in range(ROT)]
    row["ours_c128_us"] = smb.bench(lambda i: ours_call(d, "c128", sls[i]), quick)
    row["ours_c4_us"] = smb.bench(lambda i: ours_call(d, "c4", sls[i]), quick)
    row["ours_swa_us"] = smb.bench(lambda i: ours_call(d, None, sls[i]), quick)
    if sgl is not None:
        row["sglang_triton_c128_us"] = smb.bench(lambda i: sglang_call(sgl, d, sls[i]), True)
        row["ratio_sglang_over_ours"] = row["sglang_triton_c128_us"] / row["ours_c128_us"]
    # the fewest bytes a c128 call moves: the selected records, q, out, the index rows
    nbytes = b * ((SWA_WINDOW + ctx // 128) * (BYTES_PER_TOKEN + 4) + 2 * h * 512 * 2)
    row["c128_bytes"] = nbytes
    return row


def step_totals(row, layers):
    """Attention per decode step over the model's layers, ms: c128 layers on SGLang's Triton kernel vs on ours."""
    n4, n128, n0 = layers
    base = n4 * row["ours_c4_us"] + n0 * row["ours_swa_us"]
    row["step_attn_ours_ms"] = (base + n128 * row["ours_c128_us"]) / 1e3
    if "sglang_triton_c128_us" in row:
        row["step_attn_fallback_ms"] = (base + n128 * row["sglang_triton_c128_us"]) / 1e3
        row["step_attn_saved_ms"] = row["step_attn_fallback_ms"] - row["step_attn_ours_ms"]


def table_md(res) -> list[str]:
    nan = float("nan")
    n4, n128, n0 = res["layers"]
    lines = md_header("Sparse-MLA decode on c128 layers (2-token compressed pages): SGLang's Triton kernel vs ours",
                      res)
    lines += [f"torch {res['torch']}, triton {res['triton']}; copy bandwidth {res['copy_GBps']:.0f} GB/s; "
              f"all checks ok: {res.get('all_ok')}", "",
              f"Per step: {n4} c4 + {n128} c128 + {n0} SWA-only layers (DSv4-Flash's compress_ratios).", "",
              "| H | B | context | c128 topk (SWA + compressed) | SGLang Triton c128 µs | ours c128 µs | SGLang / ours "
              "| ours c4 µs | ours SWA-only µs | step attention, c128 on SGLang ms | step attention, all ours ms "
              "| saved ms/step | ours vs ref | SGLang vs ref |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['H']} | {r['B']} | {r['context'] // 1024}k | {SWA_WINDOW} + {r['c128_topk']} | "
            f"{r.get('sglang_triton_c128_us', nan):.1f} | {r['ours_c128_us']:.2f} | "
            f"{r.get('ratio_sglang_over_ours', nan):.0f}x | {r['ours_c4_us']:.2f} | {r['ours_swa_us']:.2f} | "
            f"{r.get('step_attn_fallback_ms', nan):.2f} | {r['step_attn_ours_ms']:.3f} | "
            f"{r.get('step_attn_saved_ms', nan):.2f} | {r['ours_vs_ref_rel']:.2e} | "
            f"{r.get('sglang_vs_ref_rel', nan):.2e} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--layers", default="21,20,2", help="c4, c128 and SWA-only layer counts per decode step")
    ap.add_argument("--check-rows", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    layers = tuple(int(x) for x in args.layers.split(","))
    res = dict(run_info(), torch=torch.__version__, triton=triton.__version__, layers=layers,
               copy_GBps=smb.copy_gbps(dev), sglang_file=os.environ.get("SGLANG_SM120_TRITON"), rows=[])
    sgl = smb.load_sglang_triton()
    if sgl is None:
        print("SGLang's Triton kernel not found ($SGLANG_SM120_TRITON): timing ours only", flush=True)
    for h in map(int, args.heads.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            for b in map(int, args.batches.split(",")):
                row = run_shape(h, b, ctx, dev, sgl, args.quick, args.check_rows)
                torch.cuda.empty_cache()  # the shape's pools are gone with run_shape's frame
                step_totals(row, layers)
                res["rows"].append(row)
                print("row", row, flush=True)
                res["wall_s"] = time.time() - t0
                write_result(args.out, "sparse_mla_c128", res, table_md(res))  # partial results survive a timeout
    rows = res["rows"]
    res["all_ok"] = all(r["ok"] for r in rows)
    timed = [r for r in rows if "ratio_sglang_over_ours" in r]
    if timed:
        worst = min(r["ratio_sglang_over_ours"] for r in timed)
        share = max(r["step_attn_saved_ms"] / r["step_attn_fallback_ms"] for r in timed)
        res["targets"] = {
            "c128_min_speedup_over_sglang_triton": dict(
                value=worst, goal=">= 10x at every shape (the fallback is worth replacing)", met=worst >= 10),
            "c128_correct_vs_reference": dict(value=max(r["ours_vs_ref_rel"] for r in rows),
                                              goal="<= 2.5e-3 relative L2 vs fp64 (the tests' bound), every shape",
                                              met=res["all_ok"]),
            "max_step_attention_share_saved": dict(
                value=share, goal="report: share of the step's attention time the fallback adds", met=True),
        }
    res["wall_s"] = time.time() - t0
    path = write_result(args.out, "sparse_mla_c128", res, table_md(res))
    print("\n".join(table_md(res)[8:]))
    print("wrote", path, "in", round(res["wall_s"]), "s")


if __name__ == "__main__":
    main()
