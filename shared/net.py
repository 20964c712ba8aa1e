"""TCP listeners of the services' HTTP servers: the router's socket (bound by the router itself, or held by ``up``
and passed as ``--listen-fd``), a metrics port's (bound by the service, or held by ``up`` and passed as
``--metrics-fd``) and the URL of a host and port, IPv6 included.

``up``'s URLs, the router's and the metrics endpoint's "listening" log lines use one spelling, so a URL copied from a
log line works as given (``http://::1:8000`` does not: httpx reads ``:1:8000`` as the port). ``up`` and the router
bind the router's port one way (:func:`bind_socket`), so ``--host`` / ``--port`` mean the same to both; every service's
metrics port (``--metrics-host`` / ``--metrics-port``) is bound the same way."""

from __future__ import annotations

import errno
import socket


def bind_socket(host: str, port: int, *, blocking: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port; the first address ``getaddrinfo`` gives, so a hostname or
    an IPv6 address binds in its own family), ``SO_REUSEADDR`` set (a restarted router rebinds a port whose old
    connections are in TIME_WAIT), not yet listening; blocking unless ``blocking=False`` (what a server on the
    asyncio loop is given).

    ``host`` ``""`` is refused here (``getaddrinfo`` cannot resolve it, so the router's ``--host ''`` never started);
    the metrics port maps its ``""`` to ``0.0.0.0`` first (:class:`shared.metrics.MetricsServer`).

    Raises:
        OSError: the address cannot be resolved or bound (in use, not on this machine); the socket is closed.
    """
    family, stype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(blocking)
    except OSError:
        sock.close()
        raise
    return sock


def inherited_socket(fd: int, flag: str = "--listen-fd") -> socket.socket:
    """The listening TCP socket a supervisor passed as file descriptor ``fd`` (``evolving-infra up`` holds the
    router's port, ``--listen-fd``, and every service's metrics port, ``--metrics-fd``, across restarts), set
    non-blocking for the event loop and not inheritable (the supervisor passed it inheritable: a process this one
    starts would hold the port on, past this one's exit). ``flag`` names the setting in the errors.

    Raises:
        OSError: ``fd`` is not open, not a socket, or a socket that does not listen (``listen(2)`` not called).
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise OSError(e.errno, f"{flag} {fd} is not an open socket: {e.strerror or e}") from e
    if (sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
            or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):  # fmt: skip
        sock.detach()  # not ours to close
        raise OSError(errno.EINVAL, f"{flag} {fd} is not a listening TCP socket")
    sock.setblocking(False)
    sock.set_inheritable(False)
    return sock


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """:func:`bind_socket`, listening with uvicorn's default accept-queue length: the socket ``up`` holds for its
    router (``--listen-fd``), open across the router's restarts.

    Raises:
        OSError: the address cannot be bound or listened on; the socket is closed.
    """
    sock = bind_socket(host, port)
    try:
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``--host ::1``: ``http://[::1]:8000``; unbracketed, httpx
    read ``:1:8000`` as the port and ``up`` died in its readiness wait). ``host`` already bracketed is kept."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"
