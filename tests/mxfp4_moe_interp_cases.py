"""Interpreter correctness cases for pd.kernels.mxfp4_moe, run in a subprocess by tests/test_mxfp4_moe.py
(TRITON_INTERPRET must be set before triton decorates the kernels, so it cannot share a process with the AOT
tests; importing this module for CASES does not touch triton). Prints one JSON line per case."""

import dataclasses
import json
import os
import sys


def make_inputs(t, h, inter, e, k, g, *, skip=0, shared=False, skip_token0=False):
    """Random packed codes (every e2m1 value) and scales 2^-4..2^-1, so |gate| > 10 for a few percent of the
    entries (the clamp matters). ``shared``: tokens draw from few experts (several row blocks per expert)."""
    import torch

    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w13 = torch.randint(0, 256, (e, 2 * inter, h // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(123, 127, (e, 2 * inter, h // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, h, inter // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(121, 125, (e, h, inter // 32), generator=g, dtype=torch.uint8)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    if shared:
        ids = torch.stack([torch.randperm(2, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    flat = ids.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:skip]] = -1
    if skip_token0:
        ids[0] = -1
    wts = torch.rand(t, k, generator=g)
    return x, w13, s13, w2, s2, wts, ids


def run_case(name, t, h, inter, e, k, *, path, bm=16, splits=(1, 1), halves=False, limit=10.0, scaling=None,
             up_first=False, skip=0, shared=False, skip_token0=False, ids64=False, wbf16=False, int8=False, seed=0,
             dequant="dot_scaled", tiles=None, layout="sglang", extra=None, calls=1, workspace=False):
    import torch

    from pd.kernels.mxfp4_moe import (
        MoETile,
        default_config,
        fused_moe_mxfp4,
        mxfp4_max_scale_byte,
        mxfp4_moe_workspace,
        prepare_mxfp4_weights_sm90,
        tile_mxfp4_scales,
    )
    from pd.kernels.mxfp4_moe_reference import fused_moe_mxfp4_reference

    g = torch.Generator().manual_seed(seed)
    x, w13, s13, w2, s2, wts, ids = make_inputs(t, h, inter, e, k, g, skip=skip, shared=shared,
                                                skip_token0=skip_token0)
    if ids64:
        ids = ids.long()
    if wbf16:
        wts = wts.to(torch.bfloat16)
    over = dict(path=path, BM=bm, split_gate_up=splits[0], split_down=splits[1], gate_up_halves=halves,
                dequant=dequant, **(extra or {}))  # extra: e.g. fold / pdl / prefetch options
    if tiles:  # (gate_up, down) tile overrides, as dicts
        over.update(gate_up=MoETile(**tiles[0]), down=MoETile(**tiles[1]))
    cfg = dataclasses.replace(default_config(t * k), **over)  # checked once, as a whole
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    kw = dict(swiglu_limit=limit, routed_scaling_factor=scaling, up_first=up_first)
    ws = mxfp4_moe_workspace(t, k, h, inter, device="cpu") if workspace else None
    ww13, ww2 = (w13.view(torch.int8), w2.view(torch.int8)) if int8 else (w13, w2)
    ss13, ss2 = s13, s2
    if layout != "sglang":  # the reference below keeps reading the original layout
        ww13, ww2 = prepare_mxfp4_weights_sm90(ww13, ww2, tiled=layout != "sm90_bits")
    if layout == "sm90_tiled":
        ss13, ss2 = tile_mxfp4_scales(s13, s2)
    res = fused_moe_mxfp4(x, ww13, ss13, ww2, ss2, wts, ids, out=out, config=cfg,
                          max_scale_byte=mxfp4_max_scale_byte(s13, s2), weight_layout=layout, workspace=ws, **kw)
    repeat_equal = True
    for _ in range(calls - 1):  # later calls (fold: the tickets were reset) give the same bits
        again = torch.full((t, h), float("nan"), dtype=torch.bfloat16)
        fused_moe_mxfp4(x, ww13, ss13, ww2, ss2, wts, ids, out=again, config=cfg,
                        max_scale_byte=mxfp4_max_scale_byte(s13, s2), weight_layout=layout, workspace=ws, **kw)
        repeat_equal &= bool(torch.equal(again, res))
    ref = fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, **kw)
    rel = ((res.double() - ref).norm() / ref.norm()).item()
    r = dict(name=name, rel=rel, nan=bool(torch.isnan(res).any()), same_buffer=res.data_ptr() == out.data_ptr(),
             repeat_equal=repeat_equal)
    if limit is not None:  # how much the clamp changes the answer (the case must exercise it)
        ref_nl = fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, **dict(kw, swiglu_limit=None))
        r["clamp_effect"] = ((ref_nl - ref).norm() / ref.norm()).item()
    if ws is not None:  # every call leaves the tickets zeroed
        r["workspace_zero"] = bool((ws == 0).all())
    if skip_token0:  # a token whose every slot is skipped must come out as exact zeros
        r["all_skipped_row_zero"] = bool((res[0] == 0).all())
    return r


CASES = [
    ("pair_token", dict(t=3, h=128, inter=128, e=6, k=3, path="pair_token", scaling=1.5, skip=1)),
    ("pair_ids64_wbf16_int8", dict(t=3, h=128, inter=128, e=5, k=2, path="pair", ids64=True, wbf16=True,
                                   int8=True)),
    ("pair_split2x2_skip", dict(t=2, h=256, inter=256, e=5, k=3, path="pair", splits=(2, 2), skip=1)),
    ("sorted_split2x1_up_first", dict(t=4, h=256, inter=128, e=3, k=2, path="sorted", splits=(2, 1),
                                      up_first=True, scaling=2.0)),
    ("pair_halves_up_first", dict(t=3, h=128, inter=128, e=4, k=2, path="pair", halves=True, up_first=True)),
    ("sorted_halves_split2_skip", dict(t=6, h=256, inter=128, e=3, k=2, path="sorted", halves=True,
                                       splits=(2, 1), skip=2)),
    ("sorted_multiblock_skip", dict(t=20, h=128, inter=128, e=3, k=2, path="sorted", shared=True, skip=5)),
    ("sorted_bm32_up_first_nolimit", dict(t=5, h=128, inter=256, e=4, k=2, path="sorted", bm=32, limit=None,
                                          up_first=True)),
    ("sorted_bm64_large_t_default", dict(t=40, h=256, inter=128, e=5, k=2, path="sorted", bm=64, skip=3)),
    ("pair_token_h256_bk256", dict(t=2, h=256, inter=128, e=4, k=2, path="pair_token", scaling=0.5)),
    ("sorted_all_skipped_token", dict(t=3, h=128, inter=128, e=4, k=2, path="sorted", skip_token0=True)),
    ("pair_token_all_skipped_token", dict(t=2, h=128, inter=128, e=4, k=2, path="pair_token", skip_token0=True)),
    # the bit-arithmetic dequantization (sm_90's path; here its pure-Triton twin, DEQ_BITS_TL)
    ("bits_pair_token", dict(t=3, h=128, inter=128, e=6, k=3, path="pair_token", scaling=1.5, skip=1,
                             dequant="bits")),
    ("bits_pair_split2x2_int8", dict(t=2, h=256, inter=256, e=5, k=3, path="pair", splits=(2, 2), skip=1,
                                     int8=True, dequant="bits")),
    ("bits_sorted_halves_up_first", dict(t=6, h=256, inter=128, e=3, k=2, path="sorted", halves=True,
                                         up_first=True, skip=2, dequant="bits")),
    # BK_DOT < BK: several dequantize + dot steps per loop iteration (2 in gate/up, 4 in down)
    ("bits_sorted_bk_dot_substeps", dict(t=4, h=512, inter=512, e=3, k=2, path="sorted", halves=True, skip=1,
                                         dequant="bits", tiles=(dict(BN=64, BK=256, BK_DOT=128, num_warps=2,
                                                                     num_stages=3),
                                                                dict(BN=64, BK=512, BK_DOT=128, num_warps=2,
                                                                     num_stages=2)))),
    ("pair_bk_dot_substeps", dict(t=2, h=512, inter=256, e=4, k=2, path="pair", splits=(2, 1), skip=1,
                                  tiles=(dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                         dict(BN=64, BK=256, BK_DOT=64, num_warps=2, num_stages=3)))),
    # the prepared layout (prepare_mxfp4_weights_sm90 -> weight_layout="sm90_bits"), its pure-Triton twin
    ("prep_sorted_halves_bk_dot", dict(t=4, h=512, inter=256, e=3, k=2, path="sorted", halves=True, skip=1,
                                       dequant="auto", layout="sm90_bits",
                                       tiles=(dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                              dict(BN=64, BK=256, BK_DOT=64, num_warps=2, num_stages=3)))),
    ("prep_pair_token_fused_int8", dict(t=3, h=256, inter=128, e=5, k=3, path="pair_token", scaling=1.5, skip=1,
                                        int8=True, up_first=True, dequant="bits", layout="sm90_bits")),
    ("prep_pair_split2x2", dict(t=2, h=256, inter=256, e=4, k=2, path="pair", splits=(2, 2), halves=True,
                                dequant="bits", layout="sm90_bits")),
    ("prep_sorted_bm64_multiblock", dict(t=24, h=256, inter=128, e=3, k=2, path="sorted", bm=64, shared=True,
                                         skip=3, dequant="bits", layout="sm90_bits")),
    ("bits_sorted_bm32_multiblock", dict(t=20, h=128, inter=256, e=3, k=2, path="sorted", bm=32, shared=True,
                                         skip=3, dequant="bits")),
    # fold: SwiGLU and the k-sum done by the last program of each group (tickets), 2 kernels; called twice, so the
    # tickets must have been reset by the first call
    ("fold_pair_halves_split2x2_skip", dict(t=3, h=256, inter=256, e=5, k=3, path="pair", splits=(2, 2),
                                            halves=True, skip=2, up_first=True, calls=2,
                                            extra=dict(fold=True, pdl=True, pdl_release="start",
                                                       prefetch_gate_up=2, prefetch_down=2))),
    ("prep_fold_pair_fused_split2x2_skipped_token", dict(t=2, h=256, inter=128, e=4, k=2, path="pair", bm=1,
                                                         splits=(2, 2), skip_token0=True, dequant="bits",
                                                         layout="sm90_bits", calls=2, extra=dict(fold=True))),
    # the sm90_bits T <= 8 default plan's options (one-row blocks, fold, 2 x 1 splits, halves, stage_loads 3, its
    # tiles; pdl, which the interpreter does not launch, accepted) with int64 ids
    ("prep_fold_bm1_split2x1_halves_ids64", dict(t=3, h=256, inter=256, e=5, k=3, path="pair", bm=1, splits=(2, 1),
                                                 halves=True, skip=1, ids64=True, dequant="bits", layout="sm90_bits",
                                                 calls=2, extra=dict(fold=True, pdl=True, stage_loads=3),
                                                 tiles=(dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                                        dict(BN=32, BK=256, BK_DOT=128, num_warps=2,
                                                             num_stages=3)))),
    # fewer rows per block: BM 1 / 8 (tl.dot pads them to the mma shape)
    ("bits_pair_token_bm1", dict(t=3, h=128, inter=128, e=5, k=2, path="pair_token", bm=1, skip=1, dequant="bits")),
    ("prep_sorted_bm8_multiblock", dict(t=12, h=256, inter=128, e=3, k=2, path="sorted", bm=8, shared=True, skip=2,
                                        halves=True, dequant="bits", layout="sm90_bits")),
    # 16 weight rows per warp (gate/up BN 16, down BN 32) with BK_DOT 64 substeps, 4 x 2 K splits, a register cap
    # (a launch option the interpreter drops: the plan must still be accepted and run), int64 ids, a skipped slot
    ("prep_fold_bm1_narrow_tiles_split4x2_capped", dict(
        t=2, h=512, inter=256, e=4, k=2, path="pair", bm=1, splits=(4, 2), halves=True, skip=1, ids64=True,
        dequant="bits", layout="sm90_bits", calls=2, extra=dict(fold=True),
        tiles=(dict(BN=16, BK=256, BK_DOT=64, num_warps=1, num_stages=3, maxnreg=40),
               dict(BN=32, BK=128, BK_DOT=64, num_warps=2, num_stages=3, maxnreg=40)))),
    # stage_loads: the activation row (and with 3 the scales) read as one contiguous load per dequantize + dot
    # step (1) or per pipeline stage (2, 3), split into the prepared layout's value columns in registers. 3 with the
    # T <= 8 plan's halves and tiles (unsplit, so each program's K range is one BK 256 stage of two BK_DOT halves); 3
    # on the fused gate/up path with BK = BK_DOT (one half); 1 with BK_DOT 64 substeps and 2 on the sorted path with
    # one-row blocks
    ("prep_fold_bm1_stage3_halves_ids64", dict(t=3, h=256, inter=256, e=5, k=3, path="pair", bm=1, splits=(1, 1),
                                               halves=True, skip=1, ids64=True, dequant="bits", layout="sm90_bits",
                                               calls=2, extra=dict(fold=True, pdl=True, stage_loads=3),
                                               tiles=(dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                                      dict(BN=64, BK=256, BK_DOT=128, num_warps=4, num_stages=3)))),
    ("prep_fold_bm1_stage3_fused_bk128", dict(t=2, h=256, inter=256, e=4, k=2, path="pair", bm=1, splits=(2, 1),
                                              up_first=True, skip=1, dequant="bits", layout="sm90_bits", calls=2,
                                              extra=dict(fold=True, stage_loads=3),
                                              tiles=(dict(BN=32, BK=128, num_warps=2, num_stages=3),
                                                     dict(BN=32, BK=128, num_warps=2, num_stages=3)))),
    ("prep_bm1_stage1_bk_dot64", dict(t=2, h=512, inter=256, e=4, k=2, path="pair", bm=1, splits=(2, 2), halves=True,
                                      skip=1, dequant="bits", layout="sm90_bits", extra=dict(stage_loads=1),
                                      tiles=(dict(BN=16, BK=256, BK_DOT=64, num_warps=1, num_stages=3),
                                             dict(BN=32, BK=128, BK_DOT=64, num_warps=2, num_stages=3)))),
    ("prep_sorted_bm1_stage2", dict(t=4, h=256, inter=256, e=3, k=2, path="sorted", bm=1, shared=True, skip=1,
                                    halves=True, dequant="bits", layout="sm90_bits", extra=dict(stage_loads=2),
                                    tiles=(dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                           dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3)))),
    # the tiled prepared layout (weights and scales in 32-row tiles; K = 512 so rows span 2 tiles): the T <= 8 plan
    # (gate/up not split, its sm_90 default, and split 2: stages that start mid-row), and the sorted path with 64-row
    # tiles across two 32-row bands, the fused gate/up, BK 128 stages (mid-tile starts, BK_DOT 64 steps) and split-2
    # down (BK 512 / BK_DOT 256)
    ("tiled_fold_bm1_split1x1_halves_ids64", dict(t=2, h=512, inter=512, e=4, k=2, path="pair", bm=1, splits=(1, 1),
                                                  halves=True, skip=1, ids64=True, dequant="bits",
                                                  layout="sm90_tiled", calls=2,
                                                  extra=dict(fold=True, pdl=True, stage_loads=3),
                                                  tiles=(dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                                         dict(BN=32, BK=256, BK_DOT=128, num_warps=2,
                                                              num_stages=3)))),
    ("tiled_fold_bm1_split2x1_halves", dict(t=2, h=512, inter=512, e=4, k=2, path="pair", bm=1, splits=(2, 1),
                                            halves=True, skip=1, dequant="bits", layout="sm90_tiled", calls=2,
                                            extra=dict(fold=True, pdl=True, stage_loads=3),
                                            tiles=(dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                                                   dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3)))),
    ("tiled_sorted_bm8_fused_split1x2", dict(t=6, h=512, inter=512, e=3, k=2, path="sorted", bm=8, shared=True,
                                             splits=(1, 2), up_first=True, skip=1, dequant="bits",
                                             layout="sm90_tiled",
                                             tiles=(dict(BN=64, BK=128, BK_DOT=64, num_warps=2, num_stages=3),
                                                    dict(BN=64, BK=512, BK_DOT=256, num_warps=2, num_stages=3)))),
    ("fold_pair_one_pass_down_split2", dict(t=2, h=128, inter=256, e=4, k=3, path="pair", bm=8, splits=(1, 2), skip=1,
                                            scaling=1.5, calls=2, workspace=True, extra=dict(fold=True))),
]

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    names = sys.argv[1:]
    for i, (name, kw) in enumerate(CASES):
        if names and name not in names:
            continue
        print(json.dumps(run_case(name, seed=i, **kw)), flush=True)
