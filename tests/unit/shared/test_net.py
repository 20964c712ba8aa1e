"""``shared.net``: the one bind of the router's port (the router's own, and the socket ``up`` holds for it) and the
bracketed URL of an IPv6 host."""

from __future__ import annotations

import socket

import pytest

from shared.net import bind_socket, http_url, listen_socket
from tests.conftest import ipv6_loopback


def test_bind_socket_binds_reusable_and_not_listening_and_listen_socket_listens():
    with bind_socket("127.0.0.1", 0) as bound, listen_socket("127.0.0.1", 0) as held:
        for s in (bound, held):
            assert s.family == socket.AF_INET and s.getsockname()[1] > 0
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            assert s.getblocking()
        assert not bound.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    with bind_socket("127.0.0.1", 0, blocking=False) as loop_side:  # the router's and the metrics port's
        assert not loop_side.getblocking() and loop_side.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)


def test_a_busy_port_is_an_oserror():
    with listen_socket("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        for make in (bind_socket, listen_socket):
            with pytest.raises(OSError):
                make("127.0.0.1", port)


def test_an_empty_host_is_an_oserror_as_the_routers_own_bind_was():
    """The router's ``--host ''`` (and ``up``'s) failed before the one bind too (``getaddrinfo('')``); only the
    metrics port maps ``""`` to 0.0.0.0 (:class:`shared.metrics.MetricsServer`), as its own bind did."""
    for make in (bind_socket, listen_socket):
        with pytest.raises(OSError):
            make("", 0)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_host_binds_in_its_family_and_its_url_is_bracketed():
    with listen_socket("::1", 0) as held:
        assert held.family == socket.AF_INET6
        assert http_url("::1", held.getsockname()[1]) == f"http://[::1]:{held.getsockname()[1]}"
    assert http_url("[::1]", 80) == "http://[::1]:80" and http_url("127.0.0.1", 80) == "http://127.0.0.1:80"


def test_an_inherited_socket_is_adopted_non_blocking_and_not_inheritable():
    """``up`` passes the router's and each metrics port's socket inheritable (``pass_fds``); the service adopting
    it left it so, and any process it starts (``close_fds=False``: e.g. a shell-out) held the port on past the
    service's exit. Adopted, it is no longer inherited."""
    import os
    import subprocess
    import sys

    from shared.net import inherited_socket

    with listen_socket("127.0.0.1", 0) as held:
        fd = os.dup(held.fileno())
        os.set_inheritable(fd, True)  # as a child of up's finds it
        sock = inherited_socket(fd)
        try:
            assert sock.fileno() == fd and not sock.getblocking()
            assert not os.get_inheritable(fd)
            probe = f"import os\ntry:\n    os.fstat({fd})\nexcept OSError:\n    print('closed')\nelse:\n    print('open')"
            out = subprocess.run([sys.executable, "-c", probe], close_fds=False, capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == "closed", out
        finally:
            sock.close()
