"""The one table from NATS subject template to message type (DESIGN §3).

Every subject lives under a partition prefix ``ei.<partition>.``; no service
writes a subject string by hand, it formats a :class:`Subject` from this table::

    subj = Subjects("p0")
    subj.format(KV_EVENTS, node="w0")      # 'ei.p0.kv.events.w0'
    subj.wildcard(KV_EVENTS)               # 'ei.p0.kv.events.*'

Node ids, request ids and instance ids are single NATS tokens: letters,
digits, ``-`` and ``_`` only (:func:`check_token`).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any

from shared import messages as m

_TOKEN = re.compile(r"[A-Za-z0-9_\-]+\Z")  # \Z: "$" would let a trailing newline through


def check_token(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a valid single NATS subject token.

    Raises:
        ValueError: if it is empty or has characters other than ``[A-Za-z0-9_-]``.
    """
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+ (one NATS subject token)")
    return value


@dataclass(frozen=True, slots=True)
class Subject:
    """A subject template (relative to the partition prefix) and its message types."""

    template: str
    msg_type: Any
    """Type carried (a Struct or a Union of tagged Structs)."""
    reply_type: Any = None
    """For request/reply subjects: the type of the reply."""
    doc: str = ""
    reliable: bool = False
    """Must arrive even across a NATS restart: captured by the partition's JetStream stream
    and consumed through an ordered consumer (``shared.bus``)."""
    params: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        names = tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f)
        object.__setattr__(self, "params", names)


KV_EVENTS = Subject("kv.events.{node}", m.KvEventBatch, doc="worker → directory: KV block events", reliable=True)
KV_RESYNC = Subject("kv.resync.{node}", m.KvResyncRequest, m.KvSnapshot, doc="directory → worker: full snapshot")
KV_LOOKUP = Subject("kv.lookup", m.KvLookupRequest, m.KvLookupReply, doc="router → directory: prefix lookup")
KV_COUNTS = Subject("kv.counts.{node}", m.CountUpdates, doc="directory → worker: branch counts")
KV_COUNT_SYNC = Subject(
    "kv.countsync.{node}", m.CountSyncRequest, m.CountSnapshot, doc="worker → directory: every branch count of the node (kv.counts gap)"
)
KV_POOL = Subject("kv.pool.{node}", m.PoolLocate, m.PoolLocation, doc="worker → worker: locate blocks in a real-bytes host KV pool")
BRANCH_EVENTS = Subject(
    "branch.events", m.BranchEvent, doc="router → directory, other routers: branch start/end/tool call", reliable=True
)
BRANCH_QUERY = Subject(
    "branch.query", m.BranchQuery, m.BranchQueryReply, doc="router → directory: state of a branch the router never saw (its end, its tool call)"
)
ROUTE_PLACED = Subject("route.placed", m.RoutePlaced, doc="router → directory: branch placed on node", reliable=True)
NODE_STATE = Subject("node.state.{node}", m.NodeState, doc="worker → router, planner: node state")
NODE_DOWN = Subject("node.down.{node}", m.NodeDown, doc="launcher → routers: the node's process exited (fence it now)")
NODE_ITERS = Subject("node.iters.{node}", m.IterationRecords, doc="worker → planner: iteration records")
SPLIT_COMMANDS = Subject("split.commands", m.SplitCommand, doc="planner → workers, router: PD split")
SPLIT_APPLIED = Subject("split.applied", m.SplitApplied, doc="worker → all: switch progress")
SPLIT_GET = Subject("split.get", m.SplitQuery, m.SplitCommand, doc="any → planner: current split")
PLANNER_DECISIONS = Subject("planner.decisions", m.PlannerDecision, doc="planner → all: every planner decision")
SPLIT_SET = Subject("split.set", m.SplitSetRequest, m.SplitSetReply, doc="operator → planner: adopt a split")
WORK_PREFILL = Subject("work.{node}.prefill", m.PrefillWork, doc="router → worker: prefill dispatch", reliable=True)
WORK_DECODE = Subject("work.{node}.decode", m.DecodeWork, doc="prefill worker → decode worker: hand-off", reliable=True)
WORK_KV = Subject(
    "work.{node}.kv", m.KvChunk, m.KvChunkAck, doc="prefill worker → decode worker: a hand-off's K/V in pieces, before its DecodeWork"
)
"""Core NATS request/reply, not the JetStream stream: each piece is acknowledged (a lost one is sent again, a refused
one fails the hand-off at the prefill node), and the stream (``shared.bus.STREAM_MAX_BYTES``) and the resend window
hold no K/V (``services/worker/handoffkv.py``)."""
WORK_KV_CANCEL = Subject(
    "work.{node}.kvcancel", m.KvCancel, doc="prefill worker → decode worker: a hand-off's K/V its sender gave up; free it"
)
"""Core NATS, fire and forget: the sender waits for no answer (a lost cancel costs the decode node's idle timeout,
``--handoff-piece-idle-s`` / ``--handoff-kv-timeout-s``, as before there was one)."""
WORK_ABORT = Subject("work.{node}.abort", m.RequestAbort, doc="router → worker: abort a request", reliable=True)
REQ_OUT = Subject("req.{rid}.out.{node}", m.TokenChunk, doc="worker → router: token stream of a request, per node", reliable=True)
"""One subject per request and sender: ``node`` is the publishing node (``TokenChunk.node``; a router's own end of a
parked request names the router's instance). Each identity may publish only its own ``req.*.out.<n>``
(``shared.auth``) and :mod:`shared.validate` drops a chunk whose ``node`` is not the subject's, so the node of a chunk
is the publisher's: with one ``req.*.out`` for all, any worker could end or write into a stream another node served
(the router trusted the sender-written ``node``). Routers and the planner read ``req.*.out.*``."""
SVC_HEARTBEAT = Subject("svc.heartbeat.{service}", m.Heartbeat, doc="any → launcher: liveness")
SVC_STATS = Subject("svc.stats.{instance}", m.StatsRequest, m.StatsReply, doc="counters of one instance")
PLANNER_MODELS = Subject("planner.models", m.PlannerModels, doc="planner → router: fitted iteration-time models per node")
ROUTE_BIND = Subject(
    "route.bind.{router}", m.DecodeBindRequest, m.DecodeBindReply, doc="worker → owning router: decode node at prefill start"
)
ROUTE_HELD = Subject(
    "route.held.{router}", m.HeldQuery, m.HeldReply, doc="worker → owning router: which held requests it no longer wants"
)
BRANCH_SYNC = Subject("branch.sync", m.BranchSync, doc="directory → routers: republish active branches (directory restart)")
KV_LIVENESS = Subject("kv.liveness", m.KvLiveness, doc="directory → routers: per node, seconds served without a KV batch; stale views")
ROUTE_SENT = Subject("route.sent", m.RouteSent, doc="router → routers: a placement (others count it in their load view)")
WORK_REQUEUE = Subject(
    "work.requeue.{router}", m.WorkRequeue, m.WorkRequeueReply, doc="worker → owning router: hand back work for re-routing"
)

ALL: tuple[Subject, ...] = (
    KV_EVENTS,
    KV_RESYNC,
    KV_LOOKUP,
    KV_COUNTS,
    KV_COUNT_SYNC,
    KV_POOL,
    BRANCH_EVENTS,
    BRANCH_QUERY,
    ROUTE_PLACED,
    NODE_STATE,
    NODE_DOWN,
    NODE_ITERS,
    SPLIT_COMMANDS,
    SPLIT_APPLIED,
    SPLIT_GET,
    WORK_PREFILL,
    WORK_DECODE,
    WORK_KV,
    WORK_KV_CANCEL,
    WORK_ABORT,
    REQ_OUT,
    SVC_HEARTBEAT,
    SVC_STATS,
    PLANNER_MODELS,
    PLANNER_DECISIONS,
    SPLIT_SET,
    ROUTE_BIND,
    ROUTE_HELD,
    WORK_REQUEUE,
    ROUTE_SENT,
    KV_LIVENESS,
    BRANCH_SYNC,
)


class Subjects:
    """Subject builder for one partition.

    Args:
        partition: partition name (one NATS token), e.g. ``p0``.

    Raises:
        ValueError: if ``partition`` or a formatted parameter is not a valid token.
    """

    def __init__(self, partition: str = "p0") -> None:
        self.partition = check_token(partition, "partition")
        self.prefix = f"ei.{partition}."

    def format(self, subject: Subject, **params: str) -> str:
        """Full subject string with every ``{param}`` filled in.

        Raises:
            ValueError: a parameter is missing or not one NATS token (:func:`check_token`).
        """
        for name in subject.params:
            if name not in params:
                raise ValueError(f"subject {subject.template!r} needs its parameter {name!r}")
            check_token(params[name], name)
        return self.prefix + subject.template.format(**params)

    def wildcard(self, subject: Subject, **params: str) -> str:
        """Full subject with the given params filled and the rest as ``*``."""
        filled = {p: (check_token(params[p], p) if p in params else "*") for p in subject.params}
        return self.prefix + subject.template.format(**filled)

    def all_wildcard(self) -> str:
        """``ei.<partition>.>``: every subject of this partition."""
        return self.prefix + ">"

    def match(self, full_subject: str) -> tuple[Subject, dict[str, str]] | None:
        """Find the table entry of a concrete subject and its parameters, or None."""
        if not full_subject.startswith(self.prefix):
            return None
        tokens = full_subject[len(self.prefix) :].split(".")
        for subject in ALL:
            tmpl = subject.template.split(".")
            if len(tmpl) != len(tokens):
                continue
            params: dict[str, str] = {}
            for t, tok in zip(tmpl, tokens):
                if t.startswith("{"):
                    params[t[1:-1]] = tok
                elif t != tok:
                    break
            else:
                return subject, params
        return None
