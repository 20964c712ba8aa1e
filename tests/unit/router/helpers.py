"""Small builders for router core tests (only the knobs under test)."""

from __future__ import annotations

from shared.messages import KvLookupReply, NodePrefix, NodeState

from services.router.nodes import NodeLoad


def load(node: str, inflight: int = 0, phase: str = "prefill", running: int = 0, waiting: int = 0) -> NodeLoad:
    return NodeLoad(node=node, phase=phase, inflight=inflight, running=running, waiting=waiting)  # type: ignore[arg-type]


def state(node: str, phase: str = "prefill", **kw: object) -> NodeState:
    return NodeState(node=node, phase=phase, **kw)  # type: ignore[arg-type]


def lookup(block_size: int = 64, **local_blocks: int) -> KvLookupReply:
    nodes = [NodePrefix(node=n, local_blocks=b, gpu_blocks=b) for n, b in local_blocks.items()]
    return KvLookupReply(block_size=block_size, nodes=nodes, longest_any=max(local_blocks.values(), default=0))
