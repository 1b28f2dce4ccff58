"""Retention policies: which committed steps a tier keeps.

A retention policy is a small, pure object: given the sorted list of committed steps it returns
the set to keep. Policies compose with ``|`` (keep what either keeps). The newest step is always
kept by the store, whatever the policy says, so a policy can never delete the only checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from flashckpt.errors import ConfigError


@runtime_checkable
class RetentionPolicy(Protocol):
    """Contract: ``keep(steps)`` receives committed steps in ascending order and returns the
    subset to keep. It must be deterministic and must not depend on anything but ``steps``."""

    def keep(self, steps: Sequence[int]) -> set[int]: ...


class _Composable:
    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf(policies=(self, other))  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class AnyOf(_Composable):
    """Keep a step if any of ``policies`` keeps it."""

    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept


@dataclass(frozen=True)
class KeepLast(_Composable):
    """Keep the newest ``n`` steps."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"KeepLast(n) needs an integer n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery(_Composable):
    """Keep every step that is a multiple of ``n`` (e.g. a permanent one every 1000 steps)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"KeepEvery(n) needs an integer n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


@dataclass(frozen=True)
class KeepAll(_Composable):
    """Keep everything (the default)."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


def as_retention(value: RetentionPolicy | int | None) -> RetentionPolicy:
    """``None`` -> keep all, an int ``n`` -> ``KeepLast(n)``, a policy -> itself."""
    if value is None:
        return KeepAll()
    if isinstance(value, bool):
        raise ConfigError("keep= takes a retention policy or an int, not a bool")
    if isinstance(value, int):
        return KeepLast(value)
    if isinstance(value, RetentionPolicy):
        return value
    raise ConfigError(
        f"keep={value!r} is not a retention policy; use an int, flashckpt.policy.KeepLast(n), "
        "KeepEvery(n), or combine them with |"
    )
