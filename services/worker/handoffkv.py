"""A PD hand-off's K/V in pieces: cut on the prefill node, put together on the decode node (sans-IO).

Contains zero I/O: the worker's shell (``services/worker/service.py``) sends the pieces (``work.<decode>.kv``,
request → ``KvChunkAck``) and answers them; this module decides their size, builds them and keeps the decode
node's partial K/V. Times are the caller's ``now`` (monotonic seconds); nothing here sleeps.

Why: a real engine's hand-off carries the prompt's K/V pages (``TorchEngine.handoff``), which grow with the
prompt: 512 B a token for the tiny test llama, 128 KiB for Llama-3-8B in bf16 (32 layers × K and V × 8 KV heads ×
128 × 2 B). One NATS message holds at most the server's ``max_payload`` (1 MiB by default; ``up``, compose and the
Slurm job set 16 MiB, ``shared.natsserver.MAX_PAYLOAD_BYTES``): sent whole, a 1,100-token prompt of an 8-layer,
hidden-256 model (18 MB of K/V) failed with ``MaxPayloadError``, and an 8B model's PD prompts were capped at ~128
tokens. Here the K/V goes as ``KvChunk`` pieces of at most :data:`CHUNK_CAP_BYTES` (8 MiB, what nats-server
advises as the most for one message) that fit the connection's ``max_payload`` (:func:`chunk_bytes`), a window of
them in flight at once (``WINDOW``), each acknowledged; the ``DecodeWork`` that names the transfer follows the last
acknowledgement, so the decode node holds the whole K/V when the work arrives.

Flow::

    prefill node                                   decode node (KvAssembler)
    split(kv) ─ KvChunk i ─────work.<d>.kv──────▶ add(chunk): copied into one buffer of ``total`` bytes at
               ◀──────── KvChunkAck(i, error) ─── ``offset``, CRC-32 checked; a piece held already is
    (≤ WINDOW in flight; one unanswered is sent      answered again (a resend), never stored twice; a new
     again, up to ``TRIES``; ``full`` + ``queued``:   transfer without room waits in a queue, first come,
     asked again while it waits its turn; ``full``:   first served (its place: ``KvChunkAck.queued``)
     again after a backoff, up to ``FULL_TRIES``;
     any other error fails the hand-off: the
     request's 500)
    DecodeWork(kv_transfer, kv_chunks, kv_bytes) ─work.<d>.decode (JetStream)─▶ take(...): the buffer, once
    or, given up: KvCancel ─────work.<d>.kvcancel──▶ cancel(...): freed at once

Checks: every piece is checked against its transfer (same rid, count and total; ``offset`` = ``index`` × the
first piece's size, the last piece ending at ``total``) and its CRC-32; ``take`` checks the work's rid, piece
count and bytes against the pieces, and that every one came. Bounds (:class:`KvAssembler`): the bytes stored
for every transfer held (``max_bytes``, counted as pieces land, not as announced), the time an incomplete one is
kept without a new piece (``piece_idle_s``) and a complete one without its ``DecodeWork`` (``idle_s``); then
:meth:`KvAssembler.expire` drops it, counted, and a late piece or work of it is refused naming why. A sender that
gives up says so (``KvCancel``: :meth:`KvAssembler.cancel`), and the shell drops a rid's K/V at its abort and what a
node that now serves prefill cannot hand back. Memory: the decode node holds the K/V once (the buffer, handed to the
engine as it is: no second copy); the prefill node holds its bytes and the pieces in flight (``WINDOW`` × ≤ 8 MiB,
each encoded once).

Why not Mooncake (``--kv-pool real``, the real-bytes L2 path): it is an optional extra (``scripts/install-mooncake.sh``)
with its own ports and a registered buffer of fixed-size slots, off by default; every PD cluster of the torch engine
hands off, so the K/V goes over the bus every node already has, with no new dependency.
"""

from __future__ import annotations

import bisect
import mmap
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from shared import messages as m

CHUNK_CAP_BYTES = 8 * 1024 * 1024
"""Most K/V bytes in one piece: nats-server warns about a ``max_payload`` over 8 MB (a message is written whole
into each reader's buffer, so a larger one holds others back); the effective size is less under a smaller
``max_payload`` (:func:`chunk_bytes`)."""
ENVELOPE_BYTES = 8 * 1024
"""Room kept in a message for a piece's other fields (msgpack keys, rid, transfer id, ``src``: ~300 B) and the
NATS protocol line; a piece's data is at most ``max_payload`` minus this."""
MIN_CHUNK_BYTES = 1024
"""The least data a piece carries: a server whose ``max_payload`` leaves less than this is refused
(:func:`chunk_bytes`), rather than sending thousands of messages a prompt."""
WINDOW = 4
"""Pieces of one transfer in flight at once (the prefill node awaits the oldest answer past it): enough to keep a
link busy between acknowledgements, and a bound on what the sender encodes ahead (``WINDOW`` × the piece size)."""
SERVE_PENDING_BYTES = 1024 * 1024 * 1024
"""Bytes of pieces the decode node's subscription queues before nats-py drops one (the bus's core subscriptions'
bound): ``WINDOW`` × 8 MiB from each of 32 prefill nodes at once."""
TRIES = 3
"""Sends of one piece without an answer before the hand-off fails (a NATS reconnect loses a request in flight)."""
FULL_TRIES = 6
"""Sends of one piece the decode node refuses ``full`` (``KvChunkAck.full``: its hand-off buffer has no room now)
before the hand-off fails, saying so; between them the sender waits :func:`full_backoff_s` (0.1, 0.2, 0.4, 0.8,
1 s: 2.5 s in all), time for transfers held there to be taken by their work or cancelled."""
FULL_BACKOFF_S = 0.1
FULL_BACKOFF_MAX_S = 1.0
ACTIVE_S = 1.0
"""A transfer that stored a new piece within this many seconds is being sent: a new transfer is admitted only if
its total fits beside the bytes stored and the bytes such transfers still have to send (:meth:`KvAssembler.add`).
A live sender keeps ``WINDOW`` pieces in flight, each answered in milliseconds; a quiet one (a forged or abandoned
announcement) reserves nothing. One whose piece was refused ``full`` within ``ACTIVE_S`` + :data:`FULL_BACKOFF_MAX_S`
is being sent too (its sender waits at most :data:`FULL_BACKOFF_MAX_S` between tries): before, it counted as quiet
while it waited, and a newcomer admitted meanwhile took the room its work was freeing (review 54)."""
RESERVE_HORIZON_S = 5.0
"""What a transfer being sent keeps room for is at most what it would store in this many seconds at the rate it has
stored so far (bytes stored ÷ the seconds from its first to its last stored piece, at least
:data:`RESERVE_MIN_SPAN_S`): a live sender's remainder, usually all of it (pieces come milliseconds apart), but not
the announced total of a sender that trickles one small piece a second to keep it reserved (before, 1 KiB every
0.9 s announcing the whole buffer kept every other hand-off refused ``full``: review 54)."""
RESERVE_MIN_SPAN_S = 0.05
"""The least span :data:`RESERVE_HORIZON_S`'s rate is measured over: a transfer of one stored piece keeps room for
at most 100 (= 5 / 0.05) of its pieces."""
FULL_PREFIX = "hand-off buffer full"
"""How :meth:`KvAssembler.add`'s refusal for want of room starts (the shell answers it ``full``: transient)."""
OPEN_MAX = 1024
"""Transfers the decode node receives at once: past it, a piece of a new one is refused ``full``. Stored bytes bound
the memory; this bounds the address space that announced totals reserve (one anonymous mapping each) and the
bookkeeping, so that pieces announcing huge K/Vs cannot exhaust either."""
OPEN_PER_SENDER = 128
"""Transfers one sender (``KvChunk.src``, its bus instance: ``worker-<prefill node>``) has open at once: past it, a
piece of a new one of it is refused ``full``. A prefill node sends at most 16 hand-offs at once
(``HANDOFF_SENDS_MAX``) and each one's work follows its last piece within milliseconds; this keeps one leaking or
forging sender from taking all :data:`OPEN_MAX` (it takes 8 senders). ``src`` is what the sender stamps: a sender
that forges a new one for each transfer is bounded only by :data:`OPEN_MAX` and the idle timeouts."""
CANCEL_TIMEOUT_S = 1.0
"""The most a sender waits to hand its ``KvCancel`` to the bus (core NATS: it waits for no answer)."""
ENDED_KEPT = 4096
"""Transfers the decode node remembers after they ended (taken, dropped): a late piece or ``DecodeWork`` of one is
answered with what became of it instead of starting a new one."""
CANCELLED_UNHELD_KEPT = 1024
"""Cancels of transfers not held (one overtook its first piece) the decode node remembers, apart from
:data:`ENDED_KEPT`'s transfers that ended here: a flood of cancels naming unknown transfers (a worker identity may
send them) forgets only other such cancels, not what became of transfers really held (review 54: 4,096 of them
wiped that memory, and a late piece of a cancelled transfer opened it again)."""


QUEUE_MAX = 1024
"""Transfers waiting for room at once (tickets in :attr:`KvAssembler.queue`): past it, a piece of a new transfer is
refused ``full`` without a place (counted ``queue.refused``; its sender's plain ``full`` retries, 2.5 s, then it
fails saying the queue was full)."""
QUEUE_PER_SENDER = OPEN_PER_SENDER
"""Tickets one sender (``KvChunk.src``) holds at once: a prefill node sends at most 16 hand-offs at once, so only
a leaking or forging sender reaches this; it keeps one sender from taking the whole :data:`QUEUE_MAX`."""
TICKET_IDLE_S = 3.0
"""A ticket whose sender has not asked again for this many seconds is dropped (counted ``queue.expired``): a live
waiting sender asks at least every :data:`FULL_BACKOFF_MAX_S` (1 s, :func:`queue_poll_s`), so one gone quiet
(stopped, cancelled without its ``KvCancel`` arriving, crashed) holds the queue at most this long."""
QUEUE_POLL_S = 0.2
"""Seconds a sender whose transfer is first in the queue waits before asking again (:func:`queue_poll_s`): room is
given only to the asker at the head, which finds it at most this late; one further back asks less often. An ask
carries no K/V (a data-less ``KvChunk``: :meth:`KvAssembler.add`), and the piece follows once the answer says its
turn came. Before, each ask carried a whole piece (up to 8 MiB) every 0.05 s: 16 queued hand-offs sent ~460 MiB/s
of asks (review 55)."""
HEAD_HOLD_S = 5.0
"""Seconds the queue keeps strict first come, first served without progress: a ticket that can fit once room frees
holds every transfer behind it (and newcomers) while the buffer frees bytes (a transfer held ends: taken, cancelled,
discarded, expired) at least once in this many seconds since the later of its first ask and the last freeing; past
them (nothing frees: what is stored waits for work that does not come), those behind it are admitted as they fit
while it keeps its place, until bytes free again. A ticket that can never fit beside the bytes its own sender's
transfers store holds other senders back not at all, and its sender's own later transfers at most this long from
when it became its sender's first (:meth:`KvAssembler._holds_back`). Before, every head that could not fit now held
the others back at most 5 s from its first refusal: a large legitimate head was then starved by steady smaller
traffic (a 450-KB head in a 600-KB buffer never admitted in 35 s), and a head whose sender asked only while there
was room never started the clock at all (second review 55). One clock for the queue, not one per ticket: a chain of
forged tickets at the head cannot multiply it."""
GRANT_USE_S = 2.0
"""Seconds a ticket's sender has, after an ask answered "" (its turn came), to send the piece (up to 8 MiB: ~0.7 s on a
100-Mbit/s link, plus either node's event-loop stalls; 0.4 s at first, which a slow link or a loaded node would miss
again and again, each miss sending the ticket to the back of the queue): past them, the ticket
is dropped (counted ``queue.unused_turns``) and holds nobody back; its sender's next ask or piece queues it again at
the end. Before, a forged ticket that asked without data while there was room and never sent its piece kept its
place as the head and held every real hand-off back for good (second review 55: a real request 500 after 30 s with
the buffer empty)."""
QUEUE_HOLDING_PER_SENDER = 16
"""Tickets of one sender :meth:`KvAssembler.holding` counts at most: a prefill node sends at most 16 hand-offs at once
(``services.worker.service.HANDOFF_SENDS_MAX``)."""
QUEUE_WAIT_EDGES_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Bucket edges (s) of :attr:`KvAssembler.queue_waits` (``ei_node_handoff_queue_wait_seconds``)."""


def queue_poll_s(place: int) -> float:
    """Seconds a sender told its transfer waits at ``place`` (1 = next in the queue) waits before asking again:
    :data:`QUEUE_POLL_S` × ``place``, at most :data:`FULL_BACKOFF_MAX_S` (so its ticket, kept
    :data:`TICKET_IDLE_S` without an ask, stays alive)."""
    return min(FULL_BACKOFF_MAX_S, QUEUE_POLL_S * max(1, place))


def ask_of(c: m.KvChunk) -> m.KvChunk:
    """The data-less ask for ``c``'s transfer (its fields, no ``data``, ``crc32`` 0): what a sender whose transfer
    waits in the queue sends to ask for its turn (:meth:`KvAssembler.add` answers "" when it came: send the piece)."""
    return m.KvChunk(transfer=c.transfer, rid=c.rid, index=c.index, count=c.count, offset=c.offset, total=c.total,
                     crc32=0, data=b"", attempt=c.attempt, router=c.router)  # fmt: skip


class KvSendFailed(Exception):
    """A hand-off's K/V did not reach its decode node (a piece refused, or unanswered after :data:`TRIES` sends): the
    prefill node fails the request with these words, as it does a hand-off the bus refused."""


class KvMissing(Exception):
    """The K/V a ``DecodeWork`` names is not (all) here; ``duplicate``: it was taken already (the work came twice);
    ``unknown``: no piece of it ever came to this assembler (a decode node restarted after the pieces were answered,
    or a work naming a transfer never sent)."""

    def __init__(self, reason: str, *, duplicate: bool = False, unknown: bool = False) -> None:
        super().__init__(reason)
        self.duplicate = duplicate
        self.unknown = unknown


def full_backoff_s(tries: int) -> float:
    """Seconds to wait before sending again a piece refused ``full`` ``tries`` (>= 1) times: doubling from
    :data:`FULL_BACKOFF_S`, at most :data:`FULL_BACKOFF_MAX_S`."""
    return min(FULL_BACKOFF_MAX_S, FULL_BACKOFF_S * 2 ** (max(1, tries) - 1))


FULL_WAIT_S = sum(full_backoff_s(t) for t in range(1, FULL_TRIES))
"""Seconds the sender's retries of one piece refused ``full`` span (2.5: :func:`full_backoff_s` between its
:data:`FULL_TRIES` sends): a transfer refused ``full`` waits for room, so a refusal keeps it, but at most this long
past ``piece_idle_s`` after its last newly stored piece (:meth:`KvAssembler.expire`)."""


def chunk_bytes(max_payload: int, cap: int = CHUNK_CAP_BYTES) -> int:
    """K/V bytes per piece for a connection whose server takes ``max_payload`` bytes a message (nats-py's
    ``nc.max_payload``, from the server's INFO): ``min(cap, max_payload - ENVELOPE_BYTES)``.

    Raises:
        ValueError: ``max_payload`` leaves less than :data:`MIN_CHUNK_BYTES` (a misconfigured server), or ``cap`` is
            below that.
    """
    if cap < MIN_CHUNK_BYTES:
        raise ValueError(f"a K/V piece cap of {cap} B is below the least piece, {MIN_CHUNK_BYTES} B")
    room = int(max_payload) - ENVELOPE_BYTES
    if room < MIN_CHUNK_BYTES:
        raise ValueError(
            f"the NATS server's max_payload of {max_payload} B leaves {room} B for a K/V piece (at least "
            f"{MIN_CHUNK_BYTES} B needed): raise max_payload (shared.natsserver.MAX_PAYLOAD_BYTES, 16 MiB)"
        )
    return min(cap, room)


def pieces(total: int, size: int) -> int:
    """How many pieces of ``size`` bytes carry ``total`` bytes (at least 1)."""
    return max(1, -(-total // size))


def split(
    kv: bytes | bytearray | memoryview, *, transfer: str, rid: str, size: int, attempt: int = 0, router: str = ""
) -> Iterator[m.KvChunk]:
    """The pieces of ``kv`` (``size`` bytes each, the last one the rest), built one at a time as the sender
    takes them: each one's ``data`` is a view of ``kv`` (no copy; the bus encodes it once) and its CRC-32 is
    computed then (~6 GB/s, zlib). ``kv`` must stay unchanged until the last piece is sent. ``attempt`` and
    ``router``: the hand-off's ``DecodeWork``'s (an abort of them frees the K/V on the decode node).

    Raises:
        ValueError: ``kv`` is empty or ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"piece size {size} B")
    view = memoryview(kv).cast("B")
    total = len(view)
    if total == 0:
        raise ValueError("no K/V to send")
    count = pieces(total, size)
    for i in range(count):
        data = view[i * size : min(total, (i + 1) * size)]
        yield m.KvChunk(transfer=transfer, rid=rid, index=i, count=count, offset=i * size, total=total,
                        crc32=zlib.crc32(data), data=data, attempt=attempt, router=router)  # type: ignore[arg-type]  # fmt: skip


@dataclass(slots=True, eq=False)
class Assembly:
    """The decode node's K/V of one transfer so far."""

    transfer: str
    rid: str
    count: int
    """Pieces expected."""
    total: int
    """Bytes expected (``len(buf)``)."""
    size: int
    """Bytes of every piece but the last (the first piece's, or any but the last one's)."""
    buf: mmap.mmap
    """Anonymous memory of ``total`` bytes: its pages are taken as pieces land, so a transfer that announces more
    than it sends (or a hostile piece) costs what came, not ``total`` (a ``bytearray`` is zeroed, all of it, at once)."""
    have: bytearray
    """``have[i]`` = 1 once piece i is stored."""
    src: str
    """Instance that sent the first piece (``Msg.src``: ``worker-<prefill node>``), for the log."""
    started: float
    last: float
    """``now`` of the last newly stored piece (monotonic s): :meth:`KvAssembler.expire` counts from it. A piece sent
    again (held already) does not move it: a sender that re-sends one piece keeps nothing open."""
    full_at: float = float("-inf")
    """``now`` of the last piece of it refused ``full`` (its sender waits for room): keeps it at most
    :data:`FULL_WAIT_S` past its idle time from :attr:`last`."""
    attempt: int = 0
    """The hand-off's attempt (``KvChunk.attempt``, the first piece's)."""
    router: str = ""
    """The hand-off's owning router (``KvChunk.router``, the first piece's; "" = ``router``)."""
    got: int = 0
    """Pieces stored."""
    stored: int = 0
    """Bytes stored (what this transfer counts in :attr:`KvAssembler.held_bytes`)."""
    refused_full: int = 0
    """Pieces of it refused ``full`` (each sent again by a live sender)."""
    dup: int = field(default=0)
    """Pieces sent again (answered, not stored)."""

    @property
    def complete(self) -> bool:
        return self.got == self.count


@dataclass(slots=True, eq=False)
class Ticket:
    """A new transfer refused for want of room, waiting its turn in :attr:`KvAssembler.queue` (first come, first
    served by its first ask)."""

    transfer: str
    rid: str
    total: int
    """Bytes it announces (its first asking piece's ``total``)."""
    src: str
    """Its sender (``KvChunk.src``)."""
    seq: int
    """Its number in the order of first asks on this assembler (1, 2, ...): transfers leave the queue in this order
    (a sender's log line with ``--log-requests`` names it)."""
    first: float
    """``now`` of its first ask (monotonic s): the wait :attr:`KvAssembler.queue_waits` records counts from it."""
    last: float
    """``now`` of its last ask: dropped :data:`TICKET_IDLE_S` after it."""
    attempt: int = 0
    """The hand-off's attempt (``KvChunk.attempt``): an abort of its rid at this attempt or later drops the ticket."""
    router: str = ""
    """The hand-off's owning router (``KvChunk.router``)."""
    asks: int = 1
    head: float | None = None
    """``now`` when it was first seen the first of its sender's tickets (monotonic s): if it can never fit beside its
    sender's stored bytes it holds that sender's later transfers back at most :data:`HEAD_HOLD_S` from then."""
    granted: float | None = None
    """``now`` of its first ask answered "" (its turn came) not yet followed by its piece: dropped
    :data:`GRANT_USE_S` after it (:meth:`KvAssembler.add`)."""


@dataclass(slots=True, eq=False)
class WaitHistogram:
    """Fixed-bucket histogram of seconds (``shared.metrics.BucketHistogram``): ``counts[i]`` samples <= ``edges[i]``
    and above the edge before, the last one past every edge; ``sum`` of the samples (s)."""

    edges: tuple[float, ...] = QUEUE_WAIT_EDGES_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_WAIT_EDGES_S) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        """Record one sample of ``seconds``."""
        self.counts[bisect.bisect_left(self.edges, seconds)] += 1
        self.sum += seconds


class KvAssembler:
    """The decode node's hand-off K/V being received (sans-IO; the shell answers each piece with :meth:`add`'s
    words and hands a ``DecodeWork`` its K/V with :meth:`take`).

    The buffer counts the bytes stored, as they land, not the total a transfer's first piece announces. Before,
    a transfer reserved its announced total from its first piece on: one 1-KiB piece announcing 8 GiB (a forged
    piece, a prefill node that died after it) filled ``--handoff-buffer-bytes`` for ``--handoff-kv-timeout-s``
    (60 s), and every real hand-off meanwhile was refused "full" (its client's 500). A transfer agent that receives
    pushed bytes cannot trust an announcement: NIXL and Mooncake let the receiver reserve what it will receive (the
    decode side allocates the request's KV blocks from its own scheduler before the prefill side writes them, and an
    unread reservation is freed after a timeout); here the sender names the size, so what it costs is what it has
    delivered, and the rest is bounded apart:

    * a new transfer is admitted only when its announced total fits beside the bytes stored now and the bytes still
      to come of the transfers being sent (a new piece stored within :data:`ACTIVE_S`, or one refused ``full`` lately:
      :meth:`reserved`), each at most what its rate so far sends in :data:`RESERVE_HORIZON_S`; a quiet transfer
      reserves nothing and a trickling one little, so a forged announcement costs what it stored, and a few seconds
      of its own rate while it keeps sending. Before, two transfers
      admitted at once, each fitting alone, each stored part and then refused the other's pieces ``full`` until both
      senders gave up. A total past ``max_bytes`` is refused at once (``refused.too_large``: it could never fit, so
      the sender does not retry it); at most :data:`OPEN_MAX` are open (the address space their mappings reserve),
      at most :data:`OPEN_PER_SENDER` of one sender;
    * a new transfer refused for room (or for :data:`OPEN_MAX`) gets a :class:`Ticket`, its place in :attr:`queue`
      by its first ask, and its sender is told the place (:meth:`place`; the shell's ``KvChunkAck.queued``): room
      that frees goes to the oldest ticket first, so while one waits, a younger one or a newcomer is refused
      ``full`` even when it would fit (first come, first served; a ticket of a sender at its
      :data:`OPEN_PER_SENDER` waits for its sender, not for room, and holds nobody back; so does, for other
      senders, one whose total does not fit beside its own sender's stored bytes; a first ticket that cannot fit
      holds its own sender's later ones back at most :data:`HEAD_HOLD_S`, while one that can fit once room frees
      holds everyone behind it: :meth:`_holds_back`). A waiting sender asks without data (:func:`ask_of`); one told
      its turn came that does not send its piece within :data:`GRANT_USE_S` loses its ticket. Before, the room went to
      whichever sender's retry came first, and one that waited past its 2.5 s of retries failed although the
      buffer drained (review 54: 3 of 36 hand-offs, 12 at once into a buffer that holds one). A ticket whose
      sender stops asking for :data:`TICKET_IDLE_S` (stopped, crashed), cancels (:meth:`cancel`) or whose transfer
      the shell discards or refuses (:meth:`discard`, :meth:`refuse`, :meth:`tickets`: an abort of its rid) leaves the
      queue, so it holds the others at most that long; at most :data:`QUEUE_MAX` wait, :data:`QUEUE_PER_SENDER`
      of one sender (past that: ``full`` without a place, counted ``queue.refused``);
    * a piece that would take the bytes stored past ``max_bytes`` (a transfer that was quiet when another was
      admitted) is refused ``full``, its transfer kept: a transient state, so the sender sends it again after a
      backoff (:data:`FULL_TRIES`), while transfers held are taken by their work, cancelled, or expire. A ``full``
      refusal is no drop (counted ``full_refusals``, not ``refused.*``);
    * an incomplete transfer without a newly stored piece for ``piece_idle_s`` is dropped (a live sender's next piece
      comes within its ``--handoff-chunk-timeout-s``, 5 s; one sent again, held already, does not keep it: a sender
      that re-sends one piece cannot keep a transfer open), extended by a ``full`` refusal (its sender waits for room)
      to at most :data:`FULL_WAIT_S` more; a complete one without its ``DecodeWork`` for ``idle_s`` (the work waits
      its turn in the decode node's JetStream consumer);
    * a sender that gives up says so (``KvCancel``, :meth:`cancel`), and the shell drops what an abort or a switch to
      prefill leaves unserved (:meth:`discard`); a cancel that overtook its transfer's first piece (they come on
      separate subscriptions) is remembered, so that the piece does not open the transfer again.

    Args:
        max_bytes: bytes every transfer held may store together (``--handoff-buffer-bytes``).
        idle_s: seconds a complete transfer is kept without its ``DecodeWork`` (:meth:`expire`).
        piece_idle_s: seconds an incomplete transfer is kept without a newly stored piece; None: ``idle_s``.

    Counters (``counters``): ``chunks`` / ``bytes`` stored, ``duplicate_chunks`` (sent again, not stored),
    ``full_refusals`` (a piece refused ``full``: sent again, no drop), ``refused.<why>`` (``too_large``,
    ``mismatch``, ``crc``, ``ended``, ``nomem``: the kernel refused its buffer), ``taken`` / ``taken_bytes`` (handed
    to a ``DecodeWork``), ``missing`` (a work whose K/V was not all here), ``duplicate_work`` (a work of a transfer
    taken already), ``expired`` / ``expired_bytes`` (dropped by :meth:`expire`), ``discarded`` (dropped by
    :meth:`discard`: its work is not served here), ``cancelled`` / ``cancelled_bytes`` (dropped by :meth:`cancel`: its
    sender gave it up), ``cancelled_unheld`` (a cancel of a transfer not held: remembered as ended); the queue's
    ``queue.entered`` (tickets given), ``queue.admitted`` (transfers admitted from it; their waits in
    :attr:`queue_waits`), ``queue.expired`` (tickets whose sender stopped asking), ``queue.cancelled``,
    ``queue.discarded`` (its transfer discarded or refused, its rid aborted), ``queue.refused`` (no place: the queue
    at its bound), ``queue.asks`` (data-less asks), ``queue.unused_turns`` (tickets dropped: their turn came and their
    piece did not follow within :data:`GRANT_USE_S`).

    Raises:
        ValueError: ``max_bytes`` < 1, or ``idle_s`` or ``piece_idle_s`` <= 0.
    """

    def __init__(self, max_bytes: int, idle_s: float, piece_idle_s: float | None = None) -> None:
        piece_idle_s = idle_s if piece_idle_s is None else piece_idle_s
        if max_bytes < 1 or not idle_s > 0 or not piece_idle_s > 0:
            raise ValueError(f"K/V assembler: max_bytes {max_bytes} must be >= 1, idle_s {idle_s} and piece_idle_s "
                             f"{piece_idle_s} > 0")  # fmt: skip
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self.piece_idle_s = piece_idle_s
        self.open: dict[str, Assembly] = {}
        """Transfers being received or waiting for their ``DecodeWork``, by id."""
        self.held_bytes = 0
        """Bytes stored over :attr:`open` (``Assembly.stored``): what their buffers take."""
        self.ended: OrderedDict[str, str] = OrderedDict()
        """Transfer id → what became of it (the newest :data:`ENDED_KEPT`)."""
        self.cancelled_unheld: OrderedDict[str, str] = OrderedDict()
        """Transfer id → its cancel, for cancels of transfers not held (the newest :data:`CANCELLED_UNHELD_KEPT`)."""
        self.by_src: Counter[str] = Counter()
        """Sender (``Assembly.src``) → its transfers in :attr:`open` (:data:`OPEN_PER_SENDER`)."""
        self.held_by_src: Counter[str] = Counter()
        """Sender → bytes stored for its transfers in :attr:`open`: a ticket of it whose total does not fit beside them
        waits for its sender, not for room (:meth:`_holds_back`)."""
        self.queue: OrderedDict[str, Ticket] = OrderedDict()
        """New transfers refused for want of room, waiting their turn, by id, oldest first ask first
        (:data:`QUEUE_MAX`)."""
        self.queue_by_src: Counter[str] = Counter()
        """Sender → its tickets in :attr:`queue` (:data:`QUEUE_PER_SENDER`)."""
        self.queue_waits = WaitHistogram()
        """Seconds each transfer admitted from the queue waited there (first ask to admission)."""
        self.last_admitted: Ticket | None = None
        """The ticket of the last transfer :meth:`add` admitted from the queue (the shell logs it and clears this)."""
        self._seq = 0
        self._now = float("-inf")
        """The last :meth:`add`'s ``now``."""
        self._freed_at = float("-inf")
        """When bytes stored last freed (a transfer that stored some ended), as of the last :meth:`add`'s or
        :meth:`expire`'s ``now`` (monotonic s; at most ~1 s stale while tickets wait: their senders ask at least that
        often): the queue's progress clock (:data:`HEAD_HOLD_S`)."""
        self.counters: Counter[str] = Counter()

    def add(self, c: m.KvChunk, now: float) -> str:
        """Store piece ``c`` (received at ``now``, monotonic s). Returns "" (stored, or held already: a piece sent
        again, counted ``duplicate_chunks``) or why it is refused (counted ``refused.<why>``): one starting with
        :data:`FULL_PREFIX` (``full``: no room now, or not its turn: :meth:`place` > 0 says its place in the queue)
        leaves its transfer as it was (the sender asks again); any other drops the transfer (its sender fails the
        hand-off with these words). A piece of a new transfer is admitted only when no older ticket waits for room
        (its own ticket, if any, first) and it fits; refused, it gets a ticket at the end of :attr:`queue`. O(open +
        queue) for a piece of a new transfer, O(1) for one of a transfer held.

        A piece without ``data`` is an ask (:func:`ask_of`, counted ``queue.asks``): a queued transfer's sender asking
        for its turn without sending K/V. It is answered as its piece would be, but "" means "its turn came: send
        the piece" (nothing is stored or opened; the ticket keeps its place, so the piece that follows is admitted
        unless room went meanwhile to a transfer held, which then queues it again). A ticket whose turn came and whose
        piece does not follow within :data:`GRANT_USE_S` is dropped (counted ``queue.unused_turns``)."""
        self._now = now
        a = self.open.get(c.transfer)
        if not c.data:
            self.counters["queue.asks"] += 1
            if a is not None:  # admitted already (another piece of it): its pieces go
                return _fits(a, c, ask=True)
        if a is None:
            gone = self.ended.get(c.transfer) or self.cancelled_unheld.get(c.transfer)
            if gone is not None:
                self.counters["refused.ended"] += 1
                return f"transfer {c.transfer} of {c.rid} ended here already: {gone}"
            why = _shape(c) if c.data else (f"piece {c.index} of a transfer of {c.count}" if c.index >= c.count else "")
            if why:
                self.counters["refused.mismatch"] += 1
                return why
            if c.total > self.max_bytes:
                self.counters["refused.too_large"] += 1
                return (f"a K/V of {c.total} B can never fit this node's {self.max_bytes} B hand-off buffer "
                        f"(--handoff-buffer-bytes)")  # fmt: skip
            reserved = self.reserved(now)
            other = self._ticket(c)
            if other:
                self.counters["refused.mismatch"] += 1
                return other
            t = self._ask(c.transfer, now)
            if t is not None and c.data:  # its piece came: a turn granted is used
                t.granted = None
            ahead = self._ahead(t, now, c.src)
            no_room = self.held_bytes + reserved + c.total > self.max_bytes or len(self.open) >= OPEN_MAX
            if ahead or no_room or self.by_src[c.src] >= OPEN_PER_SENDER:
                self.counters["full_refusals"] += 1
                why = self._full(c.total, "a new transfer of", reserved, c.src)
                if t is None:
                    t = self._enqueue(c, now)
                    if t is None:
                        self.counters["queue.refused"] += 1
                        return f"{why}; its queue of transfers waiting for room is full ({len(self.queue)} waiting)"
                return f"{why}; waiting for room, {ahead + 1} of {len(self.queue)} in line"
            if not c.data:  # an ask: its turn came (its ticket keeps its place for the piece that follows)
                if t is not None and t.granted is None:  # a re-ask does not extend it: GRANT_USE_S from the first
                    t.granted = now
                return ""
            size = len(c.data) if c.index < c.count - 1 else (c.offset // c.index if c.index else c.total)
            try:
                buf = mmap.mmap(-1, c.total)
            except (OSError, OverflowError) as e:  # the kernel refuses the mapping (ENOMEM): an answer, not a lost request
                self.counters["refused.nomem"] += 1
                if t is not None:  # refused for good: its place goes to the next one
                    self._dequeue(t)
                return f"cannot allocate {c.total} B for transfer {c.transfer} of {c.rid}: {e}"
            a = Assembly(c.transfer, c.rid, c.count, c.total, size, buf, bytearray(c.count), c.src, now, now, attempt=c.attempt,
                         router=c.router)  # fmt: skip
            self.open[c.transfer] = a
            self.by_src[a.src] += 1
            if t is not None:  # its turn came: room goes to the oldest ticket first
                self._dequeue(t)
                self.counters["queue.admitted"] += 1
                self.queue_waits.observe(now - t.first)
                self.last_admitted = t
        why = _fits(a, c)
        if why:
            self.counters["refused.mismatch"] += 1
            self._end(a, f"refused a piece: {why}")
            return why
        if a.have[c.index]:  # not a sign of progress: a.last stays (a re-sender keeps nothing open)
            a.dup += 1
            self.counters["duplicate_chunks"] += 1
            return ""
        if zlib.crc32(c.data) != c.crc32:
            self.counters["refused.crc"] += 1
            self._end(a, f"piece {c.index} failed its CRC-32 check")
            return f"piece {c.index} of transfer {c.transfer} ({len(c.data)} B) failed its CRC-32 check"
        if self.held_bytes + len(c.data) > self.max_bytes:  # admitted while another one was quiet, which went on since
            a.full_at = now  # its sender waits for room: kept, at most FULL_WAIT_S past its idle time (_deadline)
            a.refused_full += 1
            self.counters["full_refusals"] += 1
            return self._full(len(c.data), f"piece {c.index} of")
        a.buf[c.offset : c.offset + len(c.data)] = c.data
        a.have[c.index] = 1
        a.got += 1
        a.stored += len(c.data)
        self.held_bytes += len(c.data)
        self.held_by_src[a.src] += len(c.data)
        a.last = now
        self.counters["chunks"] += 1
        self.counters["bytes"] += len(c.data)
        return ""

    def take(self, transfer: str, rid: str, count: int, total: int) -> memoryview:
        """The K/V of ``transfer`` for the ``DecodeWork`` of ``rid`` that names it with ``count`` pieces of
        ``total`` bytes: a writable view of its buffer, which is the caller's from now on (the engine reads its pages
        in place: ``TorchEngine.accept_decode``); the transfer ends here.

        Raises:
            KvMissing: not every piece came, the transfer is not known (dropped, or never started: the decode
                node restarted), or the work's rid, count or bytes differ from its pieces' (counted ``missing``; the
                transfer is dropped); ``duplicate`` when it was taken already (counted ``duplicate_work``).
        """
        a = self.open.get(transfer)
        if a is None:
            gone = self.ended.get(transfer) or self.cancelled_unheld.get(transfer)
            if gone == "taken":
                self.counters["duplicate_work"] += 1
                raise KvMissing(f"transfer {transfer} was taken already (its work came twice)", duplicate=True)
            self.counters["missing"] += 1
            raise KvMissing(f"transfer {transfer} is not here ({gone if gone is not None else 'no piece of it came'})", unknown=gone is None)
        if (a.rid, a.count, a.total) != (rid, count, total):
            self.counters["missing"] += 1
            why = (f"transfer {transfer} carries {a.count} pieces, {a.total} B of {a.rid}; its work names {count} "
                   f"pieces, {total} B of {rid}")  # fmt: skip
            self._end(a, why)
            raise KvMissing(why)
        if not a.complete:
            self.counters["missing"] += 1
            why = f"{a.got} of the {a.count} pieces of transfer {transfer} came"
            self._end(a, why)
            raise KvMissing(why)
        self._end(a, "taken")
        self.counters["taken"] += 1
        self.counters["taken_bytes"] += a.total
        return memoryview(a.buf)

    def discard(self, transfer: str, why: str = "its work was not served here") -> bool:
        """Drop ``transfer``: its work will not be served here (an older attempt, a duplicate rid, an abort of its
        rid, a node that serves prefill now and cannot hand it back: ``why``, which a late piece or work of it is
        told). True if it was held. A ticket of it leaves the queue (counted ``queue.discarded``): before, an aborted
        request's hand-off kept its place and was admitted ahead of live ones (review 55)."""
        self._drop_ticket(transfer)
        a = self.open.get(transfer)
        if a is None:
            return False
        self.counters["discarded"] += 1
        self._end(a, f"discarded: {why}")
        return True

    def refuse(self, transfer: str, why: str) -> None:
        """Remember that the shell refused ``transfer``'s pieces before they reached :meth:`add` (``why``: a node that
        serves prefill now): its work, when it comes, is told why (not "no piece of it came"); a ticket of it leaves the
        queue (``queue.discarded``). Counted by the shell."""
        self._drop_ticket(transfer)
        if transfer not in self.open:
            self._remember(transfer, f"refused: {why}")

    def cancel(self, transfer: str, rid: str, why: str) -> Assembly | None:
        """Drop ``transfer`` of ``rid``: its sender gave the hand-off up (``KvCancel``: ``why``); returns it if it
        was held (a cancel naming another rid than the held transfer's changes nothing). A cancel of a transfer not
        held and not ended is remembered as ended (counted ``cancelled_unheld``): it overtook the transfer's piece
        (``work.<n>.kvcancel`` and ``work.<n>.kv`` are separate subscriptions), which is then refused, not opened
        again to wait ``piece_idle_s`` for pieces that never come. The memory of ended transfers is bounded
        (:data:`ENDED_KEPT`, oldest forgotten first), that of such cancels apart (:data:`CANCELLED_UNHELD_KEPT`), so
        that a flood of them does not forget what became of transfers held here."""
        t = self.queue.get(transfer)
        if t is not None and t.rid == rid:  # it waited for room: its place goes to the next one
            self._dequeue(t)
            self.counters["queue.cancelled"] += 1
        a = self.open.get(transfer)
        if a is None:
            if transfer not in self.ended and transfer not in self.cancelled_unheld:
                self.counters["cancelled_unheld"] += 1
                self.cancelled_unheld[transfer] = f"cancelled by its sender: {why}" if why else "cancelled by its sender"
                while len(self.cancelled_unheld) > CANCELLED_UNHELD_KEPT:
                    self.cancelled_unheld.popitem(last=False)
            return None
        if a.rid != rid:
            return None
        self.counters["cancelled"] += 1
        self.counters["cancelled_bytes"] += a.stored
        self._end(a, f"cancelled by its sender: {why}" if why else "cancelled by its sender")
        return a

    def expire(self, now: float) -> list[Assembly]:
        """Drop every incomplete transfer without a newly stored piece for ``piece_idle_s`` (a piece refused ``full``
        keeps it up to ``piece_idle_s`` after the refusal, but never past ``piece_idle_s`` + :data:`FULL_WAIT_S`
        after its last stored piece), and every complete one without its work for ``idle_s``, at ``now``
        (monotonic s); returns them (the shell logs each). A late piece or work of one is refused naming this. Tickets
        whose sender has not asked for :data:`TICKET_IDLE_S` leave the queue too (counted ``queue.expired``)."""
        self._drop_idle_tickets(now)
        self._now = max(self._now, now)
        out = [a for a in self.open.values() if now >= self._deadline(a)]  # next_deadline's value: no rounding gap
        for a in out:
            self.counters["expired"] += 1
            self.counters["expired_bytes"] += a.stored
            if a.complete:
                self._end(a, f"dropped after {self.idle_s:g} s complete without its work")
            else:
                waited = f", {a.refused_full} refused full" if a.refused_full else ""
                self._end(a, f"dropped after {self.piece_idle_s:g} s without a new piece ({a.got} of {a.count} pieces "
                             f"came{waited})")  # fmt: skip
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next drops a transfer or a ticket (monotonic s), or None when none is held or waits."""
        due = min(self._deadline(a) for a in self.open.values()) if self.open else None
        if self.queue:
            tick = min(min(t.last + TICKET_IDLE_S, t.granted + GRANT_USE_S if t.granted is not None else float("inf"))
                       for t in self.queue.values())  # fmt: skip
            due = tick if due is None else min(due, tick)
        return due

    def holding(self, now: float, per_sender: int = QUEUE_HOLDING_PER_SENDER) -> int:
        """Tickets at ``now`` (monotonic s) that wait for room here, at most ``per_sender`` of one sender: the hand-offs
        that the node's ``NodeState.waiting`` counts (the router's decode choice, the planner's decode queue). A ticket
        that waits for its own sender (at its :data:`OPEN_PER_SENDER` transfers open, or too large to fit beside its
        sender's stored bytes), or whose turn came unused, counts not, and one sender's count is capped, so forged or
        idle tickets cannot push the planner's split. Unlike :meth:`_holds_back` the queue's progress clock
        (:data:`HEAD_HOLD_S`) does not apply: before, a node whose buffer freed nothing for 5 s (the most stuck) counted
        none of its waiting hand-offs and looked idle to the router again (rr-late55). O(queue)."""
        n: Counter[str] = Counter()
        for t in self.queue.values():
            if n[t.src] < per_sender and self._waits_for_room(t, now):
                n[t.src] += 1
        return sum(n.values())

    def _waits_for_room(self, x: Ticket, now: float) -> bool:
        """Whether ticket ``x`` waits for room that frees here at ``now``: its sender has fewer than
        :data:`OPEN_PER_SENDER` transfers open, no turn of it went unused, and its total fits beside the bytes its own
        sender's transfers store."""
        if self.by_src[x.src] >= OPEN_PER_SENDER or x.granted is not None and now - x.granted >= GRANT_USE_S:
            return False
        return self.held_by_src[x.src] + x.total <= self.max_bytes

    def place(self, transfer: str, now: float | None = None) -> int:
        """``transfer``'s place in the queue of transfers waiting for room at ``now`` (monotonic s; None: the last
        :meth:`add`'s; 1 = next), or 0 when it holds no ticket. Tickets that hold nobody back (:meth:`_holds_back`)
        do not count. O(queue)."""
        t = self.queue.get(transfer)
        return 0 if t is None else self._ahead(t, self._now if now is None else now, t.src) + 1

    def tickets(self, keep: Callable[[Ticket], bool], why: str) -> list[Ticket]:
        """Drop every ticket for which ``keep`` is false (an abort of its rid; counted ``queue.discarded``), its
        transfer remembered as ended (``why``: a late piece of it is refused, not queued again); returns them."""
        gone = [t for t in self.queue.values() if not keep(t)]
        for t in gone:
            self._drop_ticket(t.transfer)
            self._remember(t.transfer, f"discarded: {why}")
        return gone

    def _drop_ticket(self, transfer: str) -> None:
        t = self.queue.get(transfer)
        if t is not None:
            self._dequeue(t)
            self.counters["queue.discarded"] += 1

    def _ticket(self, c: m.KvChunk) -> str | None:
        """Why ``c`` cannot ask for its transfer's ticket (another sender's, or another rid's or total's: a ticket
        is its first asker's), or None."""
        t = self.queue.get(c.transfer)
        if t is None or (t.src, t.rid, t.total) == (c.src, c.rid, c.total):
            return None
        return (f"transfer {c.transfer} waits for room for {t.src or 'no src'} ({t.total} B of {t.rid}); this piece "
                f"names {c.src or 'no src'}, {c.total} B of {c.rid}")  # fmt: skip

    def _ask(self, transfer: str, now: float) -> Ticket | None:
        """Drop the tickets idle past :data:`TICKET_IDLE_S`, then record an ask of ``transfer``'s ticket at ``now``;
        returns it, or None when it holds none."""
        self._drop_idle_tickets(now)
        seen: set[str] = set()
        for x in self.queue.values():  # start the head-hold clock of each sender's first ticket (HEAD_HOLD_S)
            if x.src not in seen:
                seen.add(x.src)
                if x.head is None:
                    x.head = now
        t = self.queue.get(transfer)
        if t is not None:
            t.last = now
            t.asks += 1
        return t

    def _ahead(self, t: Ticket | None, now: float, src: str) -> int:
        """Tickets before ``t`` in the queue (all of them when None) that hold back a transfer of sender ``src`` at
        ``now`` (:meth:`_holds_back`)."""
        n = 0
        for x in self.queue.values():
            if x is t:
                break
            if self._holds_back(x, now, src):
                n += 1
        return n

    def _holds_back(self, x: Ticket, now: float, src: str | None) -> bool:
        """Whether ticket ``x`` holds back a transfer of sender ``src`` (None: of any other sender) behind it at
        ``now``: not when it waits for its own sender (at its :data:`OPEN_PER_SENDER` transfers open; or, for another
        sender's, its total does not fit beside the bytes its own sender's transfers store: room that frees cannot go
        to it before they end), nor when its turn came and its piece did not follow within :data:`GRANT_USE_S`. A
        sender's own transfers keep their order, except behind one that cannot fit beside its sender's bytes past
        :data:`HEAD_HOLD_S` of being its sender's first. A ticket that can fit once room frees holds every one behind
        it (strict first come, first served) while bytes free at least once in :data:`HEAD_HOLD_S` since the later of
        its first ask and the last freeing. Before, one sender's ticket that could never fit beside its own stored
        transfer (a forged announcement of the whole buffer) kept every other hand-off out for its sender's whole wait
        (review 55)."""
        if self.by_src[x.src] >= OPEN_PER_SENDER or x.granted is not None and now - x.granted >= GRANT_USE_S:
            return False
        if self.held_by_src[x.src] + x.total <= self.max_bytes:  # it can fit once room frees
            return now - max(self._freed_at, x.first) < HEAD_HOLD_S  # while room frees: strict FIFO
        return x.src == src and (x.head is None or now - x.head < HEAD_HOLD_S)

    def _enqueue(self, c: m.KvChunk, now: float) -> Ticket | None:
        """A ticket for ``c``'s new transfer at the end of the queue, or None past :data:`QUEUE_MAX` or
        :data:`QUEUE_PER_SENDER`."""
        if len(self.queue) >= QUEUE_MAX or self.queue_by_src[c.src] >= QUEUE_PER_SENDER:
            return None
        self._seq += 1
        t = Ticket(c.transfer, c.rid, c.total, c.src, self._seq, now, now, attempt=c.attempt, router=c.router)
        self.queue[c.transfer] = t
        self.queue_by_src[c.src] += 1
        self.counters["queue.entered"] += 1
        return t

    def _dequeue(self, t: Ticket) -> None:
        del self.queue[t.transfer]
        self.queue_by_src[t.src] -= 1
        if self.queue_by_src[t.src] <= 0:
            del self.queue_by_src[t.src]

    def _drop_idle_tickets(self, now: float) -> None:
        """Drop every ticket whose sender has not asked for :data:`TICKET_IDLE_S` (counted ``queue.expired``): it
        stopped waiting, and must not hold the ones behind it; and every one whose turn came :data:`GRANT_USE_S` ago
        without its piece (counted ``queue.unused_turns``)."""
        gone = [t for t in self.queue.values() if now - t.last >= TICKET_IDLE_S]
        for t in gone:
            self._dequeue(t)
            self.counters["queue.expired"] += 1
        unused = [t for t in self.queue.values() if t.granted is not None and now - t.granted >= GRANT_USE_S]
        for t in unused:  # its turn came and its piece did not: it holds nobody back any more
            self._dequeue(t)
            self.counters["queue.unused_turns"] += 1

    def reserved(self, now: float) -> int:
        """Bytes a new transfer's admission keeps room for at ``now`` (monotonic s): for each incomplete transfer being
        sent (a new piece stored within :data:`ACTIVE_S`, or a piece refused ``full`` within :data:`ACTIVE_S` +
        :data:`FULL_BACKOFF_MAX_S`: its sender waits for room), its bytes still to come (announced total less stored),
        at most what it would store in :data:`RESERVE_HORIZON_S` at its rate so far. O(open)."""
        out = 0
        for a in self.open.values():
            if a.complete or (now - a.last >= ACTIVE_S and now - a.full_at >= ACTIVE_S + FULL_BACKOFF_MAX_S):
                continue
            rate = a.stored / max(a.last - a.started, RESERVE_MIN_SPAN_S)  # bytes per s
            out += min(a.total - a.stored, int(rate * RESERVE_HORIZON_S))
        return out

    def _deadline(self, a: Assembly) -> float:
        """When :meth:`expire` drops ``a`` (monotonic s)."""
        if a.complete:
            return a.last + self.idle_s
        return min(max(a.last, a.full_at) + self.piece_idle_s, a.last + self.piece_idle_s + FULL_WAIT_S)

    def _full(self, nbytes: int, what: str, reserved: int = 0, src: str | None = None) -> str:
        many = len(self.open) >= OPEN_MAX
        mine = src is not None and self.by_src[src] >= OPEN_PER_SENDER
        return (f"{FULL_PREFIX}: {self.held_bytes} B stored for {len(self.open)} transfers"
                + (f" ({reserved} B more to come of those being sent)" if reserved else "")
                + f", {what} {nbytes} B would pass its {self.max_bytes} B (--handoff-buffer-bytes)"
                + (f" or its {OPEN_MAX} transfers at once" if many else "")
                + (f" or its {OPEN_PER_SENDER} transfers of one sender ({src or 'no src'}) at once" if mine else ""))  # fmt: skip

    def _end(self, a: Assembly, what: str) -> None:
        if a.stored:
            self._freed_at = self._now
        del self.open[a.transfer]
        self.held_bytes -= a.stored
        self.by_src[a.src] -= 1
        if self.by_src[a.src] <= 0:
            del self.by_src[a.src]
        self.held_by_src[a.src] -= a.stored
        if self.by_src[a.src] <= 0:
            del self.held_by_src[a.src]
        self._remember(a.transfer, what)

    def _remember(self, transfer: str, what: str) -> None:
        self.ended[transfer] = what
        self.ended.move_to_end(transfer)
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)


def _shape(c: m.KvChunk) -> str:
    """Why piece ``c`` cannot be part of any transfer (its own fields disagree), or ""."""
    n = len(c.data)
    if c.index >= c.count:
        return f"piece {c.index} of a transfer of {c.count}"
    if c.index == 0 and c.offset:
        return f"piece 0 at offset {c.offset}"
    if c.index < c.count - 1 and n < MIN_CHUNK_BYTES or c.index == c.count - 1 and c.index and c.offset // c.index < MIN_CHUNK_BYTES:
        return f"piece {c.index} of a transfer in pieces under {MIN_CHUNK_BYTES} B"
    if n == 0 or c.offset + n > c.total:
        return f"piece {c.index} of {n} B at offset {c.offset} does not fit a K/V of {c.total} B"
    if c.index == c.count - 1 and c.offset + n != c.total:
        return f"last piece {c.index} ends at {c.offset + n} B, not at the K/V's {c.total} B"
    if c.index < c.count - 1 and (c.offset != c.index * n or pieces(c.total, n) != c.count):
        return f"piece {c.index} of {n} B at offset {c.offset}: not piece {c.index} of {c.count} equal pieces of {c.total} B"
    if c.index == c.count - 1 and c.index and (c.offset % c.index or pieces(c.total, c.offset // c.index) != c.count):
        return f"last piece {c.index} at offset {c.offset}: not after {c.index} equal pieces of a K/V of {c.total} B in {c.count}"
    return ""


def _fits(a: Assembly, c: m.KvChunk, ask: bool = False) -> str:
    """Why piece ``c`` (``ask``: its data-less ask) is not one of transfer ``a``'s (rid, count, total or layout
    differ), or ""."""
    if (c.rid, c.count, c.total) != (a.rid, a.count, a.total):
        return (f"piece {c.index} names {c.count} pieces, {c.total} B of {c.rid}; transfer {a.transfer} has {a.count} "
                f"pieces, {a.total} B of {a.rid}")  # fmt: skip
    if ask:
        return ""
    why = _shape(c)
    if why:
        return why
    if c.offset != c.index * a.size or (c.index < c.count - 1 and len(c.data) != a.size):
        return f"piece {c.index} of {len(c.data)} B at offset {c.offset}: not one of pieces of {a.size} B"
    return ""
