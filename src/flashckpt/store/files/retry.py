"""Retries with exponential backoff for transient storage errors. Synchronous: it sleeps in the
calling thread and never starts one.

Transient means "the same request may well succeed in a moment": connection refused/reset,
timeouts, HTTP 5xx, throttling (``SlowDown``, ``Throttling``, 429). A missing file, a denied
permission or a bad request is never retried.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EAGAIN,
}
_TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ResponseStreamingError",
}
_TRANSIENT_WORDS = (
    "SlowDown",
    "Throttl",
    "TooManyRequests",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
    "429",
)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``attempts`` tries in all; the k-th wait is ``min(max_delay_s, base_delay_s * 2**k)``
    with +-25% jitter."""

    attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(f"RetryPolicy(attempts=) must be an int >= 1, got {self.attempts!r}")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ConfigError("RetryPolicy needs 0 <= base_delay_s <= max_delay_s")

    def delay_s(self, attempt: int) -> float:
        d = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return d * random.uniform(0.75, 1.25)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying (see the module docstring)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, ConfigError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    for cls in type(exc).__mro__:
        if cls.__name__ in _TRANSIENT_NAMES:
            return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc)
    if isinstance(exc, OSError) and any(w in text for w in _TRANSIENT_WORDS):
        return True
    cause = exc.__cause__
    return cause is not None and cause is not exc and is_transient(cause)


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``fn``; on a transient error wait and try again, up to ``policy.attempts`` times.
    The last error (or any non-transient one) propagates unchanged."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as exc:
            if attempt + 1 >= policy.attempts or not is_transient(exc):
                raise
            delay = policy.delay_s(attempt)
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs",
                what,
                type(exc).__name__,
                exc,
                attempt + 1,
                policy.attempts - 1,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
