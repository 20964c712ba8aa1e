"""``--mode password`` against a real nats-server: the server's config holds bcrypt hashes, not the
passwords (before, ``nats-auth.conf`` and up's embedded ``nats.conf`` held every identity's password in
clear, ``admin``'s included); a client with the clear password from its 0600 file still connects."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest

from evolving_infra.cli import main
from shared.auth import generate
from shared.natsserver import EmbeddedNatsServer


def _passwords(creds_dir: Path) -> list[str]:
    return [p.read_text().split(":", 1)[1].strip() for p in sorted(creds_dir.glob("*.pass"))]


async def test_password_mode_server_config_holds_hashes_and_clients_connect(tmp_path, capsys):
    creds = generate(tmp_path / "creds", ["worker-w0"], mode="password")
    passwords = _passwords(creds.directory)
    assert len(passwords) == 4 and all(len(p) == 64 for p in passwords)
    assert creds.server_block.count('password: "$2a$04$') == 4
    with EmbeddedNatsServer(auth_block=creds.server_block) as srv:
        conf = Path(srv._tmp or "") / "nats.conf"
        text = conf.read_text()
        assert "authorization" in text and not any(p in text for p in passwords), "a clear password in nats.conf"
        nc = await nats.connect(srv.url, allow_reconnect=False, connect_timeout=3, **creds.auth_for("admin").connect_options())
        await nc.close()
        h = creds.server_block.split('password: "', 2)[1].split('"', 1)[0]  # a hash is no password
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(srv.url, allow_reconnect=False, connect_timeout=3, user="admin", password=h)
    # `auth gen --mode password`: its nats-auth.conf (for an external server) likewise
    assert main(["auth", "gen", "--dir", str(tmp_path / "gen"), "--nodes", "w0", "--mode", "password"]) == 0
    capsys.readouterr()
    text, passwords = (tmp_path / "gen" / "nats-auth.conf").read_text(), _passwords(tmp_path / "gen")
    assert len(passwords) == 7 and text.count('password: "$2a$') == 7 and not any(p in text for p in passwords)
