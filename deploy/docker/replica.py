"""Print this container's replica number (1, 2, ...) of a scaled compose service.

Replicas of ``docker compose up --scale worker=N`` share one command line; Docker
names them ``<project>[_-]<service>[_-]<n>`` and its embedded DNS server
(127.0.0.11, user-defined networks) answers a PTR query for a container's
address with that name. This asks it directly (``/etc/hosts`` would give the
container id instead) and prints ``n``. Exit 1 with the reason on stderr when
there is no answer or no number in the name.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import sys


def ptr_name(ip: str, server: str = "127.0.0.11", timeout_s: float = 2.0) -> str:
    """The first PTR answer for ``ip`` from ``server`` (one UDP query, RFC 1035).

    Raises:
        OSError: no answer in ``timeout_s``; ValueError: an answer without a PTR record.
    """
    qid = random.randrange(1 << 16)
    qname = b"".join(bytes([len(p)]) + p.encode() for p in [*reversed(ip.split(".")), "in-addr", "arpa"]) + b"\0"
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 12, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        s.sendto(query, (server, 53))
        data = s.recv(4096)
    rid, _flags, qd, an = struct.unpack(">HHHH", data[:8])
    if rid != qid or an == 0:
        raise ValueError(f"no PTR record for {ip}")

    def name_at(off: int) -> tuple[str, int]:
        labels, end = [], None
        while True:
            n = data[off]
            if n & 0xC0 == 0xC0:  # compression pointer
                if end is None:
                    end = off + 2
                off = ((n & 0x3F) << 8) | data[off + 1]
                continue
            if n == 0:
                return ".".join(labels), (end if end is not None else off + 1)
            labels.append(data[off + 1 : off + 1 + n].decode())
            off += 1 + n

    off = 12
    for _ in range(qd):
        _, off = name_at(off)
        off += 4
    for _ in range(an):
        _, off = name_at(off)
        rtype, _cls, _ttl, rdlen = struct.unpack(">HHIH", data[off : off + 10])
        off += 10
        if rtype == 12:
            return name_at(off)[0]
        off += rdlen
    raise ValueError(f"no PTR record for {ip}")


def main() -> int:
    ip = socket.gethostbyname(socket.gethostname())
    try:
        name = ptr_name(ip)
    except (OSError, ValueError) as e:
        print(f"replica: cannot resolve this container's name ({ip}) at Docker's DNS: {e}", file=sys.stderr)
        return 1
    m = re.search(r"[_-](\d+)$", name.split(".")[0])
    if m is None:
        print(f"replica: no replica number in the container name {name!r}", file=sys.stderr)
        return 1
    print(int(m.group(1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
