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
