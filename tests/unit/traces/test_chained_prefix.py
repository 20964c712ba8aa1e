"""``chained_prefix_len`` (issue 23: the simulator's per-request common prefix of a branch's
paths, by bisection over single ids) equals ``shared_prefix_len`` on chained id lists."""

from __future__ import annotations

import random

from evolving_infra.traces.tokens import chained_prefix_len, shared_prefix_len


def _chained_pair(rng: random.Random, ids: dict[tuple[int, int], int]) -> tuple[list[int], list[int]]:
    """Two paths of one chained id space (an id names its whole prefix: a trie's node ids), with
    a common prefix of any length: equal, one a prefix of the other, or forking anywhere."""

    def walk(labels: list[int]) -> list[int]:
        out, parent = [], 0
        for lab in labels:
            parent = ids.setdefault((parent, lab), len(ids) + 1)
            out.append(parent)
        return out

    la = [rng.randrange(3) for _ in range(rng.randint(0, 40))]
    k = rng.randint(0, len(la))
    lb = la[:k] + [rng.randrange(3) for _ in range(rng.randint(0, 40))]
    return walk(la), walk(lb)


def test_chained_prefix_len_equals_shared_prefix_len_on_chains() -> None:
    rng = random.Random(23)
    ids: dict[tuple[int, int], int] = {}
    forks = 0
    for _ in range(3000):
        a, b = _chained_pair(rng, ids)
        want = shared_prefix_len(a, b)
        assert chained_prefix_len(a, b) == want == chained_prefix_len(b, a), (a, b)
        forks += 0 < want < min(len(a), len(b))
    assert forks > 500  # the bisection ran, at every depth
    assert chained_prefix_len([], [1]) == 0 and chained_prefix_len([1, 2], [1, 2]) == 2
