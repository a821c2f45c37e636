"""Where a pdserve launcher leaves its router's generated admin key, so tools on the same node find it.

The launcher (pd.cluster.launch) generates the router's admin key unless the config sets
``router.admin_api_key``, writes it to an owner-only file ``pdserve_admin_key_<router port>`` in the Ray
session dir of its node, logs the file's path (never the key) and removes the file on stop. The router's
port is unique on a node, so the name tells clusters sharing one Ray head apart.

A tool that talks to a router finds that file (:func:`find_admin_key_file`) by one rule:

1. ``$PDSERVE_ADMIN_API_KEY_FILE`` when it is set (any router, any Ray temp dir);
2. else, when the router's host is this machine (loopback, ``localhost``, or an address a socket here can
   bind), ``<Ray temp dir>/session_latest/pdserve_admin_key_<port of the URL>``, where the Ray temp dir is
   Ray's default: ``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray`` (a head started with
   ``--temp-dir`` needs rule 1).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

ADMIN_KEY_FILE_PREFIX = "pdserve_admin_key"
ADMIN_KEY_FILE_ENV = "PDSERVE_ADMIN_API_KEY_FILE"


def admin_key_file_name(router_port: int) -> str:
    """``pdserve_admin_key_<router_port>``: the key file's name inside a Ray session dir."""
    return f"{ADMIN_KEY_FILE_PREFIX}_{router_port}"


def default_ray_session_dir() -> Path:
    """``session_latest`` in Ray's default temp dir (``$RAY_TMPDIR``, else ``$TMPDIR``, else ``/tmp``, then
    ``ray``), as Ray itself picks it for a head started without ``--temp-dir``."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / "ray" / "session_latest"


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (a name or an IP literal, IPv6 with or without brackets) is an address of this machine:
    loopback, ``localhost``, or one a socket here can bind. A name that does not resolve is not."""
    host = host.strip("[]")
    if host in ("localhost", "", "0.0.0.0", "::"):
        return True
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


def find_admin_key_file(base_url: str) -> Optional[Path]:
    """The admin key file for the router at ``base_url`` by the module's rule, or None: ``$PDSERVE_ADMIN_API_KEY_FILE``
    as given (even when it does not exist, so that a wrong path is reported), else the session dir's file of the
    URL's port when the router runs on this machine and that file exists."""
    given = os.environ.get(ADMIN_KEY_FILE_ENV)
    if given:
        return Path(given).expanduser()
    url = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return None
    if not is_this_machine(url.hostname or ""):
        return None
    path = default_ray_session_dir() / admin_key_file_name(port)
    return path if path.is_file() else None


def read_admin_key(path: os.PathLike) -> str:
    """The key in a key file (its first line, stripped).

    Raises:
        OSError: the file cannot be read (missing, no permission).
        ValueError: the file is empty.
    """
    with open(path) as f:
        key = f.readline().strip()
    if not key:
        raise ValueError(f"{path} holds no key")
    return key
