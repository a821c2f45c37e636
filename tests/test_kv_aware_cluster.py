"""A launched cluster whose router routes prefills with kv_aware has its prefills publish KV events: each
prefill worker reserves a PUB and a replay port and passes ``--kv-events-config`` (SGLang's flag and JSON)."""

import json

from pd.cluster.worker import EngineWorker
from pd.config import load_config


def worker(role: str, prefill_policy: str | None, engine: str = "reference", extra: tuple = ()) -> EngineWorker:
    """An EngineWorker as the actor builds it, without Ray (only what port reservation and commands read)."""
    cfg = load_config()
    group = cfg.groups()[role].model_copy(update={"extra_args": list(extra)})
    cfg = cfg.model_copy(update={"engine": engine, role: group,
                                 "router": cfg.router.model_copy(update={"prefill_policy": prefill_policy})})
    w = EngineWorker.__new__(EngineWorker)
    w.name, w.role, w.cfg, w.host, w.api_key, w.key_dir = f"{role}-0", role, cfg, "127.0.0.1", None, None
    w.port = w.bootstrap_port = w.kv_events_ports = w.proc = w.last_exit = w.diagnosis = None
    w.state, w.restarts, w._ready_line_seen, w.cuda_visible_devices, w.node_id = "created", 0, False, "", "n"
    return w


def events_config(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--kv-events-config") + 1]) if "--kv-events-config" in argv else None


async def test_a_kv_aware_prefill_publishes_on_ports_of_its_own():
    w = worker("prefill", "kv_aware")
    info = await w.reserve_ports([40000])
    pub, replay = info["kv_events_ports"]
    assert len({info["port"], info["bootstrap_port"], pub, replay, 40000}) == 5
    assert events_config(w._command().argv) == {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
                                                 "bind": True, "replay_endpoint": f"tcp://127.0.0.1:{replay}"}


async def test_no_events_without_kv_aware_on_decodes_or_when_extra_args_set_them():
    for w in (worker("prefill", "cache_aware"), worker("decode", None),
              worker("prefill", "kv_aware", extra=("--kv-events-config", '{"publisher": "zmq"}'))):
        info = await w.reserve_ports([])
        assert info["kv_events_ports"] is None
        assert events_config(w._command().argv) in (None, {"publisher": "zmq"})


async def test_sglang_prefills_get_the_same_flag_and_parse_it():
    from pd.commands.sglang import parse_sglang_args

    w = worker("prefill", "kv_aware", engine="sglang")
    await w.reserve_ports([])
    cmd = w._command()
    pub, _ = w.kv_events_ports
    assert events_config(cmd.argv)["endpoint"] == f"tcp://127.0.0.1:{pub}"  # the engine's address, bound
    args = parse_sglang_args(cmd.argv[cmd.args_start:])
    assert json.loads(args.kv_events_config)["endpoint"] == f"tcp://127.0.0.1:{pub}"
