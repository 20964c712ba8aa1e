"""NATS identities with least privilege: credentials, the server's permission table, client options.

Every service connects as its own identity; the server lets each one publish
and subscribe only the subjects of its role (DESIGN §3's subject table):

================  ==============================================================================
identity          may publish (relative to ``ei.<partition>.``)
================  ==============================================================================
``planner``       ``split.commands`` (it alone issues epochs), ``planner.decisions``, ``planner.models``
``router``        ``work.*.prefill``, ``work.*.decode`` (re-bound hand-offs), ``work.*.abort``,
                  ``branch.events``, ``route.placed``, ``route.sent`` (read by the other routers),
                  ``req.*.out.<its name>`` (the end of a request that ended parked);
                  requests ``kv.lookup``, ``split.get``, ``route.held.*`` (does the router that placed an
                  ``X-Request-ID`` sent here still have it?), ``branch.query`` (the state of a branch it never saw)
``kvdirectory``   ``kv.counts.*``, ``kv.liveness``, ``branch.sync``; requests ``kv.resync.*`` (reads ``node.state.*``,
                  ``svc.heartbeat.router``; answers ``kv.lookup``, ``branch.query``, ``kv.countsync.*``)
``worker-<n>``    ``kv.events.<n>``, ``node.state.<n>``, ``node.iters.<n>`` (its own node only),
                  ``split.applied``, ``req.*.out.<n>`` (output of its own node only), ``work.*.decode``
                  (hand-off to a decode node), ``work.*.kvcancel`` (a hand-off's K/V given up);
                  requests ``work.*.kv`` (a hand-off's K/V in pieces, first), ``work.requeue.*``,
                  ``route.bind.*`` (the owning router), ``kv.pool.*``,
                  ``split.get`` (the current split, at start), ``kv.countsync.<n>`` (its own counts)
``operator``      requests ``split.set`` (through the planner), ``split.get``, ``svc.stats.*``
``launcher``      ``node.down.*`` (a worker's process exited: routers fence it now); requests ``svc.stats.*``
                  (reads heartbeats, ``split.applied`` and ``planner.decisions``: the warm-up end ``up``'s READY
                  line gives)
``admin``         everything (``evolving-infra tap``, debugging); no service uses it
================  ==============================================================================

Subscriptions follow the same table (a worker receives only its own ``work.<n>.*`` (``work.<n>.kv`` and
``work.<n>.kvcancel`` included),
``kv.counts.<n>``, ``kv.resync.<n>``, ``kv.pool.<n>``, ``node.state.<n>``; the planner, router and directory their
kind's ``svc.heartbeat.<kind>``, where a later process under their instance id would beat (:data:`BEAT_WATCHERS`; not
a worker, whose kind's beats every node may publish); only the router and the planner
(completions for w̄) read ``req.*.out.*``; the directory and the routers read ``branch.events``, a router for the
other routers' relayed ends and tool calls of the branches it served). A request's output subject names its sender
(``req.<rid>.out.<node>``) and a chunk whose ``node`` is not the subject's is dropped
(``shared.validate``), so a worker cannot end or write into a stream another node serves: with one
``req.*.out`` every worker might publish, one node's identity ended another's streams early with a
forged ``TokenChunk(node=<the other>, finished=True)``. The routers, by contrast, are trusted alike on the
subjects they share: a message's ``src`` is set by its sender (``shared.bus`` stamps its own instance; no permission
checks it), and every router may publish ``branch.events`` and ``svc.heartbeat.router``, so one router can send a
``BranchEnd`` for another's branch, or a ``BranchSyncDone`` with another router's ``src`` (a restarted directory
then settles without that router's republish: ``services/kvdirectory/settle.py``), or a heartbeat under any
``instance`` (a directory given ``--routers`` waits for none it does not name). A forged marker needs no more
trust than a forged ``BranchEnd`` already does. Every identity publishes its own
heartbeat and answers ``svc.stats.<its name>``; replies go back through
``allow_responses`` and each identity reads only its own inbox prefix
``_INBOX.<name>.`` (:attr:`NatsAuth.inbox_prefix`), so no one reads another's
replies. ``allow_responses`` lets a responder publish on whatever reply subject
a request names, so ``shared.bus.Bus.serve`` answers only replies under
``_INBOX.`` (a worker's request with reply ``$JS.API.STREAM.DELETE.EI_p0`` made
the router delete the stream). The JetStream API is closed but for the one stream the system uses
(``EI_<partition>``, ``shared.bus``: the must-arrive subjects survive a NATS
restart): only the launcher may create it; the router, the directory and the
workers may read its info and create consumers on it, each only on the reliable
subjects it may subscribe: the grant is ``$JS.API.CONSUMER.CREATE.EI_<p>.*.<filter>``
(a named consumer with one filter, the form whose API subject carries the filter;
``shared.bus`` creates its consumers so), never the bare
``$JS.API.CONSUMER.CREATE.EI_<p>`` whose filter is in the body (a worker read another
node's prompts and every output through such a consumer). The name stays ``*``: ``shared.bus``
names each consumer afresh per subscription and reset (``<instance>_<16 random hex>``), and a
NATS wildcard is a whole token. No identity may list the stream's consumers or call their other
APIs (info, delete, next; ordered consumers ack nothing and ``$JS.ACK.>`` is not granted), and
the flow-control replies (``$JS.FC.EI_<p>.>``) name the consumer, so another's is out of reach
but by its name. One that learned a name may update that consumer with its own create grant:
the server refuses a new deliver subject (name in use), so it cannot take the deliveries, but
takes a new filter (one of the updater's own subjects) or a rate limit; ``shared.bus`` drops a
delivery whose subject is not the subscription's. A push consumer's
deliver subject is in its config, out of the permissions' sight (the server only
checks that it is a literal outside the stream): a worker may have a consumer of its
own ``work.<n>.decode`` deliver onto a core subject it may not publish, and such a
delivery keeps its stream subject, so ``shared.bus`` drops a message whose subject is
not the subscription's. No one may create another stream.

Credentials are nkeys (Ed25519 key pairs, the ``nkeys`` package nats-py uses):
the server holds the public keys, each process a seed file readable only by its
owner. User/password is the fallback (``EI_NATS_USER`` / ``EI_NATS_PASSWORD``; the server's config
holds bcrypt hashes of generated passwords, not the passwords),
TLS optional (``EI_NATS_TLS_CA`` and, for client certificates,
``EI_NATS_TLS_CERT`` / ``EI_NATS_TLS_KEY``).
"""

from __future__ import annotations

import os
import re
import secrets
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from shared.subjects import ALL, check_token

AuthMode = Literal["nkeys", "password", "off"]

KINDS = ("planner", "router", "kvdirectory", "worker", "operator", "launcher", "admin")

BEAT_WATCHERS = ("planner", "router", "kvdirectory")
"""Service kinds whose bus reads its kind's ``svc.heartbeat.<kind>`` and stops when a process that started later beats
under its instance id (``shared.bus.Bus.start_service_plumbing``). Not ``worker``: every node's identity may publish
``svc.heartbeat.worker`` (one subject per kind), so a worker stopped by such a beat could be stopped by any other node,
at every restart with a boot in the future; a worker learns it was replaced from ``node.state.<n>``, which only its own
node's identity may publish (``services/worker``)."""


class AuthError(ValueError):
    """Credentials are missing, unreadable or inconsistent."""


@dataclass(frozen=True, slots=True)
class Identity:
    """One NATS user: ``name`` (``worker-w0``), its ``kind`` (``worker``) and, for a worker, its node."""

    name: str
    kind: str
    node: str = ""


def identity(name: str) -> Identity:
    """The identity of a service instance name: ``worker-w0`` → worker of node ``w0``;
    ``router``, ``router-1`` → router; other names must be a kind (``planner``, ``operator`` ...).

    The name is one NATS subject token (``[A-Za-z0-9_-]+``): it is put in subjects
    (``route.bind.<name>``, ``_INBOX.<name>.>``, a worker's node in ``work.<node>.prefill``) and
    in a file name. Unchecked, ``auth gen --nodes '*'`` gave a worker identity every node's
    subjects (``work.*.prefill``: every prompt) and ``--nodes 'w0, w1'`` a server config with
    subjects holding a space.

    Raises:
        AuthError: for a name of no known kind or not one subject token.
    """
    try:
        check_token(name, "NATS identity name")
    except ValueError as e:
        raise AuthError(str(e)) from None
    if name.startswith("worker-"):
        return Identity(name, "worker", name[len("worker-") :])
    kind = name.split("-", 1)[0]
    if kind not in KINDS or kind == "worker":
        raise AuthError(f"no NATS identity kind for {name!r} (kinds: {', '.join(KINDS)})")
    return Identity(name, kind)


def node_is_router_name(node: str) -> bool:
    """Whether worker node id ``node`` is also a router identity's name (``router``, ``router-<x>``: :func:`identity`).
    Such a node's output subject ``req.*.out.<node>`` is that router's own (a router publishes the end of a
    parked request there, and its chunks name it as their node), so the node's key could end that router's streams:
    :func:`generate` (``auth gen --nodes``, ``up``) and the worker's ``--node`` refuse it."""
    return node == "router" or node.startswith("router-")


def router_names(n: int) -> list[str]:
    """Names of ``n`` router instances: ``router``, ``router-1``, ..., ``router-{n-1}`` (identities of kind router,
    :func:`identity`): ``up --routers N``'s processes, ``auth gen --routers N``'s identities, the fault kit's routers.

    Raises:
        ValueError: ``n`` below 1 (a cluster needs a router).
    """
    if n < 1:
        raise ValueError(f"routers {n}: a cluster needs at least one router")
    return ["router" if i == 0 else f"router-{i}" for i in range(n)]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` is one token, a final ``>`` one or more."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or (p != "*" and p != st[i]):
            return False
    return len(pt) == len(st)


def subject_matcher(pattern: str) -> Callable[[str], bool]:
    """:func:`subject_matches` with ``pattern`` split once: ``subject_matcher(p)(s) == subject_matches(p, s)``.
    A bus subscription checks every message's subject against its pattern; this splits only the subject.
    The pattern's literal tokens are compared by position (a pattern without ``*`` or ``>``: the whole string)."""
    pt = pattern.split(".")
    if ">" not in pt and "*" not in pt:
        return pattern.__eq__
    if ">" in pt:
        return lambda subject: subject_matches(pattern, subject)
    n = len(pt)
    fixed = tuple((i, p) for i, p in enumerate(pt) if p != "*")

    def matches(subject: str) -> bool:
        st = subject.split(".")
        if len(st) != n:
            return False
        for i, p in fixed:
            if st[i] != p:
                return False
        return True

    return matches


def allowed(perms: dict[str, Any], action: str, subject: str) -> bool:
    """True when ``perms`` (from :func:`permissions`) let ``action`` (``publish`` / ``subscribe``) use ``subject``."""
    return any(subject_matches(p, subject) for p in perms[action])


_RELIABLE = tuple(s.template.format(**dict.fromkeys(s.params, "*")) for s in ALL if s.reliable)
"""The subjects consumed from the partition's stream, relative, with ``*`` for each parameter."""


_CORE_ONLY = frozenset({("router", "branch.events")})
"""Reliable subjects an identity reads only through a core subscription, so it gets no consumer on them: a router
hears other routers' relayed branch ends live (``reliable=False``); a consumer would let it replay the stream's whole
history of branch, agent and parent ids, which it does not need."""


def permissions(ident: Identity, partition: str = "p0") -> dict[str, Any]:
    """The server permissions of one identity: ``{"publish": [...], "subscribe": [...]}`` (full subjects).

    Request subjects are in ``publish`` (the request goes out there); replies need no
    entry (``allow_responses``). See the module table.
    """
    try:
        check_token(partition, "partition")
    except ValueError as e:  # '*' would give every identity the subjects of every partition
        raise AuthError(str(e)) from None
    p = f"ei.{partition}."
    n = ident.node
    pub: list[str]
    sub: list[str]
    if ident.kind == "admin":
        return {"publish": [">"], "subscribe": [">"]}
    if ident.kind == "planner":
        pub = ["split.commands", "planner.decisions", "planner.models"]
        sub = ["node.iters.*", "node.state.*", "req.*.out.*", "split.applied", "split.get", "split.set", "split.commands"]
    elif ident.kind == "router":
        # route.held.*: a request with an X-Request-ID another router placed asks that router whether it still has it
        pub = ["work.*.prefill", "work.*.decode", "work.*.abort", "branch.events", "route.placed", "route.sent", "kv.lookup", "split.get",
               "branch.query", "route.held.*", f"req.*.out.{ident.name}"]  # fmt: skip
        # branch.events: the other routers' relayed ends and tool calls of the branches this one served
        sub = ["node.state.*", "node.down.*", "split.commands", "planner.models", "req.*.out.*", "route.sent", "kv.liveness", "branch.sync",
               "branch.events", f"route.bind.{ident.name}", f"work.requeue.{ident.name}", f"route.held.{ident.name}"]  # fmt: skip
    elif ident.kind == "kvdirectory":
        pub = ["kv.counts.*", "kv.resync.*", "kv.liveness", "branch.sync"]
        sub = ["kv.events.*", "branch.events", "route.placed", "split.applied", "kv.lookup", "branch.query", "node.state.*", "kv.countsync.*",
               "svc.heartbeat.router"]  # the routers it waits for after its branch.sync (services/kvdirectory/settle.py)
    elif ident.kind == "worker":
        if not n:
            raise AuthError(f"worker identity {ident.name!r} names no node")
        pub = [
            f"kv.events.{n}", f"node.state.{n}", f"node.iters.{n}", "split.applied", f"req.*.out.{n}",
            "work.*.decode", "work.*.kv", "work.*.kvcancel", "work.requeue.*", "route.bind.*", "route.held.*", "kv.pool.*", "split.get", f"kv.countsync.{n}",
        ]
        sub = [f"work.{n}.prefill", f"work.{n}.decode", f"work.{n}.kv", f"work.{n}.kvcancel", f"work.{n}.abort", "split.commands", f"kv.counts.{n}", f"kv.resync.{n}", f"kv.pool.{n}",
               f"node.state.{n}"]  # its own: a process that started later under its node id supersedes it (services/worker)
    elif ident.kind == "operator":
        pub = ["split.set", "split.get", "svc.stats.*"]
        sub = ["svc.heartbeat.*", "split.applied", "split.commands", "planner.decisions", "node.state.*"]
    elif ident.kind == "launcher":
        pub = ["svc.stats.*", "node.down.*"]
        sub = ["svc.heartbeat.*", "split.applied", "planner.decisions"]  # up's READY: the planner's announced warm-up end
    else:
        raise AuthError(f"unknown identity kind {ident.kind!r}")
    pub = [p + s for s in pub] + [f"{p}svc.heartbeat.{ident.kind}"]
    if ident.kind in BEAT_WATCHERS:
        sub = [*sub, f"svc.heartbeat.{ident.kind}"]  # its kind's beats: a later process under its instance id stops it
    stream = "EI_" + partition
    if ident.kind in ("router", "kvdirectory", "worker"):  # reliable subscriptions (shared.bus)
        # a consumer only on a reliable subject it may read: the create subject carries the filter
        # (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``); neither the bare form nor the named
        # one without a filter (any filter, or several) is granted
        pub += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.FC.{stream}.>"]
        pub += [f"$JS.API.CONSUMER.CREATE.{stream}.*.{p}{s}" for s in sub
                if any(subject_matches(r, s) for r in _RELIABLE) and (ident.kind, s) not in _CORE_ONLY]
    if ident.kind == "launcher":  # creates the stream before any service starts
        pub += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}"]
    sub = [p + s for s in sub] + [f"{p}svc.stats.{ident.name}", f"_INBOX.{ident.name}.>"]
    return {"publish": pub, "subscribe": sub}


# --------------------------------------------------------------------------- #
# credentials
# --------------------------------------------------------------------------- #


def new_nkey_seed() -> tuple[bytes, str]:
    """A fresh user nkey: ``(seed, public key)``; the seed is the secret (``SU...``).

    Raises:
        AuthError: if the ``nkeys`` package is missing.
    """
    try:
        import nkeys
    except ImportError as e:  # pragma: no cover - a core dependency
        raise AuthError("nkeys credentials need the 'nkeys' package (pip install nkeys)") from e
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    return seed, kp.public_key.decode()


def write_private(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path``, mode 0600 (readable by its owner only), also when the file existed
    with a wider mode.

    Raises:
        OSError: the file cannot be written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass
class Credentials:
    """Credentials generated for a set of identities (see :func:`generate`).

    ``files[name]`` is the nkey seed file (``nkeys``) or a ``user:password``
    file (``password``) of identity ``name``; ``server_block`` the
    ``authorization { ... }`` section for the server's config file (public keys or bcrypt hashes:
    no secret).
    """

    mode: AuthMode
    directory: Path
    files: dict[str, Path] = field(default_factory=dict)
    server_block: str = ""

    def auth_for(self, name: str) -> "NatsAuth":
        """Client options of identity ``name``.

        Raises:
            AuthError: no credentials were generated for ``name``.
        """
        if name not in self.files:
            raise AuthError(f"no NATS credentials for {name!r}; have {sorted(self.files)}")
        return NatsAuth.from_file(self.files[name])


BCRYPT_COST = 4
"""bcrypt cost (log2 rounds) of the password hashes in the server's config. bcrypt's cost guards a
guessable password against a stolen hash; :func:`generate`'s are 32 random bytes (256 bits), out of
reach at any cost, while nats-server pays the cost on every connection: measured on a 2-core box,
nats-py's connect took 0.64 s at cost 11 (``nats server passwd``'s default), 10 ms at 4."""


def bcrypt_hash(password: str, cost: int = BCRYPT_COST) -> str:
    """The bcrypt hash (``$2a$<cost>$...``, as nats-server's ``mkpasswd`` writes) of ``password``, for
    a ``password:`` in nats-server's config: the server compares a client's clear password with it
    (NATS docs, "Username/Password: bcrypted passwords"), so the config holds no password.

    Raises:
        AuthError: the ``bcrypt`` package is missing, or ``password`` is over 72 bytes (bcrypt's limit).
    """
    try:
        import bcrypt
    except ImportError as e:  # pragma: no cover - a core dependency
        raise AuthError("password credentials need the 'bcrypt' package (pip install bcrypt)") from e
    raw = password.encode()
    if len(raw) > 72:
        raise AuthError(f"a bcrypt password has at most 72 bytes, not {len(raw)}")
    return bcrypt.hashpw(raw, bcrypt.gensalt(cost, prefix=b"2a")).decode()


def _conf_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def generate(
    directory: str | Path, names: Sequence[str], *, partition: str = "p0", mode: AuthMode = "nkeys"
) -> Credentials:
    """Create credentials for ``names`` (plus ``operator``, ``launcher`` and ``admin``) in ``directory``.

    Args:
        directory: created if missing; files are mode 0600.
        names: service instance names (``planner``, ``router``, ``worker-w0`` ...).
        partition: the partition whose subjects the permissions name.
        mode: ``nkeys`` (default) or ``password`` (random 32-byte hex passwords).

    Returns:
        The credential files and the server's ``authorization`` block: nkey public keys, or the
        passwords' bcrypt hashes (:func:`bcrypt_hash`); the clear passwords are only in the 0600 files.
        Each user entry is preceded by a ``# identity: <name>`` comment line: the server's log names an nkey
        client by its public key only (``$G/nkey:U...``), and the comment says whose key that is.

    Raises:
        AuthError: a name of no known kind or not one subject token, a worker whose node id is a router's name
            (:func:`node_is_router_name`), a partition not one token, or ``mode`` is ``off`` (checked before
            anything is written).
    """
    if mode == "off":
        raise AuthError("generate() needs mode nkeys or password")
    all_names = list(dict.fromkeys([*names, "operator", "launcher", "admin"]))
    idents = [identity(name) for name in all_names]
    clash = [i.node for i in idents if i.kind == "worker" and node_is_router_name(i.node)]
    if clash:  # req.*.out.<node> would be a router's own output subject
        raise AuthError(f"node id(s) {', '.join(clash)}: a router's instance name (router, router-<x>): that node's "
                        "output subject would be the router's own; name the node otherwise (e.g. w0)")  # fmt: skip
    table = {i.name: permissions(i, partition) for i in idents}
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    creds = Credentials(mode=mode, directory=d)
    users: list[str] = []
    for name, perms in table.items():
        body = (
            f"permissions: {{ publish: {{ allow: {_conf_list(perms['publish'])} }}, "
            f"subscribe: {{ allow: {_conf_list(perms['subscribe'])} }}, allow_responses: true }}"
        )
        if mode == "nkeys":
            seed, public = new_nkey_seed()
            path = d / f"{name}.nk"
            write_private(path, seed + b"\n")
            users.append(f'  # identity: {name}\n  {{ nkey: "{public}", {body} }}')
        else:
            password = secrets.token_hex(32)
            path = d / f"{name}.pass"
            write_private(path, f"{name}:{password}\n".encode())
            users.append(f'  # identity: {name}\n  {{ user: "{name}", password: "{bcrypt_hash(password)}", {body} }}')
        creds.files[name] = path
    creds.server_block = "authorization {\n users = [\n" + ",\n".join(users) + "\n ]\n}\n"
    return creds


# --------------------------------------------------------------------------- #
# client side
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class NatsAuth:
    """How one client authenticates: nkey seed file, ``.creds`` (JWT) file, or user/password; optional TLS.

    :meth:`connect_options` gives the keyword arguments for ``nats.aio.client.Client.connect``.
    """

    name: str = ""
    """Identity name (the inbox prefix ``_INBOX.<name>`` the server lets it read); empty = default inbox."""
    nkeys_seed: str = ""
    user_credentials: str = ""
    user: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.nkeys_seed or self.user_credentials or self.user)

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX.{self.name}" if self.name and self.enabled else "_INBOX"

    @classmethod
    def from_file(cls, path: str | Path, **tls: str) -> "NatsAuth":
        """Credentials from a file: an nkey seed (``SU...``, ``*.nk``), a ``.creds`` JWT file,
        or ``user:password`` (``*.pass``). The identity name is the file's stem.

        Raises:
            AuthError: the file is missing or holds none of these.
        """
        p = Path(path)
        try:
            text = p.read_text().strip()
        except OSError as e:
            raise AuthError(f"cannot read NATS credentials {p}: {e}") from e
        name = p.stem
        if text.startswith("SU"):
            return cls(name=name, nkeys_seed=str(p), **tls)
        if "BEGIN NATS USER JWT" in text:
            return cls(name=name, user_credentials=str(p), **tls)
        if ":" in text and "\n" not in text:
            user, password = text.split(":", 1)
            return cls(name=user, user=user, password=password, **tls)
        raise AuthError(f"{p}: not an nkey seed (SU...), a .creds file or user:password")

    @classmethod
    def from_settings(
        cls, *, creds: str = "", user: str = "", password: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = "", name: str = ""
    ) -> "NatsAuth":
        """From service settings (``--nats-creds`` / ``EI_NATS_CREDS`` etc.); all empty = no auth.

        Raises:
            AuthError: unreadable credentials file, or a user without a password.
        """
        tls = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        if creds:
            return cls.from_file(creds, **tls)
        if user:
            if not password:
                raise AuthError("a NATS user needs a password (EI_NATS_PASSWORD)")
            return cls(name=name or user, user=user, password=password, **tls)
        return cls(**tls)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.aio.client.Client.connect``.

        Raises:
            AuthError: unreadable TLS files.
        """
        out: dict[str, Any] = {}
        if self.nkeys_seed:
            out["nkeys_seed"] = self.nkeys_seed
        if self.user_credentials:
            out["user_credentials"] = self.user_credentials
        if self.user:
            out["user"], out["password"] = self.user, self.password
        if self.enabled:
            out["inbox_prefix"] = self.inbox_prefix
        if self.tls_ca or self.tls_cert:
            try:
                ctx = ssl.create_default_context(cafile=self.tls_ca or None)
                if self.tls_cert:
                    ctx.load_cert_chain(self.tls_cert, self.tls_key or None)
            except (OSError, ssl.SSLError) as e:
                raise AuthError(f"cannot load NATS TLS files: {e}") from e
            out["tls"] = ctx
        return out


_NEXT_SERVER = re.compile(r",[ \t]*(?=(?:nats|tls|ws|wss)://)")
"""A comma that starts the next server of a list: one followed by a NATS scheme (the only place a
password with a comma cannot be told from a list)."""


def _server_parts(url: str) -> list[str]:
    """``url`` cut before each comma that starts the next server (:data:`_NEXT_SERVER`); every part but
    the first starts with that comma, so the parts joined are ``url``. :func:`redact_url` and
    :func:`nats_servers` read a list the same way through it."""
    cuts = [m.start() for m in _NEXT_SERVER.finditer(url)]
    return [url[a:b] for a, b in zip([0, *cuts], [*cuts, len(url)])]
_SCHEME = re.compile(r"[ \t]*(?:(?:nats|tls|ws|wss|https?)://)?")
"""The scheme of one server (``https?`` for the OTLP endpoint a service logs); only these, so a
token with ``://`` (``tok://en@host``) is no scheme and stays hidden."""


def redact_url(url: str) -> str:
    """``url`` (a NATS server URL, or several comma-separated) with the password or token of its
    user part replaced by ``***`` (``nats://router:***@host:4222``, ``nats://***@host``), for logs,
    error messages and banners; other text is returned as is.

    nats-py authenticates with the user part of the URL, so ``EI_NATS_URL=nats://user:pass@host``
    works; before, every service logged it whole at start (``service started nats=...``) and the
    CLIs printed it in their connection errors.

    The user part of a server runs from its scheme (or its start) to its last ``@`` (nats-py's
    reading: ``nats://alice@corp:pw@host`` is user ``alice@corp``), whatever it holds: a password
    with ``/``, ``,``, ``:`` or ``@`` is hidden whole. Servers are split only at a comma followed by
    a NATS scheme (``nats://``, ``tls://``, ``ws://``, ``wss://``), so a password with a comma is not
    taken for two servers (``deploy/slurm/evolving-infra.sbatch``'s ``shown_url`` reads it the same
    way); a list without schemes (``u:p@h1,u:p@h2``) is one server to it, shown as ``***@h2`` (less
    shown, nothing leaked): a user part with a comma may span servers, so its user is hidden too. A password that holds ``,nats://`` itself cannot
    be told from a list (NATS' Go client splits every comma) and is shown in part."""
    out = []
    for part in _server_parts(url):
        lead = "," if part.startswith(",") else ""
        scheme = _SCHEME.match(part, len(lead)).group(0)  # type: ignore[union-attr]
        rest = part[len(lead) + len(scheme) :]
        auth, at, hostport = rest.rpartition("@")
        if at:
            user, colon, _secret = auth.partition(":")
            part = f"{lead}{scheme}{user + ':***' if colon and ',' not in auth else '***'}@{hostport}"
        out.append(part)
    return "".join(out)


_SERVER_SCHEME = re.compile(r"(?:nats|tls|ws|wss)://")


def _url_credentials(userinfo: str) -> dict[str, str]:
    """nats-py's reading of a URL's user part (``user:password``, or a token without ``:``), percent-decoded."""
    user, colon, password = userinfo.partition(":")
    return {"user": unquote(user), "password": unquote(password)} if colon else {"token": unquote(userinfo)}


def _in_url(scheme: str, host: str, creds: dict[str, str]) -> str:
    """``host`` with ``creds`` put back raw in its URL, as nats-py (``urlparse``, no decoding) reads them.

    Raises:
        AuthError: a value that such a URL cannot carry (``/``, ``?``, ``#``; ``:`` in a user), which
        nats-py would read back changed.
    """
    userinfo = f"{creds['user']}:{creds['password']}" if "user" in creds else creds["token"]
    full = f"{scheme or 'nats://'}{userinfo}@{host}"
    try:
        got, bare = urlparse(full), urlparse(f"{scheme or 'nats://'}{host}")
        same = (got.username, got.password, got.hostname, got.port) == (
            creds.get("user", creds.get("token")), creds.get("password"), bare.hostname, bare.port)
    except ValueError:
        same = False
    if not same:
        raise AuthError(
            f"NATS URL {redact_url(full)}: the servers of the list carry different credentials and this one's cannot "
            "be passed in its URL (nats-py does not percent-decode it): give every server the same credentials, "
            "or set them with EI_NATS_USER / EI_NATS_PASSWORD"
        )
    return full


def nats_servers(url: str) -> tuple[list[str], dict[str, str]]:
    """nats-py's ``servers`` list and credentials (``user`` + ``password``, or ``token``) of ``url``: one NATS
    server URL or several comma-separated, as the NATS Go client and ``nats`` CLI take them
    (``nats://h1:4222,nats://h2:4222``).

    nats-py parses a string as ONE server (a list string fails: "nats: invalid connect url option") and
    reads the user part of a URL without percent-decoding it (``nats://u:p%2Fw@h`` sent the password
    ``p%2Fw``: "Authorization Violation"), so a password with ``/``, ``,``, ``@``, ``:`` could not be
    given at all. Here the servers are split as :func:`redact_url` splits them (at a comma followed by
    ``nats://``, ``tls://``, ``ws://`` or ``wss://``; also at a comma in the host part, ``nats://h1,h2``),
    and the user part is percent-decoded (``urllib.parse.unquote``; one written raw still works, ``/``
    included, except in a ``ws://``/``wss://`` URL: it has a path, so its user part is looked for only
    before the first ``/`` after the scheme, as nats-py's ``urlparse`` does; ``ws://h/p@x`` holds none,
    where it was read as token ``h/p`` for server ``ws://x``; write a ``/`` there as ``%2F``).
    :func:`redact_url` hides up to the last ``@`` whatever the scheme: at least this user part.

    When every server that carries credentials carries the same (a cluster shares its accounts), they
    are returned as options for nats-py's ``user=``/``password=`` (``token=``) and the servers bare: nats-py
    then sends them to every server, those the cluster announces included (from a URL it sent them only
    to that URL's server). Servers with different credentials keep them in their own URL, decoded, where
    nats-py uses each for its server.

    Raises:
        AuthError: an empty server in the list (``nats://h1,,nats://h2``), or servers with different
            credentials where one's cannot be carried in a URL (see :func:`_in_url`).
    """
    parts = [p.lstrip(",") for p in _server_parts(url)]
    found: list[tuple[str, str, dict[str, str] | None]] = []  # (scheme, host, credentials)
    for part in parts:
        part = part.strip(" \t")
        m = _SERVER_SCHEME.match(part)
        scheme = m.group(0) if m else ""
        rest = part[len(scheme) :]
        # a ws(s) URL has a path (wss://h/nats), where an @ is no user part: look in its authority only
        end = rest.find("/") if scheme.startswith("ws") else -1
        end = len(rest) if end < 0 else end
        userinfo, at, hosts = rest[:end].rpartition("@")
        hosts += rest[end:]
        for host in hosts.split(","):
            if not host.strip(" \t"):
                raise AuthError(f"NATS URL {redact_url(url)!r}: an empty server in the list")
            found.append((scheme, host.strip(" \t"), _url_credentials(userinfo) if at else None))
    distinct = {tuple(sorted(c.items())) for _s, _h, c in found if c is not None}
    if len(distinct) <= 1:
        return [s + h for s, h, _c in found], dict(next(iter(distinct), ()))
    return [s + h if c is None else _in_url(s, h, c) for s, h, c in found], {}


def client_options(url: str, auth: NatsAuth | None = None) -> dict[str, Any]:
    """Keyword arguments for nats-py's ``connect``: ``servers`` and credentials from ``url``
    (:func:`nats_servers`) and ``auth``'s options (:meth:`NatsAuth.connect_options`). Credentials of
    ``auth`` (``EI_NATS_CREDS``, ``EI_NATS_USER``) take precedence over those in the URL, as nats-py
    let its options do; the URL's are then not sent.

    Raises:
        AuthError: as :func:`nats_servers` and :meth:`NatsAuth.connect_options`.
    """
    servers, creds = nats_servers(url)
    opts = auth.connect_options() if auth is not None else {}
    if auth is not None and auth.enabled:
        creds = {}
    return {"servers": servers, **creds, **opts}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with :func:`redact_url` applied to each argument, for a command line a run records
    (``demo``'s ``report.json`` and ``report.html``): ``--nats-url nats://u:p@h`` (also as
    ``--nats-url=...`` or abbreviated, ``--nats-u``) keeps no password. Errs on hiding: any argument
    with an ``@`` loses what comes before it (``a@b`` is written ``***@b``)."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        out.append(f"{flag}={redact_url(value)}" if a.startswith("-") and eq else redact_url(a))
    return out


def auth_from_env(name: str = "") -> NatsAuth:
    """Client auth from ``EI_NATS_CREDS`` / ``EI_NATS_USER`` + ``EI_NATS_PASSWORD`` / ``EI_NATS_TLS_*``
    (what the CLI tools use when no flag is given).

    Raises:
        AuthError: as :meth:`NatsAuth.from_settings`.
    """
    e = os.environ.get
    return NatsAuth.from_settings(
        creds=e("EI_NATS_CREDS", ""),
        user=e("EI_NATS_USER", ""),
        password=e("EI_NATS_PASSWORD", ""),
        tls_ca=e("EI_NATS_TLS_CA", ""),
        tls_cert=e("EI_NATS_TLS_CERT", ""),
        tls_key=e("EI_NATS_TLS_KEY", ""),
        name=name,
    )
