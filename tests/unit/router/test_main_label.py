"""The router's startup errors (a bad ``--listen-fd``, policy or tokenizer: exit 2, one line on stderr) name the
instance, as every service's exit line does (``shared.service.process_label``). ``up --routers N`` runs ``router``,
``router-1``, ...: each said ``router:``, so which of them refused its held socket was not in the line."""

from __future__ import annotations

import socket

import pytest

from services.router.__main__ import main


@pytest.mark.parametrize(("instance", "label"), [(None, "router"), ("router", "router"), ("router-2", "router router-2")])
def test_a_bad_listen_fd_names_the_instance(instance, label, capsys):
    with socket.socket() as bound:  # bound, not listening: refused before NATS
        bound.bind(("127.0.0.1", 0))
        fd = bound.fileno()
        inst = [] if instance is None else ["--instance", instance]
        assert main(["--nats-url", "nats://127.0.0.1:1", "--listen-fd", str(fd), *inst]) == 2
        bound.getsockname()  # still open: the check detached it, never closed ours
    assert capsys.readouterr().err == f"{label}: --listen-fd {fd} is not a listening TCP socket\n"


@pytest.mark.parametrize(("flags", "why"), [
    (["--routing", "nope"], "unknown routing policy 'nope'"),
    (["--tokenizer", "hf:/nonexistent-ei"], "no tokenizer.json at /nonexistent-ei"),
])  # fmt: skip
def test_a_bad_policy_or_tokenizer_names_the_instance(flags, why, capsys):
    assert main(["--nats-url", "nats://127.0.0.1:1", "--instance", "router-1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"router router-1: {why}") and err.count("\n") == 1, err
