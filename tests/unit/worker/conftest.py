"""Builders for worker core tests: profiles with only the knobs under test, prompts by block id."""

from __future__ import annotations

import msgspec
import pytest

from shared.hashing import block_hashes, tokens_for_blocks
from shared.messages import DecodeWork, PrefillWork
from shared.profile import Profile, load_profile
from services.worker.scheduler import EngineScheduler


class Builders:
    """``b.profile(...)``, ``b.sched(...)``, ``b.prefill(...)``, ``b.decode(...)``."""

    def profile(self, base: str = "tiny", **over: object) -> Profile:
        """A shipped profile with top-level fields or ``section__field`` overrides."""
        p = load_profile(base)
        top: dict[str, object] = {}
        sections: dict[str, dict[str, object]] = {}
        for key, val in over.items():
            if "__" in key:
                sec, f = key.split("__", 1)
                sections.setdefault(sec, {})[f] = val
            else:
                top[key] = val
        for sec, fields in sections.items():
            top[sec] = msgspec.structs.replace(getattr(p, sec), **fields)
        return msgspec.structs.replace(p, **top)

    def sched(self, profile: Profile | None = None, phase: str = "both", node: str = "w0", **kw: object) -> EngineScheduler:
        kw.setdefault("check_invariants", True)
        return EngineScheduler(node, profile or self.profile(), phase, **kw)  # type: ignore[arg-type]

    def path(self, ids: list[int], bs: int = 4) -> list[int]:
        """Block hashes of the pages made from trace block ids ``ids``."""
        return block_hashes(tokens_for_blocks(ids, bs), bs) if ids else []

    def prefill(
        self,
        rid: str,
        ids: list[int],
        *,
        tail: int = 0,
        max_tokens: int = 4,
        bs: int = 4,
        decode_node: str | None = None,
    ) -> PrefillWork:
        """Prompt of ``len(ids)`` full pages (block ids ``ids``) plus ``tail`` tokens."""
        return PrefillWork(
            rid=rid,
            prompt_tokens=len(ids) * bs + tail,
            max_tokens=max_tokens,
            block_size=bs,
            block_hashes=self.path(ids, bs),
            decode_node=decode_node,
        )

    def decode(self, rid: str, ids: list[int], *, tail: int = 0, max_tokens: int = 4, bs: int = 4, ready: float = 0.0) -> DecodeWork:
        return DecodeWork(
            rid=rid,
            prompt_tokens=len(ids) * bs + tail,
            max_tokens=max_tokens,
            block_size=bs,
            generated=1,
            block_hashes=self.path(ids, bs),
            prefill_node="wp",
            kv_ready_at=ready,
        )


@pytest.fixture
def b() -> Builders:
    return Builders()


def run_until_idle(s: EngineScheduler, now: float = 0.0, horizon: float | None = None, limit: int = 100_000):
    """Step ``s`` until idle with no pending deadline, jumping to ``next_deadline()``
    when idle (as the simulator does); returns (outputs, plans, end time)."""
    outs, plans = [], []
    for _ in range(limit):
        plan = s.schedule(now, horizon)
        if plan is None:
            deadline = s.next_deadline()
            if deadline is None:
                return outs, plans, now
            now = max(now, deadline)
            continue
        plans.append(plan)
        now = plan.end
        outs.extend(s.finish_iteration(plan, now))
    raise AssertionError("scheduler did not go idle")


@pytest.fixture
def run():
    return run_until_idle


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The torch engine tests' tiny random llama folder (``torch_tiny.write_tiny_llama``), built
    once a session: the tests only read it (``LocalNode`` loads it; ``test_torch_eos`` copies it
    before it names another EOS token)."""
    from tests.unit.worker.torch_tiny import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
