"""Hosts on one machine for multi-node tests: Linux network namespaces on a bridge.

Each host is a namespace with its loopback up and one veth into a bridge in the root namespace; the
bridge has an address of its own so the test process reaches every host. Addresses come from a
documentation range (RFC 5737, 198.51.100.0/24, or 203.0.113.0/24 when that one is taken here), and
there is no default route in any namespace, so nothing leaves the machine.

Names carry the creating process's PID (``pdt<pid>...``): a run removes only what it made, in
``teardown``, and ``sweep_leftovers`` removes what runs that have died left behind (SIGKILLed
pytest), never another live run's. Interface names are at most 15 bytes (IFNAMSIZ - 1).

Needs root; ``namespaces_unavailable()`` says why not, for the skip.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Iterator, Optional

from pd.util.wait import wait_until

PREFIX = "pdt"  # namespaces pdt<pid>-<host>, bridge pdt<pid>b, root-side veths pdt<pid>v<n>
RANGES = ("198.51.100.0/24", "203.0.113.0/24")  # RFC 5737 documentation ranges


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def namespaces_unavailable() -> Optional[str]:
    """None when this process can make network namespaces, else the reason (for a skip)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"the kernel refused a network namespace: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns: str) -> list[int]:
    """PIDs of every process whose network namespace is ``ns`` (``ip netns pids``)."""
    out = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_ns_processes(ns: str, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to every process in namespace ``ns``; returns the PIDs signalled."""
    pids = ns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def sweep_leftovers() -> list[str]:
    """Remove namespaces and links named by this module for a PID that no longer runs (and their
    processes, which a SIGKILLed run leaves in them); returns what was removed."""
    removed = []
    pat = re.compile(rf"^{PREFIX}(\d+)")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = pat.match(name)
        if m and not _pid_alive(int(m.group(1))):
            kill_ns_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = pat.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_range() -> ipaddress.IPv4Network:
    used = _ip("-o", "-4", "addr", "show", check=False).stdout
    for r in RANGES:
        net = ipaddress.ip_network(r)
        if not any(ipaddress.ip_address(a) in net for a in re.findall(r"inet (\S+)/", used)):
            return net
    raise RuntimeError(f"every documentation range {RANGES} is already on an interface here")


@dataclass
class Host:
    """One namespace on the bridge: ``name`` (the namespace), ``address`` (its IPv4 address) and
    ``veth`` (the root-side end of its link: down = the host is cut off)."""

    label: str
    name: str
    address: str
    veth: str

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def link(self, up: bool) -> None:
        """Connect (``up``) or cut off this host: its link to the bridge goes up or down."""
        _ip("link", "set", self.veth, "up" if up else "down")

    def pids(self) -> list[int]:
        return ns_pids(self.name)


@dataclass
class Network:
    """A bridge and one namespace per label; ``hosts[label]`` is its Host. Use as a context manager,
    or call ``teardown()`` in ``finally``."""

    labels: tuple[str, ...]
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge: str = ""
    gateway: str = ""
    _links: list[str] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self):
        pid = os.getpid()
        self.bridge = f"{PREFIX}{pid}b"
        net = _free_range()
        addrs = list(net.hosts())
        self.gateway = str(addrs[-1])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for n, label in enumerate(self.labels):
                ns, veth = f"{PREFIX}{pid}-{label}", f"{PREFIX}{pid}v{n}"
                _ip("netns", "add", ns)
                self._namespaces.append(ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._links.append(veth)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                addr = str(addrs[n])
                _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.hosts[label] = Host(label, ns, addr, veth)
        except BaseException:
            self.teardown()
            raise

    def teardown(self) -> None:
        """Kill what runs in our namespaces, then remove them and our links (idempotent)."""
        for ns in self._namespaces:
            kill_ns_processes(ns)
        try:  # SIGKILLed processes are gone once their parents (or init) reap them: a moment
            wait_until(lambda: not any(ns_pids(ns) for ns in self._namespaces), 10, interval=0.1,
                       what="our namespaces' processes gone", retry=())
        except TimeoutError:
            pass  # deleting the name still works; the leftover check in the tests reports them
        for ns in self._namespaces:
            _ip("netns", "del", ns, check=False)
        for link in reversed(self._links):
            _ip("link", "del", link, check=False)
        self._namespaces.clear()
        self._links.clear()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


def leftovers_of(pid: int) -> list[str]:
    """Namespaces and links of run ``pid`` that still exist (empty after a clean teardown)."""
    pat = f"{PREFIX}{pid}"
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in
             _ip("-o", "link", "show", check=False).stdout.splitlines() if ":" in line]
    return [n for n in names + links if n.startswith(pat) and not n[len(pat):len(pat) + 1].isdigit()]


@contextlib.contextmanager
def local_address() -> Iterator[str]:
    """A non-loopback IPv4 address of this machine, made in the current network namespace for tests that need one
    where there is none (a loopback-only namespace): a veth pair ``pdt<pid>l`` / ``pdt<pid>m`` whose first end
    holds an address of a free documentation range. No route leaves through it: connections to the address stay
    on this machine, as with any local address. Removed on exit (``sweep_leftovers`` removes a killed run's).

    Raises:
        RuntimeError: the pair or its address could not be made (needs root and the veth driver).
        OSError: no ``ip`` command.
    """
    pid = os.getpid()
    end, peer = f"{PREFIX}{pid}l", f"{PREFIX}{pid}m"
    address = str(next(_free_range().hosts()))
    try:
        _ip("link", "add", end, "type", "veth", "peer", "name", peer)
        _ip("addr", "add", f"{address}/32", "dev", end)
        _ip("link", "set", end, "up")
        _ip("link", "set", peer, "up")
        yield address
    finally:
        _ip("link", "del", end, check=False)  # takes its peer with it
