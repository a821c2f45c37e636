"""Build the planner profile of DeepSeek-V4-Flash on 8x RTX PRO 6000 Blackwell (deploy/profiles/) from this
repository's kernel benchmarks and published figures, each number with its source.

No such box was measured here: the profile is a model, written down so that every number can be checked and
replaced by a measurement (``pdserve profile --url ...`` on the real box writes the same schema). The model:

Decode iteration (one EAGLE/MTP verify step of ``num_draft_tokens`` 2, as deploy/dsv4-flash-rtxpro6000x8.yaml
runs) at batch b, context c, TP t, per GPU: for each of the 43 layers,
  - routed MoE: ``benchmarks/results/mxfp4_moe.json`` (H200, 256 experts top-6, hidden 4096, intermediate 2048,
    MXFP4) at T = 2b tokens;
  - sparse-MLA attention: ``sparse_mla_decode.json`` (H200, topk 512, S = 2, H = 64 / t heads);
  - DSA indexer (C4 layers only): ``indexer.json`` (H200, B = b, live length c);
  - the dense FP8 projections (q_a, q_b, kv, o, shared expert, indexer projections: ~112M parameters a layer at
    the pinned SGLang's DeepSeekV4Config defaults), split over t GPUs, at ``DENSE_BW_EFF`` of the bandwidth or
    ``MFU`` of the FP8 peak, whichever is slower;
  - two TP all-reduces of 2b x 4096 bf16 values over PCIe;
plus the LM head (129280 x 4096 bf16, split over t), the MTP draft layer (one more layer at T = b) and a fixed
per-step overhead. A kernel time measured on the H200 is moved to the RTX PRO 6000 by splitting it into its byte
floor, which scales with memory bandwidth, and the rest (latency, launch, instruction-bound work), taken as equal.

Prefill of a batch of b prompts of L tokens at TP t: 2 x active parameters FLOPs per token plus sparse attention
and the indexer's L/4 compressed keys per query, at ``MFU`` of the FP8 peak of t GPUs, plus two ring all-reduces
of L x b x 4096 bf16 values per layer over PCIe, plus a fixed overhead.

Run: ``python3 benchmarks/dsv4_profile.py`` (writes deploy/profiles/dsv4-flash-rtxpro6000.json).
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
OUT = REPO / "deploy" / "profiles" / "dsv4-flash-rtxpro6000.json"

# ---- published figures and the pinned SGLang's model config ------------------------------------------------------
RTX_BW = 1.792e12  # B/s, GDDR7 (NVIDIA RTX PRO 6000 Blackwell, announced GTC 2025: 96 GB, 512-bit, 28 Gbps)
RTX_MEM = 96e9  # B per GPU, same source
RTX_FP8 = 1.0e15  # FLOP/s dense FP8: NVIDIA's 4000 AI TOPS (FP4, with sparsity) / 2 (sparsity) / 2 (FP4 -> FP8)
H200_BW_MLA_IDX = 4.8e12  # B/s: the floor the sparse-MLA and indexer benchmarks state (their .md)
H200_BW_MOE = 4.3e12  # B/s: the floor the MXFP4 MoE benchmark states (mxfp4_moe.md)
PCIE_BW = 40e9  # B/s all-reduce bus bandwidth, assumed: PCIe 5.0 x16 is 64 GB/s a direction, ~63% achieved
ALLREDUCE_LAT = 20e-6  # s per small all-reduce over PCIe (no NVLink on this card), assumed
DENSE_BW_EFF = 0.70  # fraction of bandwidth the dense FP8 GEMMs reach at decode batch sizes, assumed (the MoE
#                      kernel measured 62-76% of its floor, mxfp4_moe.md)
MFU = 0.40  # fraction of the FP8 peak prefill GEMMs reach, assumed
STEP_OVERHEAD = 0.5e-3  # s per decode step: scheduling, sampling, CUDA-graph launch; assumed
PREFILL_OVERHEAD = 5e-3  # s per prefill batch; assumed
MEM_FRACTION = 0.85  # deploy/dsv4-flash-rtxpro6000x8.yaml mem_fraction_static
# pinned SGLang sglang/srt/configs/deepseek_v4.py DeepSeekV4Config defaults
LAYERS, HIDDEN, HEADS, VOCAB = 43, 4096, 64, 129280
EXPERTS, TOPK, MOE_INTER, SHARED = 256, 6, 2048, 1
Q_LORA, NOPE, ROPE, V_HEAD, O_LORA, O_GROUPS = 1024, 448, 64, 512, 1024, 8
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 64, 128, 512
C4_LAYERS = 21  # layers with the C4 indexer, assumed: the checkpoint's compress_ratios decide
KV_BYTES_PER_TOKEN_LAYER = 584  # FP8 paged KV record (docs: 448 fp8 nope + 64 bf16 rope + scales)
ACCEPT_RATE = 0.875  # MTP second-token acceptance: DeepSeek-V3 technical report (arXiv 2412.19437), 85-90%
KV_TRANSFER_BW, KV_TRANSFER_LAT = 1.5e9, 2e-3  # Mooncake TCP on one box, assumed from kv_transfer.md (1.5-1.7 GB/s)

EXPERT_PARAMS = 3 * HIDDEN * MOE_INTER
DENSE_PARAMS = (HIDDEN * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + HIDDEN * V_HEAD  # q_a, q_b, kv
                + HEADS * V_HEAD * O_LORA // O_GROUPS + O_GROUPS * O_LORA * HIDDEN  # grouped o projection
                + SHARED * EXPERT_PARAMS  # the shared expert
                + Q_LORA * INDEX_HEADS * INDEX_DIM + HIDDEN * INDEX_DIM + HIDDEN * INDEX_HEADS)  # indexer q, k, w
WEIGHT_BYTES = (LAYERS * EXPERTS * EXPERT_PARAMS * 4.25 / 8  # MXFP4: 4 bits + a UE8M0 scale per 32
                + LAYERS * DENSE_PARAMS + 2 * VOCAB * HIDDEN * 2)  # FP8 dense, bf16 embedding + LM head
DRAFT_BYTES = EXPERTS * EXPERT_PARAMS * 4.25 / 8 + DENSE_PARAMS  # the MTP layer (embedding and head shared)
ACTIVE_PARAMS = LAYERS * (DENSE_PARAMS + TOPK * EXPERT_PARAMS)


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear through sorted points, extrapolated along the end segments (kernel tables are monotone)."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def on_rtx(us: float, floor_us: float, h200_bw: float, share: float = 1.0) -> float:
    """An H200 kernel time (us) on one RTX PRO 6000 GPU that reads ``share`` of its bytes: the byte floor scales
    with bandwidth, the rest stays."""
    return (floor_us * share * h200_bw / RTX_BW + (us - floor_us)) * 1e-6


class Kernels:
    """The three kernel tables of benchmarks/results, H200 microseconds, as functions."""

    def __init__(self):
        moe = json.loads((RESULTS / "mxfp4_moe.json").read_text())["timing"]
        self.moe = ([r["T"] for r in moe], [r["median_us"]["tiled"] for r in moe], [r["floor_us_4p3"] for r in moe])
        self.mla = {}
        for r in json.loads((RESULTS / "sparse_mla_decode.json").read_text())["timing"]:
            self.mla.setdefault((r["H"], r["S"]), []).append((r["B"], r["ours_default_us"], r["floor_us"]))
        self.idx = {}
        for r in json.loads((RESULTS / "indexer.json").read_text())["timing"]:
            if r["query"] == "fp8" and r["max_ctx"] == 131072:
                self.idx.setdefault(r["B"], []).append((r["live"], r["ours_us"], r["floor_us"]))

    def moe_s(self, tokens: float, tp: int) -> float:
        ts, us, fl = self.moe
        return on_rtx(interp(ts, us, tokens), interp(ts, fl, tokens), H200_BW_MOE, 1 / tp)

    def mla_s(self, batch: float, heads: float, s: int = 2) -> float:
        def at(h: int) -> tuple[float, float]:
            rows = sorted(self.mla[(h, s)])
            b = [r[0] for r in rows]
            return interp(b, [r[1] for r in rows], batch), interp(b, [r[2] for r in rows], batch)

        (u16, f16), (u64, f64) = at(16), at(64)
        floor = f16 * heads / 16  # bytes grow with the heads
        rest = (u16 - f16) + max(0.0, heads - 16) * ((u64 - f64) - (u16 - f16)) / 48
        return on_rtx(floor + rest, floor, H200_BW_MLA_IDX)

    def indexer_s(self, batch: float, live: float) -> float:
        def at(b: int) -> tuple[float, float]:
            rows = sorted(self.idx[b])
            x = [r[0] for r in rows]
            return interp(x, [r[1] for r in rows], live), interp(x, [r[2] for r in rows], live)

        (u16, f16), (u64, f64) = at(16), at(64)
        b = max(batch, 16.0)
        us, fl = u16 + (u64 - u16) * (b - 16) / 48, f16 + (f64 - f16) * (b - 16) / 48
        if batch < 16:  # below the table: the per-sequence bytes shrink, the fixed part stays
            us, fl = us - fl * (1 - batch / 16), fl * batch / 16
        return on_rtx(us, fl, H200_BW_MLA_IDX)


def allreduce_s(nbytes: float, tp: int) -> float:
    return ALLREDUCE_LAT + 2 * (tp - 1) / tp * nbytes / PCIE_BW  # ring all-reduce


def dense_s(tokens: float, params: float, tp: int) -> float:
    mem = params / tp / (RTX_BW * DENSE_BW_EFF)
    flops = 2 * params * tokens / tp / (RTX_FP8 * MFU)
    return max(mem, flops)


def decode_step_s(k: Kernels, batch: int, context: int, tp: int) -> float:
    """One verify step (2 tokens per sequence through the target) plus the draft layer, seconds."""
    t = 2 * batch
    layer = (k.moe_s(t, tp) + k.mla_s(batch, HEADS / tp) + dense_s(t, DENSE_PARAMS, tp)
             + 2 * allreduce_s(t * HIDDEN * 2, tp))
    attn_idx = C4_LAYERS * k.indexer_s(batch, context)
    head = dense_s(t, VOCAB * HIDDEN * 2, tp)  # bf16 head: 2 bytes a weight
    draft = (k.moe_s(batch, tp) + k.mla_s(batch, HEADS / tp, 1) + dense_s(batch, DENSE_PARAMS, tp)
             + 2 * allreduce_s(batch * HIDDEN * 2, tp) + dense_s(batch, VOCAB * HIDDEN * 2, tp))
    return LAYERS * layer + attn_idx + head + draft + STEP_OVERHEAD


def prefill_s(batch: int, length: int, tp: int) -> float:
    tokens = batch * length
    attn = LAYERS * HEADS * INDEX_TOPK * (NOPE + ROPE + V_HEAD) * 2  # sparse attention FLOPs per token
    indexer = C4_LAYERS * INDEX_HEADS * INDEX_DIM * 2 * (length / 2) / 4  # mean L/2 earlier tokens, C4-compressed
    flops = tokens * (2 * ACTIVE_PARAMS + attn + indexer)
    comm = LAYERS * 2 * allreduce_s(tokens * HIDDEN * 2, tp)
    return flops / (tp * RTX_FP8 * MFU) + comm + PREFILL_OVERHEAD


def build() -> dict:
    k = Kernels()
    kvb = LAYERS * KV_BYTES_PER_TOKEN_LAYER
    model = "benchmarks/dsv4_profile.py model (module docstring)"
    tp_entries = {}
    for tp in (2, 4):
        free = tp * RTX_MEM * MEM_FRACTION - WEIGHT_BYTES - DRAFT_BYTES
        prefill = [{"batch_size": b, "input_len": L, "seconds": prefill_s(b, L, tp), "source": model}
                   for b in (1, 2, 4, 8) for L in (512, 1024, 2048, 4096, 8192, 16384, 32768) if b * L <= 32768]
        decode = [{"batch_size": b, "context_len": c, "seconds": decode_step_s(k, b, c, tp), "source": model}
                  for b in (1, 4, 16, 32, 64, 128) for c in (2048, 8192, 32768)]
        tp_entries[str(tp)] = {
            "prefill": {"points": prefill, "max_batch_size": 256, "max_batch_tokens": 8192,
                        "source": "FLOPs of DeepSeekV4Config at MFU of the FP8 peak + PCIe all-reduces; "
                                  "max_batch_tokens = --chunked-prefill-size 8192 (assumed; set it so on the servers)"},
            "decode": {"points": decode, "max_batch_size": 128, "max_kv_tokens": int(free / kvb),
                       "tokens_per_step": 1 + ACCEPT_RATE,
                       "tokens_per_step_source": "MTP with 1 draft token (deploy config): 1 + second-token acceptance "
                                                 "0.875 (DeepSeek-V3 technical report, 85-90%)",
                       "source": "kernel results (mxfp4_moe.json, sparse_mla_decode.json, indexer.json) moved to "
                                 "GDDR7 bandwidth + dense GEMMs + PCIe all-reduces; max_batch_size 128 (CUDA graphs "
                                 "to 64 in the deploy config, SGLang's DSv4 max_running_requests 256); max_kv_tokens ="
                                 f" ({tp} x 96 GB x {MEM_FRACTION} - {WEIGHT_BYTES / 1e9:.0f} GB weights - "
                                 f"{DRAFT_BYTES / 1e9:.1f} GB draft) / {kvb} B"},
        }
    return {
        "schema": "pdserve-profile/1",
        "name": "DeepSeek-V4-Flash on 8x RTX PRO 6000 Blackwell (modelled: kernel benchmarks, published figures)",
        "model": "/models/DeepSeek-V4-Flash", "engine": "sglang",
        "hardware": "8x NVIDIA RTX PRO 6000 Blackwell (sm_120, 96 GB GDDR7, PCIe 5.0, no NVLink), one box",
        "date": "modelled, not measured",
        "notes": [
            "Built by benchmarks/dsv4_profile.py; replace it with `pdserve profile --url ...` on the box.",
            f"GDDR7 {RTX_BW / 1e12:.3f} TB/s, 96 GB, FP8 dense {RTX_FP8 / 1e15:g} PFLOP/s: NVIDIA's announced figures "
            "(GTC 2025; 4000 AI TOPS FP4 with sparsity halved twice)",
            "kernel times: benchmarks/results/{mxfp4_moe,sparse_mla_decode,indexer}.json (H200), byte floor scaled "
            f"by bandwidth ({H200_BW_MOE / 1e12:g} / {H200_BW_MLA_IDX / 1e12:g} TB/s -> {RTX_BW / 1e12:.3f}), the rest "
            "kept",
            "model shape: the pinned SGLang's DeepSeekV4Config defaults (43 layers, hidden 4096, 64 heads, 256 experts "
            f"top-6, intermediate 2048, vocab 129280); {DENSE_PARAMS / 1e6:.0f}M dense + "
            f"{TOPK * EXPERT_PARAMS / 1e6:.0f}M routed parameters active a layer, {ACTIVE_PARAMS / 1e9:.1f}B a token",
            f"assumed: C4 (indexer) layers {C4_LAYERS} of 43; dense GEMMs at {DENSE_BW_EFF:.0%} of bandwidth; prefill "
            f"at {MFU:.0%} MFU; PCIe all-reduce {PCIE_BW / 1e9:g} GB/s bus + {ALLREDUCE_LAT * 1e6:g} us; "
            f"{STEP_OVERHEAD * 1e3:g} ms per decode step, {PREFILL_OVERHEAD * 1e3:g} ms per prefill batch",
            f"weights: {WEIGHT_BYTES / 1e9:.0f} GB (MXFP4 experts + FP8 dense + bf16 embedding and head) + "
            f"{DRAFT_BYTES / 1e9:.1f} GB MTP layer: TP 1 does not fit a 96 GB card, so TP sizes 2 and 4",
        ],
        "kv_bytes_per_token": kvb,
        "kv_bytes_per_token_source": f"{KV_BYTES_PER_TOKEN_LAYER} B FP8 KV record per token per layer x {LAYERS} "
                                     "layers: an upper bound (compressed C4/C128 layers store fewer)",
        "transfer": {"bandwidth_gb_s": KV_TRANSFER_BW / 1e9, "latency_s": KV_TRANSFER_LAT,
                     "source": "Mooncake over TCP on one box (deploy config: no RDMA NIC), assumed at the engine "
                               "handoff rate measured on the CPU machine (benchmarks/results/kv_transfer.md, 1.5-1.7 "
                               "GB/s)"},
        "tp": tp_entries,
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    profile = build()
    OUT.write_text(json.dumps(profile, indent=1) + "\n")
    for tp, e in profile["tp"].items():
        p = {(x["batch_size"], x["input_len"]): x["seconds"] for x in e["prefill"]["points"]}
        d = {(x["batch_size"], x["context_len"]): x["seconds"] for x in e["decode"]["points"]}
        print(f"TP{tp}: prefill 8K {1e3 * p[(1, 8192)]:.0f} ms; decode step b=1/32/128 at 8K "
              f"{1e3 * d[(1, 8192)]:.1f}/{1e3 * d[(32, 8192)]:.1f}/{1e3 * d[(128, 8192)]:.1f} ms; "
              f"KV room {e['decode']['max_kv_tokens']} tokens")
    print(f"wrote {OUT}")
