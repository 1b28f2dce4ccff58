"""FsspecBackend: a checkpoint tier on any filesystem fsspec knows (``s3://``, ``gs://``,
``az://``, ``memory://``, ...). Synchronous and thread-free, like every backend.

Fits the :class:`~flashckpt.store.files.backend.Backend` contract this way:

* ``put`` writes the object in one go: an object store makes it visible only when the upload
  completes (a multipart upload above ``part_size_bytes``, which s3fs starts by itself), so a
  crash leaves nothing behind or an aborted upload, never a half object under the final name.
* ``sync_dirs`` is a no-op: an object store has no directories to fsync; a completed PUT is
  durable. The manifest is still written last by the store.
* ``list(prefix)`` lists one prefix (``steps``, ``chunks/ab``), never the whole bucket; the store
  lists chunk prefixes once when it opens and then keeps its own index.
* Every call is retried with exponential backoff on transient errors (connection refused or
  reset, timeouts, 5xx, throttling); anything else becomes a :class:`StorageError` naming the URL.

Credentials and endpoints come from ``options`` (passed to fsspec as is, e.g.
``{"endpoint_url": ..., "key": ..., "secret": ...}`` for s3fs) or from the standard environment
variables of the underlying library (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE`` for S3).
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from flashckpt.errors import ConfigError, CorruptCheckpointError, StorageError
from flashckpt.store.files.backend import Buffer, check_relpath, is_temp_name
from flashckpt.store.files.limits import read_limit
from flashckpt.store.files.retry import RetryPolicy, call_with_retry
from flashckpt.units import parse_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PART_SIZE = 16 << 20  # S3 needs parts >= 5 MiB; 32 MiB chunks upload as 2 parts


class FsspecBackend:
    """A tier at ``url`` (e.g. ``s3://bucket/run``); ``options`` go to fsspec unchanged."""

    is_local = False

    def __init__(
        self,
        url: str,
        *,
        options: Mapping[str, Any] | None = None,
        part_size: int | str = DEFAULT_PART_SIZE,
        retry: RetryPolicy | None = None,
    ) -> None:
        try:
            import fsspec
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "a remote tier needs fsspec (and s3fs for s3://): pip install 'flashckpt[remote]'"
            ) from exc
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"remote={url!r}: give a URL such as 's3://bucket/run'")
        self.url = url.rstrip("/")
        self.part_size_bytes = parse_bytes(part_size, name="part_size")
        if self.part_size_bytes < 5 << 20:
            raise ConfigError("part_size must be at least 5MiB (the S3 minimum part size)")
        self.retry = retry or RetryPolicy()
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **dict(options or {}))
        except (ImportError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot open remote tier {self.url}: {exc}") from exc
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"FsspecBackend({self.url!r})"

    def _abs(self, path: str) -> str:
        return f"{self.root}/{check_relpath(path)}"

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        where = f"{self.url}/{path}" if path else self.url
        try:
            return call_with_retry(fn, what=f"{op} {where}", policy=self.retry)
        except FileNotFoundError:
            raise
        except StorageError:
            raise
        except Exception as exc:
            err = StorageError(
                f"could not {op} {where}: {type(exc).__name__}: {exc}; check that the remote is "
                "reachable and the credentials (remote_options= or AWS_* environment variables)"
            )
            raise err from exc

    # -- writing ----------------------------------------------------------------------------
    def put(self, path: str, parts: Sequence[Buffer]) -> int:
        full = self._abs(path)
        return self._call("write", path, lambda: self._put_once(full, parts))

    def _put_once(self, full: str, parts: Sequence[Buffer]) -> int:
        f = self.fs.open(full, "wb", block_size=self.part_size_bytes)
        total = 0
        try:
            for part in parts:
                mv = memoryview(part).cast("B")
                f.write(mv)
                total += len(mv)
        except BaseException:
            discard = getattr(f, "discard", None)
            if discard is not None:
                try:
                    discard()  # aborts a started multipart upload: nothing becomes visible
                except Exception as exc:
                    log.debug("discarding upload of %s failed: %s", full, exc)
            raise
        f.close()
        return total

    def delete(self, path: str) -> None:
        full = self._abs(path)

        def rm() -> None:
            try:
                self.fs.rm_file(full)
            except FileNotFoundError:
                pass

        self._call("delete", path, rm)

    def sync_dirs(self, dirs: Sequence[str]) -> None:
        return None  # object stores: a completed PUT is durable; no directories to sync

    # -- reading ----------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        """All bytes of the object ``path``; one larger than any valid file of its kind is
        refused before it is downloaded (its size asked first), and again if it grew."""
        full = self._abs(path)
        limit = read_limit(path)
        # chunks are read by their manifest's size (and re-hashed): one HEAD per chunk would
        # only slow restores; every other object is asked its size before it is downloaded
        size = None
        if not path.startswith("chunks/"):
            size = self._call("stat", path, lambda: self.fs.size(full))
        if size is not None and int(size) > limit:
            raise CorruptCheckpointError(
                f"{self.url}/{path} is {int(size)} bytes, more than the {limit} any valid "
                "file of this kind holds; refusing to read it"
            )
        data = self._call("read", path, lambda: self.fs.cat_file(full))
        if len(data) > limit:
            raise CorruptCheckpointError(
                f"{self.url}/{path} is {len(data)} bytes, more than the {limit} any valid "
                "file of this kind holds; refusing it"
            )
        return bytes(data)

    def read_into(
        self, path: str, out: memoryview, *, each: Callable[[memoryview], object] | None = None
    ) -> int:
        data = self.read(path)
        n = min(len(data), len(out))
        out[:n] = data[:n]
        if each is not None and n:
            each(out[:n])
        return len(data) if len(data) > len(out) else n

    def exists(self, path: str) -> bool:
        full = self._abs(path)
        return bool(self._call("stat", path, lambda: self.fs.exists(full)))

    def size(self, path: str) -> int:
        full = self._abs(path)
        return int(self._call("stat", path, lambda: self.fs.size(full)))

    def list(self, prefix: str) -> builtins.list[str]:
        full = self._abs(prefix)

        def ls() -> builtins.list[str]:
            self.fs.invalidate_cache(full)
            try:
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError:
                return []
            return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

        names = self._call("list", prefix, ls)
        return sorted(n for n in names if n and not is_temp_name(n))
