import pytest

from evolving_infra.replay.core import Arrival, EndBranch, ReplayCore, ReplayError, SendRequest
from evolving_infra.traces.schema import TraceRequest


def R(id, agent, branch="b", after=(), pause=0.0, ends=False, kind=None, parent=None, arrival=None):
    return TraceRequest(
        id=id, agent=agent, branch=branch, input_tokens=10, output_tokens=2, after=list(after), pause_s=pause,
        ends_branch=ends, kind=kind, parent_branch=parent, arrival_s=arrival,
    )


def sends(actions):
    return [(a.req.id, a.due_at) for a in actions if isinstance(a, SendRequest)]


def test_chain_with_pauses_and_branch_end():
    reqs = [R("a1", "A", "A/m", kind="main"), R("a2", "A", "A/m", after=["a1"], pause=5.0, ends=True)]
    core = ReplayCore(reqs, Arrival("closed", concurrency=1), start=100.0)
    assert core.next_time() == 100.0
    assert sends(core.poll(100.0)) == [("a1", 100.0)]
    assert core.poll(1000.0) == []  # a2 waits for a1's completion, not for time
    assert core.on_complete("A", "a1", 110.0) == []
    assert core.next_time() == 115.0
    assert core.poll(114.9) == []
    assert sends(core.poll(115.0)) == [("a2", 115.0)]
    follow = core.on_complete("A", "a2", 120.0)
    assert follow == [EndBranch("A/m", 120.0)]
    assert core.done


def test_subagent_fan_out_and_join():
    reqs = [
        R("m1", "A", "main", kind="main"),
        R("s1", "A", "sub1", after=["m1"], pause=1.0, kind="subagent", parent="main", ends=True),
        R("s2", "A", "sub2", after=["m1"], pause=2.0, kind="subagent", parent="main", ends=True),
        R("m2", "A", "main", after=["m1", "s1", "s2"], pause=3.0, ends=True),
    ]
    core = ReplayCore(reqs, Arrival("closed", concurrency=1))
    core.poll(0.0)
    core.on_complete("A", "m1", 10.0)
    assert sends(core.poll(20.0)) == [("s1", 11.0), ("s2", 12.0)]
    core.on_complete("A", "s2", 30.0)
    assert core.poll(100.0) == []  # join waits for s1 too
    core.on_complete("A", "s1", 40.0)
    assert sends(core.poll(43.0)) == [("m2", 43.0)]


def test_closed_loop_replaces_finished_agents():
    reqs = [R(f"{a}1", a, f"{a}/m", ends=True) for a in "ABC"]
    core = ReplayCore(reqs, Arrival("closed", concurrency=2))
    assert [x[0] for x in sends(core.poll(0.0))] == ["A1", "B1"]
    core.on_complete("B", "B1", 7.0)
    assert sends(core.poll(7.0)) == [("C1", 7.0)]
    core.on_complete("A", "A1", 8.0)
    core.on_complete("C", "C1", 9.0)
    assert core.done and core.next_time() is None


def test_open_loop_cap_reports_admission_wait():
    reqs = [R(f"{a}1", a, f"{a}/m") for a in "ABCD"]
    core = ReplayCore(reqs, Arrival("open", rate_per_min=600.0, cap=1, seed=3))
    t = core.next_time()
    first = sends(core.poll(t))
    assert len(first) == 1
    # Everyone else arrives within a few seconds but waits for the cap.
    assert sends(core.poll(1e6)) == []
    core.on_complete(first[0][0][0], first[0][0], 1e6)
    acts = core.poll(1e6)
    assert len(acts) == 1 and acts[0].admission_wait_s > 0


def test_trace_arrivals_and_errors():
    reqs = [R("x", "X", arrival=50.0), R("y", "Y", arrival=20.0)]
    core = ReplayCore(reqs, Arrival("trace"), start=1.0)
    assert core.next_time() == 1.0
    assert sends(core.poll(1.0)) == [("y", 1.0)]
    assert sends(core.poll(31.0)) == [("x", 31.0)]
    with pytest.raises(ReplayError):
        ReplayCore([R("x", "X", after=["nope"])], Arrival())
    with pytest.raises(ReplayError):
        ReplayCore([R("x", "X")], Arrival("trace"))
    with pytest.raises(ReplayError):
        Arrival("closed", concurrency=0)


def test_failed_request_still_releases_dependents():
    reqs = [R("a1", "A"), R("a2", "A", after=["a1"])]
    core = ReplayCore(reqs, Arrival())
    core.poll(0.0)
    core.on_complete("A", "a1", 1.0, ok=False)
    assert sends(core.poll(1.0)) == [("a2", 1.0)]
    assert core.failed == 1


def _first_wave(order, seed, kind="closed"):
    reqs = [R(f"{a}1", a, f"{a}/m", ends=True) for a in "ABCDEFGHIJ"]
    core = ReplayCore(reqs, Arrival(kind, concurrency=4, rate_per_min=60.0, seed=seed, order=order))
    return [x[0][0] for x in sends(core.poll(1e9))][:4]


def test_shuffled_agent_order_is_seeded_and_a_permutation():
    assert _first_wave("trace", 1) == _first_wave("trace", 2) == list("ABCD")
    a, b = _first_wave("shuffled", 1), _first_wave("shuffled", 2)
    assert a == _first_wave("shuffled", 1)  # deterministic per seed
    assert a != b and len(set(a)) == 4  # another sample of agents, each once
    reqs = [R(f"{x}1", x, f"{x}/m", ends=True) for x in "ABCDEFGHIJ"]
    core = ReplayCore(reqs, Arrival("open", rate_per_min=60.0, seed=3, order="shuffled"))
    assert sorted(x[0][0] for x in sends(core.poll(1e9))) == list("ABCDEFGHIJ")  # open loop: everyone, once
    with pytest.raises(ReplayError, match="order"):
        Arrival("closed", order="random")  # type: ignore[arg-type]


def _next_from_heaps(core):
    """What ``ClusterSim.run_to_end`` reads inline from ``due_heaps`` instead of calling ``next_time``."""
    arrivals, due = core.due_heaps()
    if arrivals:
        t = arrivals[0][0]
        return due[0][0] if due and due[0][0] < t else t
    return due[0][0] if due else None


def test_due_heaps_are_the_live_inputs_of_next_time():
    reqs = [
        R("a1", "A", "A/m", kind="main", arrival=0.0), R("a2", "A", "A/m", after=["a1"], pause=5.0, ends=True),
        R("b1", "B", "B/m", kind="main", arrival=3.0), R("b2", "B", "B/m", after=["b1"], pause=1.0, ends=True),
    ]
    core = ReplayCore(reqs, Arrival("trace"), start=100.0)
    heaps = core.due_heaps()
    seen = []
    now = 100.0
    for _ in range(20):
        t = core.next_time()
        assert _next_from_heaps(core) == t
        assert core.due_heaps()[0] is heaps[0] and core.due_heaps()[1] is heaps[1]  # the same lists, changed in place
        if t is None:
            break
        now = max(now, t)
        for a in core.poll(now):
            if isinstance(a, SendRequest):
                seen.append(a.req.id)
                core.on_complete(a.req.agent, a.req.id, now + 2.0)
    assert sorted(seen) == ["a1", "a2", "b1", "b2"]
    assert core.done and core.next_time() is None and _next_from_heaps(core) is None
