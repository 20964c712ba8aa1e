"""When the live replayer sends a request again (sans-IO): the retry rule of agent harnesses.

Agent harnesses retry a request the server refused before answering it: the OpenAI Python SDK
(``openai._base_client``, ``max_retries=2`` by default) retries connection errors, 408, 409, 429 and
5xx, waiting the ``Retry-After`` the server gave when it is 0-60 s, else ``min(0.5 x 2^n, 8) s`` less up
to 25 % jitter after the n-th retry. The replayer retries only what cannot have produced output for
the client: a ``429`` / ``503`` answer (a draining router's ``503 router draining; retry on another
router`` with ``Retry-After: 1``, an admission refusal) and a connection refused or closed before the
response's first byte (a router being restarted). A request whose stream started is never sent
again: that would duplicate the tokens the agent already saw; it fails as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

RETRY_STATUSES = frozenset({429, 503})
"""HTTP statuses answered before any work was done for the request: sent again."""


def parse_retry_after(value: str | None, now_wall_s: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (RFC 9110 §10.2.3): delay-seconds (``1``, ``0.5``
    as the OpenAI SDK also takes) or an HTTP-date, relative to ``now_wall_s`` (Unix s). None: no
    header, or one that is neither (a negative or non-finite number, garbage)."""
    if value is None:
        return None
    value = value.strip()
    try:
        s = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - now_wall_s)
    return s if math.isfinite(s) and s >= 0 else None


@dataclass(frozen=True)
class RetryPolicy:
    """How often and after how long a refused request is sent again.

    Args:
        max_retries: sends after the first (0 = never retry); the OpenAI SDK's default is 2.
        initial_backoff_s: wall s before the first retry without a usable ``Retry-After``; doubles per retry.
        max_backoff_s: the backoff's ceiling (wall s).
        max_retry_after_s: a server's ``Retry-After`` is waited at most this long (wall s).

    Raises:
        ValueError: a negative count or time, or ``max_backoff_s < initial_backoff_s``.
    """

    max_retries: int = 2
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not (0 <= self.initial_backoff_s <= self.max_backoff_s) or self.max_retry_after_s < 0:
            raise ValueError("retry backoff times must be >= 0 with initial_backoff_s <= max_backoff_s, got "
                             f"{self.initial_backoff_s}, {self.max_backoff_s}, {self.max_retry_after_s}")

    def delay_s(self, retries_done: int, retry_after_s: float | None, jitter: float) -> float | None:
        """Wall seconds to wait before sending a refused request again; None: give up (it fails).

        Args:
            retries_done: retries already made for this request (0 before the first).
            retry_after_s: the answer's ``Retry-After`` (:func:`parse_retry_after`); None: none
                (a connection error, or a refusal without it).
            jitter: a draw in [0, 1): the backoff is shortened by up to 25 % of it, so clients
                refused together do not come back together (not applied to ``Retry-After``).
        """
        if retries_done >= self.max_retries:
            return None
        if retry_after_s is not None:
            return min(retry_after_s, self.max_retry_after_s)
        backoff = min(self.initial_backoff_s * 2.0 ** retries_done, self.max_backoff_s)
        return backoff * (1.0 - 0.25 * jitter)
