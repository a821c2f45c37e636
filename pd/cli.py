"""The ``pdserve`` command line."""

from __future__ import annotations

import importlib.util
import os
import sys

USAGE = """usage: pdserve COMMAND [ARGS]   (pdserve --version: the installed version)

commands:
  up         run the whole PD cluster here (Ray job + router); Ctrl-C stops it (`pdserve up [CONFIG]`)
  plan       dry run of a config: workers, GPUs, ports, engine argv and env (`pdserve plan CONFIG [--json]`)
  doctor     preflight checks of a config; exit 1 on errors (`pdserve doctor CONFIG [--assume-gpu sm_120] [--json]`)
  engine     run the reference engine alone (SGLang's flags; see `pdserve engine --help`)
  router     run the PD router alone, for engines started by hand (see `pdserve router --help`)
  diagnose   root cause of a failed engine start or crash from its logs (`pdserve diagnose LOG [LOG...]`)
  model-path the local checkpoint directory of a model path, e.g. builtin:tiny's (written on first use), for
             clients that load its tokenizer (`pdserve model-path builtin:tiny`)
  render-dashboard  the PD overview's latency panels as a PNG from Prometheus
             (`pdserve render-dashboard --prometheus URL --out FILE.png [--range 15m]`)
  bench      open-loop serving benchmark: TTFT/ITL/TPOT/E2E, goodput at SLOs, PD stage split (flags follow
             `sglang.bench_serving`'s; see `pdserve bench --help`)
  profile    measure a running engine's prefill, decode and KV-transfer costs as a planner profile JSON
             (`pdserve profile --url URL --output FILE [--pd-url ROUTER ...]`; see `pdserve profile --help`)
  plan-split the prefill/decode split of a GPU budget that serves a workload best, from a profile
             (`pdserve plan-split --profile P --num-gpus N --request-rate R --slo-ttft-ms T --slo-tpot-ms T`)
"""


# Subcommands that need an optional extra (pyproject.toml): (module, extra, what to install).
_NEEDS = {
    "up": [("ray", "cluster", "'pdserve[cpu]' (or 'pdserve[gpu]' on GPU nodes)")],
    "engine": [("torch", "engine", "'pdserve[cpu]'"), ("transformers", "engine", "'pdserve[cpu]'")],
    "model-path": [("torch", "engine", "'pdserve[cpu]'"), ("transformers", "engine", "'pdserve[cpu]'")],
    "render-dashboard": [("matplotlib", "monitoring", "'pdserve[monitoring]'")],
    # matplotlib is optional here: without it the run skips its PNG and says which extra adds it.
    "bench": [("torch", "engine", "'pdserve[bench]'"), ("transformers", "engine", "'pdserve[bench]'"),
              ("aiohttp", "bench", "'pdserve[bench]'")],
}


def _require_extras(cmd: str) -> None:
    """Exit with status 2 and the pip command when ``cmd`` needs a package of an extra that is not installed
    (the base install is the router and the tools only)."""
    for module, extra, install in _NEEDS.get(cmd, []):
        if importlib.util.find_spec(module) is None:
            print(f"pdserve {cmd}: needs the {extra!r} extra ({module} is not installed): pip install {install}",
                  file=sys.stderr)
            raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``pdserve SUBCOMMAND ...`` to its module's ``main``; exits with that status
    (2 for an unknown subcommand). A reader that goes away (``pdserve plan --json | head``) ends the
    command quietly with status 1 instead of a BrokenPipeError traceback."""
    try:
        _dispatch(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def _dispatch(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"pdserve {version('pdserve')}")
        raise SystemExit(0)
    cmd, rest = argv[0], argv[1:]
    _require_extras(cmd)
    if cmd == "up":
        from pd.cluster.up import main as up_main

        raise SystemExit(up_main(rest))
    if cmd == "plan":
        from pd.tools.plan import main as plan_main

        raise SystemExit(plan_main(rest))
    if cmd == "doctor":
        from pd.tools.doctor import main as doctor_main

        raise SystemExit(doctor_main(rest))
    if cmd == "diagnose":
        from pd.tools.diagnose import main as diagnose_main

        raise SystemExit(diagnose_main(rest))
    if cmd == "render-dashboard":
        from pd.monitoring.render import main as render_main

        raise SystemExit(render_main(rest))
    if cmd == "profile":
        from pd.planner.measure import main as profile_main

        raise SystemExit(profile_main(rest))
    if cmd == "plan-split":
        from pd.planner.cli import main as plan_split_main

        raise SystemExit(plan_split_main(rest))
    if cmd == "bench":
        from pd.bench.cli import main as bench_main

        raise SystemExit(bench_main(rest))
    if cmd == "model-path":
        if len(rest) != 1 or rest[0].startswith("-"):
            print("usage: pdserve model-path MODEL_PATH   (e.g. builtin:tiny)", file=sys.stderr)
            raise SystemExit(0 if rest[:1] in (["-h"], ["--help"]) else 2)
        from pd.engines.builtin_model import resolve_model_path

        try:
            print(resolve_model_path(rest[0]))
        except ValueError as e:
            print(f"pdserve model-path: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(0)
    if cmd == "engine":
        from pd.engines.server import main as engine_main

        engine_main(rest)
    elif cmd == "router":
        from pd.router.cli import main as router_main

        router_main(rest)
    else:
        print(f"pdserve: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
