"""TCP sockets in given states for tests of port checks (Linux: states read from /proc/net/tcp)."""

from __future__ import annotations

import socket

from pd.util.wait import wait_until


def time_wait_ports() -> set[int]:
    """Local ports of this network namespace's IPv4 TCP sockets in TIME-WAIT (/proc/net/tcp state 06)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {int(r[1].rsplit(":", 1)[1], 16) for r in rows if r[3] == "06"}


def server_side_time_wait() -> int:
    """A port on 127.0.0.1 whose only socket is the server side of a closed connection in TIME-WAIT (what a
    stopped server leaves for about a minute): the accepted connection closes first, then the client. The
    server sets SO_REUSEADDR, as the stopped head's dashboard did (aiohttp does; Linux lets a new bind ignore a
    TIME-WAIT socket only when both set it)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn, _ = listener.accept()
    listener.close()
    conn.close()  # the active close: this side goes through FIN-WAIT to TIME-WAIT
    wait_until(lambda: client.recv(1) == b"", 10, interval=0.05, what="the server's FIN at the client")
    client.close()
    wait_until(lambda: port in time_wait_ports(), 10, interval=0.05, what=f"port {port} in TIME-WAIT")
    return port

