"""Free TCP ports picked by the OS, for servers started by this process or its children.

A port returned here was free when checked; another process may still take it before the server
binds it, so callers that start servers on many ports at once pass the ones they already picked
in ``exclude``.
"""

from __future__ import annotations

import socket
from typing import Iterable

MAX_TRIES = 1000  # ports asked of the OS before giving up on finding one outside ``exclude``


def free_port(host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> int:
    """A TCP port on ``host`` that was free a moment ago and is not in ``exclude``.

    Args:
        host: the address to bind (IPv4 or IPv6 literal, or a name that resolves to one).
        exclude: ports to skip (ones already handed to other servers on this host).

    Raises:
        OSError: ``host`` cannot be bound, or the OS gave only excluded ports ``MAX_TRIES`` times.
    """
    skip = set(exclude)
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    for _ in range(MAX_TRIES):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in skip:
            return port
    raise OSError(f"no free port on {host} outside the {len(skip)} excluded after {MAX_TRIES} tries")


def free_ports(count: int, host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> list[int]:
    """``count`` distinct free TCP ports on ``host``, none in ``exclude`` (see ``free_port``).

    Raises:
        OSError: as ``free_port``.
    """
    taken = set(exclude)
    out = []
    for _ in range(count):
        out.append(free_port(host, taken))
        taken.add(out[-1])
    return out


def port_holder(port: int, host: str = "127.0.0.1") -> str | None:
    """None when a server could bind ``host:port`` now; else who holds it, as far as this process can see:
    ``"pid 123 (nginx)"`` when psutil is installed and may read that process, else ``"another program"``.

    The bind is tried as servers do it (Ray's dashboard and its own port check, aiohttp, uvicorn): with
    ``SO_REUSEADDR``, so connections of an earlier server in TIME-WAIT (a minute after it stopped) do not
    count as a holder; a socket that listens there does.

    Raises:
        OSError: ``host`` cannot be resolved.
    """
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    try:
        import psutil  # optional here (Ray brings it): only names the holder

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
    except Exception:  # no psutil, or no permission to see the holder: the port is still taken
        pass
    return "another program"
