"""The ``pdserve`` command line."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand: ``target`` is ``"module:function"``, called with the remaining argv; its return value is
    the exit status (None = 0). ``usage`` is its line(s) in ``pdserve --help``; ``needs`` the packages of
    optional extras it imports: (module, extra, what to install)."""

    name: str
    target: str
    usage: str
    needs: tuple[tuple[str, str, str], ...] = ()


_ENGINE = (("torch", "engine", "'pdserve[cpu]'"), ("transformers", "engine", "'pdserve[cpu]'"))
COMMANDS = (
    Command("up", "pd.cluster.up:main", "run the whole PD cluster here (Ray job + router); Ctrl-C stops it "
            "(`pdserve up [CONFIG]`)", (("ray", "cluster", "'pdserve[cpu]' (or 'pdserve[gpu]' on GPU nodes)"),)),
    Command("plan", "pd.tools.plan:main", "dry run of a config: workers, GPUs, ports, engine argv and env "
            "(`pdserve plan CONFIG [--json]`)"),
    Command("doctor", "pd.tools.doctor:main", "preflight checks of a config; exit 1 on errors "
            "(`pdserve doctor CONFIG [--assume-gpu sm_120] [--json]`)"),
    Command("engine", "pd.engines.api.server:main", "run the reference engine alone (SGLang's flags; see "
            "`pdserve engine --help`)", _ENGINE),
    Command("router", "pd.router.cli:main", "run the PD router alone, for engines started by hand (see "
            "`pdserve router --help`)"),
    Command("diagnose", "pd.tools.diagnose:main", "root cause of a failed engine start or crash from its logs "
            "(`pdserve diagnose LOG [LOG...]`)"),
    Command("model-path", "pd.cli:model_path_main", "the local checkpoint directory of a model path, e.g. "
            "builtin:tiny's (written on first use), for clients that load its tokenizer "
            "(`pdserve model-path builtin:tiny`)", _ENGINE),
    Command("render-dashboard", "pd.monitoring.render:main", "the PD overview's latency panels as a PNG from "
            "Prometheus (`pdserve render-dashboard --prometheus URL --out FILE.png [--range 15m]`)",
            (("matplotlib", "monitoring", "'pdserve[monitoring]'"),)),
    # matplotlib is optional for bench: without it the run skips its PNG and says which extra adds it.
    Command("bench", "pd.bench.cli:main", "open-loop serving benchmark: TTFT/ITL/TPOT/E2E, goodput at SLOs, PD "
            "stage split (flags follow `sglang.bench_serving`'s; see `pdserve bench --help`)",
            (("torch", "engine", "'pdserve[bench]'"), ("transformers", "engine", "'pdserve[bench]'"),
             ("aiohttp", "bench", "'pdserve[bench]'"))),
    Command("profile", "pd.planner.measure:main", "measure a running engine's prefill, decode and KV-transfer "
            "costs as a planner profile JSON (`pdserve profile --url URL --output FILE [--pd-url ROUTER ...]`; "
            "see `pdserve profile --help`)"),
    Command("plan-split", "pd.planner.cli:main", "the prefill/decode split of a GPU budget that serves a "
            "workload best, from a profile (`pdserve plan-split --profile P --num-gpus N --request-rate R "
            "--slo-ttft-ms T --slo-tpot-ms T`)"),
)
BY_NAME = {c.name: c for c in COMMANDS}


def _usage() -> str:
    width = max(len(c.name) for c in COMMANDS)
    lines = ["usage: pdserve COMMAND [ARGS]   (pdserve --version: the installed version)", "", "commands:"]
    for c in COMMANDS:
        wrapped = textwrap.wrap(c.usage, 108 - width, break_on_hyphens=False)
        lines.append(f"  {c.name:<{width}}  {wrapped[0]}")
        lines += [" " * (width + 4) + w for w in wrapped[1:]]
    return "\n".join(lines) + "\n"


USAGE = _usage()


def _require_extras(cmd: str) -> None:
    """Exit with status 2 and the pip command when ``cmd`` needs a package of an extra that is not installed
    (the base install is the router and the tools only)."""
    for module, extra, install in BY_NAME[cmd].needs:
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
    command = BY_NAME.get(cmd)
    if command is None:
        print(f"pdserve: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    _require_extras(cmd)
    module, function = command.target.split(":")
    status = getattr(importlib.import_module(module), function)(rest)
    raise SystemExit(status or 0)


def model_path_main(argv: list[str]) -> int:
    """``pdserve model-path MODEL_PATH``: print the local checkpoint directory (builtin models are written on
    first use); 2 with a message for a bad argument or an unknown model path."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: pdserve model-path MODEL_PATH   (e.g. builtin:tiny)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from pd.engines.models.builtin_model import resolve_model_path

    try:
        print(resolve_model_path(argv[0]))
    except ValueError as e:
        print(f"pdserve model-path: {e}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    main()
