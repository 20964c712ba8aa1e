"""TCP addresses of the services' HTTP listeners: the URL of a host and port, IPv6 included.

``up``'s URLs, the router's and the metrics endpoint's "listening" log lines use one spelling, so a URL copied from a
log line works as given (``http://::1:8000`` does not: httpx reads ``:1:8000`` as the port)."""

from __future__ import annotations


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``--host ::1``: ``http://[::1]:8000``; unbracketed, httpx
    read ``:1:8000`` as the port and ``up`` died in its readiness wait). ``host`` already bracketed is kept."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"
