"""``pdserve plan CONFIG [--json]``: the dry run of a deployment.

Lists every worker with its GPUs, ports and the full engine argv and env, exactly as the worker
actors will run them. Ports are picked free on each node at launch; the plan shows the values a
fresh single node would get (HTTP 30000 + i, bootstrap 8998 + i) so the argv is complete. For the
sglang engine every argv is parsed with the pinned SGLang's own parser, so a flag SGLang does not
know (say, one renamed between releases) fails here, naming the flag and its candidates.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Optional

from pd.commands.build import engine_command
from pd.config import ConfigError, PDConfig, load_config

EXAMPLE_PORT, EXAMPLE_BOOTSTRAP_PORT = 30000, 8998


def plan(cfg: PDConfig, host: str = "127.0.0.1") -> list[dict]:
    """One entry per worker: name, role, tp_size, gpus, host, port, bootstrap_port, argv, env.

    Raises:
        SGLangArgError: an argv the pinned SGLang parser refuses (sglang engine).
    """
    workers = []
    k = 0
    for role, group in cfg.groups().items():
        for i in range(group.replicas):
            port = EXAMPLE_PORT + k
            bport = EXAMPLE_BOOTSTRAP_PORT + i if role == "prefill" else None
            cmd = engine_command(cfg, role, host, port, bport)
            if cfg.engine == "sglang":
                from pd.commands.sglang import server_args_of

                server_args_of(cmd)
            workers.append({
                "name": f"{role}-{i}", "role": role, "tp_size": group.tp_size,
                "gpus": group.gpus[i] if group.gpus is not None else f"{group.tp_size} assigned by Ray",
                "host": host, "port": port, "bootstrap_port": bport,
                "argv": cmd.argv, "env": cmd.env, "ready_path": cmd.ready_path,
            })
            k += 1
    return workers


def render(cfg: PDConfig, workers: list[dict]) -> str:
    """Human-readable plan: one block per worker with its GPUs, ports, ready path, env and argv."""
    lines = [f"engine: {cfg.engine}   model: {cfg.model_path}   router: {cfg.router.host}:{cfg.router.port}",
             "(ports are picked free at launch; shown: what a fresh node gets)", ""]
    for w in workers:
        lines.append(f"{w['name']}: GPUs {w['gpus']}, http {w['host']}:{w['port']}"
                     + (f", bootstrap {w['bootstrap_port']}" if w["bootstrap_port"] else "")
                     + f", ready at {w['ready_path']}")
        lines.append("  env: " + (" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(w["env"].items())) or "-"))
        lines.append("  " + shlex.join(w["argv"]))
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``pdserve plan [CONFIG] [--json]``: print the plan; returns 2 for a bad config, else 0."""
    p = argparse.ArgumentParser(prog="pdserve plan", description="Dry run: workers, GPUs, ports, engine argv and env.")
    p.add_argument("config", nargs="?", help="cluster config YAML (default: deploy/local.yaml)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        workers = plan(cfg)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(workers, indent=2) if args.json else render(cfg, workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
