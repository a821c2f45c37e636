"""A stand-in for ``python -m sglang.launch_server`` so CI can drive the SGLang worker path
(spawn -> readiness -> crash -> diagnosis -> restart) without SGLang or a GPU.

It accepts SGLang's flags (parsed with parse_known_args), writes SGLang-shaped multi-rank logs and
behaves per scenario. ``FAKE_SGLANG_SCENARIO`` is a comma-separated list, one entry per start of
the server (the count is kept in ``FAKE_SGLANG_STATE``; the last entry repeats):

- ``ready``: loads, answers /health and /health_generate, prints the ready line, serves forever.
- ``crash_at_start``: every TP rank fails loading the draft MoE with an sm_100-only kernel
  ("no kernel image is available"), the parent reports SIGQUIT from a child, exit 1.
- ``crash_later``: becomes ready, then after ``FAKE_SGLANG_CRASH_AFTER`` seconds (default 1) TP2
  runs out of memory during a decode step; the parent gets SIGQUIT and exits with 1.
- ``hang``: prints loading lines and never becomes ready.

Like SGLang, it logs its ``server_args`` at start as the dict SGLang prints (``server_args={...}``,
sglang/srt/entrypoints/engine.py), ``api_key`` in clear: read from ``--api-key`` or the ``api-key`` of the
``--config`` file (SGLang merges the file's keys into its flags).
"""

import argparse
import http.server
import json
import os
import sys
import threading
import time


def log(rank, msg):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    prefix = f"[{stamp} TP{rank}]" if rank is not None else f"[{stamp}]"
    print(f"{prefix} {msg}", flush=True)


def scenario() -> str:
    steps = os.environ.get("FAKE_SGLANG_SCENARIO", "ready").split(",")
    state = os.environ.get("FAKE_SGLANG_STATE")
    n = 0
    if state:
        try:
            n = int(open(state).read() or 0)
        except FileNotFoundError:
            n = 0
        with open(state, "w") as f:
            f.write(str(n + 1))
    return steps[min(n, len(steps) - 1)].strip()


def load(tp):
    for r in range(tp):
        log(r, "Init torch distributed begin.")
    for r in range(tp):
        log(r, "Load weight begin. avail mem=94.12 GB")
    for r in range(tp):
        log(r, "Load weight end. type=DeepseekV4ForCausalLM, dtype=torch.bfloat16, avail mem=61.40 GB, "
               "mem usage=32.72 GB.")


def crash_at_start(tp):
    load(tp)
    for r in range(tp):
        log(r, "Scheduler hit an exception: Traceback (most recent call last):\n"
               '  File "/opt/sglang/python/sglang/srt/managers/scheduler.py", line 3121, in run_scheduler_process\n'
               "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)\n"
               '  File "/opt/sglang/python/sglang/srt/speculative/eagle_worker.py", line 188, in __init__\n'
               "    self.draft_model_runner.init_moe()\n"
               '  File "/opt/sglang/python/sglang/srt/layers/moe/flashinfer_trtllm.py", line 412, in launch\n'
               "    trtllm_fp4_block_scale_moe_sm100(hidden, weights)\n"
               "RuntimeError: CUDA error: no kernel image is available for execution on the device\n")
    log(None, "Received sigquit from a child process. It usually means the child failed.")
    sys.exit(1)


def crash(rank):
    log(rank, "Scheduler hit an exception: Traceback (most recent call last):\n"
              '  File "/opt/sglang/python/sglang/srt/managers/scheduler.py", line 1456, in event_loop_normal\n'
              "    result = self.run_batch(batch)\n"
              '  File "/opt/sglang/python/sglang/srt/model_executor/model_runner.py", line 2210, in forward_decode\n'
              "    return self.model.forward(input_ids, positions, forward_batch)\n"
              "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 2 has a total capacity "
              "of 95.00 GiB of which 1.12 GiB is free.\n")
    log(None, "Received sigquit from a child process. It usually means the child failed.")
    os._exit(1)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path in ("/health", "/health_generate", "/v1/models"):
            self.send_response(200)
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--disaggregation-mode", default="null")
    p.add_argument("--api-key")
    p.add_argument("--admin-api-key")
    p.add_argument("--config")
    args, _ = p.parse_known_args()
    if args.config:
        with open(args.config) as f:
            args.api_key = json.load(f).get("api-key", args.api_key)
    what = scenario()
    server_args = {"model_path": "/models/none", "host": args.host, "port": args.port, "tp_size": args.tp_size,
                   "disaggregation_mode": args.disaggregation_mode, "ssl_keyfile_password": None,
                   "api_key": args.api_key, "admin_api_key": args.admin_api_key, "max_total_tokens": None}
    log(None, f"server_args={server_args}")
    log(None, f"scenario={what}")
    if what == "crash_at_start":
        crash_at_start(args.tp_size)
    load(args.tp_size)
    if what == "hang":
        while True:
            time.sleep(1)
    server = http.server.ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)", flush=True)
    log(None, "The server is fired up and ready to roll!")
    if what == "crash_later":
        time.sleep(float(os.environ.get("FAKE_SGLANG_CRASH_AFTER", "1")))
        crash(min(2, args.tp_size - 1))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
