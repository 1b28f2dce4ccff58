"""The flashckpt exception family.

Every error the library raises on purpose derives from :class:`FlashCkptError`, so callers can
catch one type. Messages name the step, key, chunk or path involved and the next thing to try.
"""

from __future__ import annotations


class FlashCkptError(Exception):
    """Root of every error flashckpt raises on purpose."""


class ConfigError(FlashCkptError, ValueError):
    """An argument or option is invalid; the message says which and what is accepted."""


class UnsupportedStateError(FlashCkptError, TypeError):
    """The state contains an object flashckpt cannot save (raised before anything is written)."""


class NoCheckpointError(FlashCkptError):
    """No (valid) checkpoint exists where one was required."""


class CorruptCheckpointError(FlashCkptError):
    """A checkpoint failed validation: bad manifest, missing/truncated chunk or hash mismatch."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        key: str | None = None,
        chunk: str | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.key = key
        self.chunk = chunk


class ManifestError(CorruptCheckpointError):
    """A manifest is not valid JSON or violates the schema (possibly hostile)."""


class UnsupportedFormatError(FlashCkptError):
    """A checkpoint in a format this flashckpt does not read: a newer flashckpt wrote it. It is
    not damage: a restore raises instead of skipping it for an older step, and no cleanup
    replaces or deletes it. Upgrade flashckpt to read it, or restore an older step by number."""

    def __init__(self, message: str, *, step: int | None = None, version: int) -> None:
        super().__init__(message)
        self.step = step
        self.version = version


class StateMismatchError(FlashCkptError):
    """The checkpoint does not match the target state (missing keys, unexpected keys, shapes)."""

    def __init__(self, message: str, *, keys: list[str] | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])


class StorageError(FlashCkptError, OSError):
    """Reading or writing a tier failed (disk full, permission, unreachable remote, ...)."""


class LockedError(FlashCkptError):
    """Another process holds the writer lock on this checkpoint root."""


class SaveError(FlashCkptError):
    """A background save failed; ``__cause__`` holds the original error."""


class DistributedError(FlashCkptError):
    """A collective phase failed on one or more ranks (every rank raises the same error)."""

    def __init__(self, message: str, *, phase: str = "", ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.phase = phase
        self.ranks = list(ranks or [])


class OutcomeUnknownError(DistributedError):
    """A distributed save whose outcome this rank cannot know: the rank that publishes the
    manifest stopped answering after every part was durable, so the step may or may not be
    committed. ``restore()`` (and ``has_step``) tell which; a step that is committed restores
    exactly what was saved (every part was durable before it could be published)."""


__all__ = [
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedError",
    "FlashCkptError",
    "LockedError",
    "ManifestError",
    "NoCheckpointError",
    "OutcomeUnknownError",
    "SaveError",
    "StateMismatchError",
    "StorageError",
    "UnsupportedFormatError",
    "UnsupportedStateError",
]
