"""``pdserve bench``: the command line of pd.bench (flags generated from pd.bench.config.BenchConfig).

Exit status: 0 done; 1 the run could not start (server down, no tokenizer, warm-up failed); 2 a bad flag
(argparse's usage error naming it); 130 interrupted (the results measured until then are written).

SIGINT interrupts a run however it was started: a shell starts a background job (``pdserve bench ... &`` in a
script, ``nohup``'d batch runs) with SIGINT ignored, and Python keeps an inherited "ignore", so ``kill -INT PID``
would do nothing; :func:`main` puts Python's handler back first.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from pd.bench.config import BenchConfig, add_arguments

EPILOG = """examples:
  pdserve bench --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 512 \\
      --random-output-len 64 --random-input-dist lognormal --num-prompts 200 --request-rate 1,2,4,8 \\
      --slo-ttft-ms 500 --slo-tpot-ms 50 --output-file bench.json      (bench.png beside it)
  pdserve bench --base-url http://127.0.0.1:8000 --max-concurrency 16 --num-prompts 256
      (the shipped synthetic ShareGPT-format file; --dataset-path FILE for your own)
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve bench`` parser."""
    parser = argparse.ArgumentParser(
        prog="pdserve bench", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Open-loop serving benchmark (TTFT, ITL, TPOT, E2E, goodput at SLOs, per-stage split behind a "
                    "pdserve router), driving SGLang's benchmark request functions. Flag names follow "
                    "`python -m sglang.bench_serving`.")
    add_arguments(parser)
    return parser


def interrupt_on_sigint() -> None:
    """Make SIGINT raise ``KeyboardInterrupt`` (Python's own handler) when it is ignored or at the OS default, as
    in a background job; a handler the caller installed is kept. Off the main thread (where Python cannot set
    handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    """Run ``pdserve bench ARGV``; returns the exit status (see the module docstring)."""
    interrupt_on_sigint()
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = BenchConfig.from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    from pd.bench.run import BenchError, run_bench

    try:
        run_bench(cfg)
    except ImportError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    except (BenchError, ValueError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve bench: interrupted; the results above are the requests finished before it", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
