"""The worker actor: supervises one engine process (prefill or decode) on the GPUs Ray gave it.

One Ray actor per engine instance, placed in that worker's placement group. It picks free ports
on its node, starts the engine as a child process (which dies with the actor), forwards the
engine's log to the job log as ``[prefill-0] ...`` (secrets redacted: pd.util.redact; SGLang logs its
``server_args`` with ``api_key`` in clear), waits for readiness, and restarts the engine
with bounded exponential backoff when it exits unexpectedly. ``info()`` reports its state.

States: ``created`` -> ``starting`` -> ``ready``; on a crash ``restarting`` -> ``ready``, or
``failed`` after ``restart.max_restarts``; ``stopped`` after ``stop()``. The split controller moves a worker to
the other role (pd.cluster.split_mover): ``stop_engine()`` -> ``moving``, then ``start_as(role, name)`` ->
``starting`` -> ``ready`` in the new role, in the same actor and placement group.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import tempfile
import time
from typing import Optional

import httpx

from pd.cluster.procs import die_with_parent
from pd.commands.build import engine_command
from pd.commands.command import EngineCommand
from pd.config import PDConfig
from pd.kernels import sglang_plugin as plugin
from pd.util.ports import free_port
from pd.util.redact import redact_text
from pd.util.wait import async_wait_until

LOG_TAIL_LINES = 20000  # engine log lines kept for diagnosis (a TP4 SGLang crash is a few hundred)


class _EngineExited(Exception):
    """The engine process ended while the worker waited for it to become ready."""


def _node_address(ray) -> str:
    """The address Ray knows this node by (``ray start --node-ip-address``), so a single-machine
    cluster started on 127.0.0.1 keeps all traffic on loopback."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class EngineWorker:
    """Ray actor body (wrapped with ``ray.remote`` by the launcher; async, so ``info`` answers
    while an engine starts).

    Args:
        name: e.g. ``prefill-0``; prefixes forwarded log lines.
        role: ``prefill`` or ``decode``.
        config: the PDConfig as a dict (actors get plain data).
        gpu_ids: explicit GPU ids for this replica (config ``gpus``), or None to use Ray's
            CUDA_VISIBLE_DEVICES.
        host: address to listen on; None = this node's Ray IP.
        api_key: the cluster's key the engine requires and the router sends (pd.commands: never on the
            engine's command line; SGLang's key file lives in an owner-only directory removed on stop).
    """

    start_seconds: Optional[float] = None  # the last start, spawn to ready (the split controller's restart time)

    def __init__(self, name: str, role: str, config: dict, gpu_ids: Optional[list[int]] = None,
                 host: Optional[str] = None, api_key: Optional[str] = None):
        import ray

        self.name = name
        self.role = role
        self.cfg = PDConfig.model_validate(config)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = host or _node_address(ray)
        self.api_key = api_key
        self.key_dir: Optional[str] = None
        self.gpu_ids = gpu_ids
        self.cuda_visible_devices = (",".join(map(str, gpu_ids)) if gpu_ids is not None
                                     else os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        self.port: Optional[int] = None
        self.bootstrap_port: Optional[int] = None
        self.kv_events_ports: Optional[tuple[int, int]] = None  # (PUB, replay) of a kv_aware-routed prefill
        self.state = "created"
        self.restarts = 0
        self.last_exit: Optional[int] = None
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.diagnosis: Optional[str] = None
        self._stopping = False
        self._supervisor: Optional[asyncio.Task] = None
        self._ready_line_seen = False

    # ---- public API (actor methods) -----------------------------------------------------
    async def reserve_ports(self, exclude: list[int], role: Optional[str] = None, name: Optional[str] = None) -> dict:
        """Pick this worker's HTTP (and, for a prefill, bootstrap) port on its node, avoiding
        ``exclude`` (ports already given to other workers on the node). ``role`` / ``name``: take them first (an
        actor Ray restarted begins with the ones it was created with; the split controller may have moved it)."""
        if role is not None:
            self.role = role
        if name is not None:
            self.name = name
        self.port = self.bootstrap_port = self.kv_events_ports = None
        taken = set(exclude)
        self.port = free_port(self.host, taken)
        taken.add(self.port)
        if self.role == "prefill":
            self.bootstrap_port = free_port(self.host, taken)
            taken.add(self.bootstrap_port)
            if self.publishes_kv_events():
                pub = free_port(self.host, taken)
                taken.add(pub)
                self.kv_events_ports = (pub, free_port(self.host, taken))
        return await self.info()

    def publishes_kv_events(self) -> bool:
        """Whether this worker publishes KV cache events: a prefill the router routes with ``kv_aware``,
        unless its group's ``extra_args`` already configure them."""
        extra = self.cfg.groups()[self.role].extra_args
        return (self.role == "prefill" and self.cfg.router.side_policy("prefill") == "kv_aware"
                and not any(a == "--kv-events-config" or a.startswith("--kv-events-config=") for a in extra))

    async def start(self) -> dict:
        """Start the engine and wait until it is ready.

        Raises:
            RuntimeError: the engine exited or did not become ready within
                ``engine_startup_timeout``; the message carries the end of its log.
        """
        if self.port is None:
            await self.reserve_ports([])
        self.state = "starting"
        t0 = time.monotonic()
        await self._spawn_and_wait()
        self.start_seconds = time.monotonic() - t0
        self.state = "ready"
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return await self.info()

    async def info(self) -> dict:
        """This worker's state for the launcher and router: name, role, state, host, ports, url, engine pid,
        restarts, last exit, diagnosis, GPUs."""
        return {
            "name": self.name, "role": self.role, "state": self.state, "host": self.host,
            "port": self.port, "bootstrap_port": self.bootstrap_port, "kv_events_ports": self.kv_events_ports,
            "url": f"http://{self.host}:{self.port}" if self.port else None,
            "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
            "restarts": self.restarts, "last_exit": self.last_exit, "diagnosis": self.diagnosis,
            "ready_line_seen": self._ready_line_seen, "start_seconds": self.start_seconds,
            "cuda_visible_devices": self.cuda_visible_devices, "actor_pid": os.getpid(), "node_id": self.node_id,
        }

    async def stop_engine(self) -> dict:
        """Stop the engine to change its role (pd.cluster.split_mover): no restart by the supervisor, the actor and
        its GPUs stay; state ``moving``."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            self._supervisor = None
        self.state = "moving"
        await self._terminate()
        self._print(f"engine stopped to change role (was {self.role})")
        return await self.info()

    async def start_as(self, role: str, name: str, exclude: list[int]) -> dict:
        """Start the engine in ``role`` as ``name`` on fresh ports (avoiding ``exclude``, the other workers' on the
        node) and wait until it is ready; its flags are the config's for that role (``engine_command``).

        Raises:
            ValueError: ``role`` is neither prefill nor decode.
            RuntimeError: as ``start``; the worker is then ``moving`` with no engine.
        """
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self._stopping = False
        await self.reserve_ports(exclude, role, name)
        try:
            return await self.start()
        except RuntimeError:
            self.state = "moving"
            raise

    async def log(self, lines: int = 100) -> list[str]:
        """The engine log's last ``lines`` lines kept by the actor (oldest first)."""
        return list(self.log_tail)[-lines:]

    async def stop(self) -> None:
        """Stop the engine (SIGTERM to its process group, SIGKILL after 10 s)."""
        self._stopping = True
        self.state = "stopped"
        if self._supervisor is not None:
            self._supervisor.cancel()
        await self._terminate()
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)

    # ---- internals ----------------------------------------------------------------------
    def _command(self) -> EngineCommand:
        if self.api_key and self.key_dir is None:
            self.key_dir = tempfile.mkdtemp(prefix=f"pdserve-{self.name}-")  # 0700: its files are the engine's
        cmd = engine_command(self.cfg, self.role, self.host, self.port, self.bootstrap_port, self.api_key,
                             self.key_dir)
        if self.kv_events_ports is not None:
            # The same flag and JSON for SGLang and the reference engine, bound to the engine's own address (its
            # events carry prompt token ids: not on every interface; "bind" because a named address would be
            # connected to otherwise).
            pub, replay = self.kv_events_ports
            cmd.argv += ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://{self.host}:{pub}",
                                                           "bind": True, "replay_endpoint":
                                                           f"tcp://{self.host}:{replay}"})]
        return cmd

    async def _spawn_and_wait(self) -> None:
        cmd = self._command()
        for path, text in cmd.files.items():  # owner-only from creation: the key is never readable by others
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **cmd.env)
        if cmd.env.get(plugin.MASTER_FLAG) == "1":  # the node's own SGLANG_PLUGINS allow-list must name ours too
            allowed = plugin.allow_list_with_plugin(env.get(plugin.PLUGIN_ALLOW_LIST))
            if allowed is not None:
                env[plugin.PLUGIN_ALLOW_LIST] = allowed
        env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        self._ready_line_seen = False
        self.proc = await asyncio.create_subprocess_exec(
            *cmd.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        self._log_task = asyncio.get_running_loop().create_task(self._forward_log(self.proc, cmd.ready_log_line))
        self._print(f"started engine pid {self.proc.pid} on {self.host}:{self.port}"
                    f"{f' (bootstrap {self.bootstrap_port})' if self.bootstrap_port else ''}"
                    f" CUDA_VISIBLE_DEVICES={self.cuda_visible_devices}: {' '.join(cmd.argv)}")
        await self._wait_ready(cmd)

    async def _wait_ready(self, cmd: EngineCommand) -> None:
        """Poll the engine's ready path every 0.25 s until it answers 200.

        Raises:
            RuntimeError: the engine exited, or was not ready within ``engine_startup_timeout`` s
                (it is then terminated); the message carries the diagnosis.
        """
        url = f"http://{self.host}:{self.port}{cmd.ready_path}"
        async with httpx.AsyncClient(timeout=5) as client:
            async def ready() -> bool:
                if self.proc.returncode is not None:
                    raise _EngineExited()
                return (await client.get(url)).status_code == 200

            try:
                await async_wait_until(ready, self.cfg.engine_startup_timeout, interval=0.25,
                                       what=f"{self.name} engine ready at {url}", retry=(httpx.HTTPError,))
            except _EngineExited:
                self.last_exit = self.proc.returncode
                await self._drain_log()
                raise RuntimeError(f"{self.name}: engine exited with {self.proc.returncode} during startup\n"
                                   + self._diagnose()) from None
            except TimeoutError:
                await self._terminate()
                await self._drain_log()
                raise RuntimeError(f"{self.name}: engine not ready within {self.cfg.engine_startup_timeout:g}s "
                                   f"(ready log line seen: {self._ready_line_seen})\n" + self._diagnose()) from None

    async def _forward_log(self, proc: asyncio.subprocess.Process, ready_line: str) -> None:
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                return
            line = self._redact(raw.decode(errors="replace").rstrip())
            self.log_tail.append(line)
            if ready_line in line:
                self._ready_line_seen = True
            print(f"[{self.name}] {line}", flush=True)

    async def _supervise(self) -> None:
        """Restart the engine when it exits on its own, with exponential backoff."""
        policy = self.cfg.restart
        backoff = policy.backoff_initial
        while not self._stopping:
            code = await self.proc.wait()
            if self._stopping:
                return
            self.last_exit = code
            await self._drain_log()
            self._print(f"engine stopped unexpectedly (exit {code}); " + self._diagnose())
            if self.restarts >= policy.max_restarts:
                self.state = "failed"
                self._print(f"engine exited with {code}; restart limit {policy.max_restarts} reached, worker failed")
                return
            self.state = "restarting"
            self.restarts += 1
            self._print(f"engine exited with {code}; restart {self.restarts}/{policy.max_restarts} in {backoff:g}s")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, policy.backoff_max)
            try:
                await self._spawn_and_wait()
            except RuntimeError as e:
                self._print(str(e).splitlines()[0])
                continue
            self.state = "ready"
            self._print("engine ready again")

    async def _terminate(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 10)
        except ProcessLookupError:
            return
        except asyncio.TimeoutError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()

    async def _drain_log(self) -> None:
        """Let the log forwarder read what the exited engine wrote last (its traceback)."""
        task = getattr(self, "_log_task", None)
        if task is not None:
            await asyncio.wait({task}, timeout=5)

    def _diagnose(self) -> str:
        """Root cause of the engine's failure from its log (pd.tools.diagnose), kept in ``info()``."""
        from pd.tools.diagnose import diagnose_text, render

        found = diagnose_text("\n".join(self.log_tail), source=f"{self.name} engine log")
        self.diagnosis = render(found) if found else "no known failure pattern in the engine log; last lines:\n" + \
            "\n".join(list(self.log_tail)[-20:])
        return "diagnosis: " + self.diagnosis

    def _redact(self, text: str) -> str:
        """``text`` without secrets (pd.util.redact: key fields and flags, and this worker's key itself)."""
        return redact_text(text, [self.api_key])

    def _print(self, msg: str) -> None:
        msg = self._redact(msg)
        print("\n".join(f"[{self.name}] pdserve: {line}" for line in msg.splitlines()), flush=True)
