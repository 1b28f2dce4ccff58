"""Peer replication of the node-local memory tier: one thread per rank, rounds on the side group.

After a save is published in the node-local memory tiers (:mod:`flashckpt.distributed.commit`), the
save thread hands the step to :meth:`Replicator.published` and goes on; training never waits.
The replication thread runs one *round* per step, in lockstep with the other ranks (every rank
queues the same steps, in the same order):

1. **which step**: all-reduce MIN of each rank's newest queued step. Older queued steps are
   skipped (``replication_skipped``): the newest is what a node loss would restore.
2. **disk tier** (:mod:`flashckpt.distributed.replication.nodepromote`): when the local tier's
retention wants the
   step, every rank copies the chunks it wrote from its node tier to the shared disk tier and
   rank 0 commits the manifest there (a node-local tier cannot be promoted by one rank).
3. **peers** (:mod:`flashckpt.distributed.replication.transfer`): every rank sends to
``peer_of(rank)`` the chunks
   of its part that the peer's node lacks; the receiver pins what it reported present (gc cannot
   race), verifies each received chunk's hash and writes it into its node tier under the same
   content address. The global manifest is already in every node's tier and names every chunk,
   so the liveness owner counts replica chunks as referenced for as long as that step is kept.
4. **agree**: all-reduce of failures and bytes. The step is *replicated* when no rank failed:
   each node's leader records it in ``<memory tier>/replication.json`` (what ``flashckpt ls`` and
   ``status`` show) and rank 0 journals ``replicated`` (step, bytes, seconds); else rank 0
   journals ``replication_failed`` and nothing is recorded.

Memory-tier retention (:class:`ReplicatedRetention`) keeps the newest N *replicated* steps, the
newest N steps, and the newer ones still in flight. A gloo error or timeout on the side group
(a peer node died, hung, is unreachable) journals ``replication_failed`` and stops replication
for good (gloo groups do not recover): the memory tier is then suspended for saves. A rank may
give up alone (its peer is slow, not dead), so every rank posts its suspension in the next
save's ``plan`` phase and rank 0's tier choice sees all of them (:mod:`flashckpt.distributed.
attempt`); that save and the later ones go to the disk tier, and that first save promotes the
steps only the node tiers held (:mod:`flashckpt.distributed.replication.stranded`), so
checkpoints keep reaching a tier that survives the node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from flashckpt.distributed.group.priority import background_priority
from flashckpt.distributed.replication.nodepromote import promote_round
from flashckpt.distributed.replication.record import read_record, write_record
from flashckpt.distributed.replication.transfer import Exchange, ReplicationBroken, rank_chunks
from flashckpt.errors import CorruptCheckpointError, FlashCkptError
from flashckpt.journal import Journal
from flashckpt.policy.retention import RetentionPolicy
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import ChunkRef, Manifest
from flashckpt.store.format.names import chunk_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicatedRetention:
    """What ``inner`` keeps of the replicated steps, plus what it keeps of all steps, plus the
    newer steps still in flight (bounded: twice ``inner``'s count plus two; never less than
    ``inner`` alone). Reads the replicator's state, so unlike a plain policy it is not a pure
    function of ``steps``."""

    inner: RetentionPolicy
    replicator: Replicator

    def keep(self, steps: Sequence[int]) -> set[int]:
        done = sorted(s for s in steps if s in self.replicator.replicated)
        kept = set(self.inner.keep(done)) if done else set()
        newest = done[-1] if done else -1
        flying = {s for s in steps if s > newest} & self.replicator.in_flight()
        return kept | set(self.inner.keep(list(steps))) | flying


@dataclass
class RoundResult:
    step: int
    sent_bytes: int = 0
    failures: int = 0
    replicated: bool = False
    transfer_s: float = 0.0  # this rank's chunk exchange (sending and receiving)


@dataclass
class _Queue:
    pending: list[int] = field(default_factory=list)
    current: int | None = None


class Replicator:
    """The replication thread of one rank (module docstring)."""

    def __init__(self, runtime: Any, *, tiers: Any, memory: Any, journal: Journal) -> None:
        nodes, rep = runtime.nodes, runtime.replication
        self.rank, self.world = runtime.rank, runtime.world_size
        self.leader = nodes.is_leader(self.rank)
        self.tiers, self.memory, self.journal = tiers, memory, journal
        self.local = tiers.by_name("local")
        self.side_lock = runtime.side_lock
        self.exchange = Exchange(
            group=runtime.side_group,
            peer=nodes.peer_of(self.rank),
            sources=nodes.sources_of(self.rank),
            timeout_s=rep.timeout_s,
            inflight_bytes=rep.inflight_bytes,
        )
        self.join_timeout_s = 2 * rep.timeout_s + 10
        self.replicated: dict[int, dict[str, Any]] = dict(
            read_record(memory.path).get("replicated", {})
        )
        self.history: list[RoundResult] = []  # this rank's rounds (tests, benchmarks)
        self.broken: str | None = None
        self._q = _Queue()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # rank 0, after a step reached the disk tier: queue it for the remote and trim the disk
        # tier here, so a full promoter queue (on_full="wait") never stalls a round
        self._later = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-replica-after")

    # -- the save thread and the Checkpointer -------------------------------------------------
    def retention(self, inner: RetentionPolicy) -> RetentionPolicy:
        return ReplicatedRetention(inner, self)

    def published(self, part: Manifest) -> None:
        """``part``'s step is published in every node tier: queue it (never blocks)."""
        self._queue(part.step)

    def restored(self, step: int) -> None:
        """``step`` was loaded from the node tiers (on every rank): queue it like a new save,
        so the next round copies it to the disk tier if wanted and re-sends the replicas a
        replacement node lacks. Not when saved by more ranks than this job has (each rank
        copies what the saving rank of its number wrote: the others would leave holes); rank 0
        journals ``promote_failed`` then, if the disk tier wants the step."""
        try:
            saved = self.memory.store.load_manifest(step).world_size
        except FlashCkptError as exc:
            log.warning("step %d restored from peers is not queued for promotion: %s", step, exc)
            return
        if saved > self.world:
            if self.rank == 0 and self._disk_wants(step):
                error = (
                    f"step {step} was saved by {saved} rank(s) and restored from the node tiers "
                    f"on {self.world}: it stays in the memory tiers until a new save; the disk "
                    "tier keeps its older steps"
                )
                self.journal.append(
                    "promote_failed", step=step, src="memory", dst="local", error=error
                )
            return
        self._queue(step)

    def _disk_wants(self, step: int) -> bool:
        try:
            return self.local is not None and bool(self.tiers.wants(self.local, step))
        except FlashCkptError:
            return True  # say why it is not promoted rather than nothing

    def _queue(self, step: int) -> None:
        with self._cv:
            if self.broken is not None or self._stopping:
                return
            self._q.pending.append(step)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="flashckpt-replicate", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def in_flight(self) -> set[int]:
        with self._cv:
            out = {self._q.current} if self._q.current is not None else set()
            return out | ({max(self._q.pending)} if self._q.pending else set())

    def drain(self) -> None:
        """Wait until every queued step is replicated, skipped or given up."""
        with self._cv:
            while self._alive() and (self._q.pending or self._q.current is not None):
                self._cv.wait(1.0)

    def stop(self) -> None:
        """Replicate what is queued (bounded by the side group's timeout), then stop."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(self.join_timeout_s)
            if thread.is_alive():
                log.error("the replication thread did not stop within %ss", self.join_timeout_s)
        self._later.shutdown(wait=True)

    def _after_disk(self, manifest: Manifest) -> None:
        local = self.local
        try:
            self.tiers.committed(manifest.step, local, manifest)  # to the remote, from disk
            self.tiers.retain(local)
        except FlashCkptError as exc:
            log.warning(
                "after promoting step %d to the %s tier: %s", manifest.step, local.name, exc
            )

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.broken is None

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        background_priority()
        while True:
            with self._cv:
                while not self._q.pending and not self._stopping:
                    self._cv.wait()
                if not self._q.pending:
                    return
                newest = max(self._q.pending)
            try:
                with self.side_lock:
                    self._round(newest)
            except Exception as exc:  # the side group (or the protocol) is gone for good
                self.broke(exc)
                return
            finally:
                with self._cv:
                    self._q.current = None
                    self._cv.notify_all()

    def _round(self, newest: int) -> None:
        t0 = time.perf_counter()
        step = self.exchange.all_reduce([newest], "min")[0]
        with self._cv:
            skipped = [s for s in self._q.pending if s < step]
            self._q.pending = [s for s in self._q.pending if s > step]
            self._q.current = step
        if skipped and self.rank == 0:
            self.journal.append("replication_skipped", steps=skipped, newer=step)
        manifest, error = self._manifest(step)
        if self.exchange.all_reduce([0 if manifest else 1])[0] or manifest is None:
            self._failed(step, error or "a rank could not read the step's manifest")
            return
        promote_round(
            self.exchange,
            rank=self.rank,
            manifest=manifest,
            src=self.memory,
            dst=self.local,
            tiers=self.tiers,
            journal=self.journal,
            after=lambda m: self._later.submit(self._after_disk, m),
        )
        res = self._replicate(step, manifest)
        failures, sent = self.exchange.all_reduce([res.failures, res.sent_bytes])
        res.replicated = failures == 0
        self.history.append(res)
        seconds = time.perf_counter() - t0
        if not res.replicated:
            self._failed(step, f"{failures} chunk(s) were not stored by their peers")
            return
        self._record(step, {"bytes": sent, "seconds": round(seconds, 6), "time": time.time()})
        if self.rank == 0:
            self.journal.append("replicated", step=step, bytes=sent, seconds=seconds)

    def _manifest(self, step: int) -> tuple[Manifest | None, str | None]:
        try:
            return self.memory.store.load_manifest(step), None
        except FlashCkptError as exc:
            return None, f"rank {self.rank}: {exc}"

    def _replicate(self, step: int, manifest: Manifest) -> RoundResult:
        """Steps 3 of the module docstring, for this rank as sender and receiver."""
        store = self.memory.store
        mine = rank_chunks(manifest, self.rank)
        theirs = {q: rank_chunks(manifest, q) for q in self.exchange.sources}
        res = RoundResult(step=step)
        hashes = {r.hash for refs in theirs.values() for r in refs}
        pin = store.liveness.pin(hashes, kind="replica", step=step)  # before looking
        try:
            lacks = {
                q: [store.find_chunk(r.hash, size=r.size) is None for r in refs]
                for q, refs in theirs.items()
            }
            wanted = self.exchange.masks(mine, lacks)
            send = [r for r, need in zip(mine, wanted) if need]
            recv = {q: [r for r, n in zip(refs, lacks[q]) if n] for q, refs in theirs.items()}
            written: list[str] = []

            def write(src: int, ref: ChunkRef, raw: memoryview) -> None:
                if not self._store_replica(src, ref, raw, step):
                    res.failures += 1
                else:
                    written.append(ref.hash)

            t0 = time.perf_counter()
            res.sent_bytes = self.exchange.chunks(send, self._reader(step), recv, write)
            res.transfer_s = time.perf_counter() - t0
            store.backend.sync_dirs(store.chunk_dirs(written))
        finally:
            pin.release()
        return res

    def _reader(self, step: int) -> Any:
        store = self.memory.store

        def read(ref: ChunkRef, out: memoryview) -> None:
            if ref.codec != "raw":
                out[:] = store.read_chunk(ref, step=step)  # decoded (and verified)
                return
            n = store.backend.read_into(chunk_path(ref.hash, "raw"), out)  # the peer verifies
            if n != ref.size:
                raise CorruptCheckpointError(
                    f"chunk {ref.hash} is truncated: {n} of {ref.size} bytes (step {step})",
                    step=step,
                    chunk=ref.hash,
                )

        return read

    def _store_replica(self, src: int, ref: ChunkRef, raw: memoryview, step: int) -> bool:
        if codecs.hash_parts([raw]) != ref.hash:
            log.warning("replica chunk %s from rank %d (step %d) is damaged", ref.hash, src, step)
            return False
        try:
            self.memory.store.put_chunk(ref.hash, ref.size, [raw], ref.codec)
        except (OSError, FlashCkptError) as exc:
            log.warning("cannot store replica chunk %s of rank %d: %s", ref.hash, src, exc)
            return False
        return True

    # -- outcomes -----------------------------------------------------------------------------
    def _record(self, step: int, info: dict[str, Any]) -> None:
        self.replicated[step] = info
        if not self.leader:
            return
        try:
            self.tiers.retain(self.memory)  # older steps may go now that a newer one is safe
            present = set(self.memory.store.steps())
            for s in [s for s in self.replicated if s not in present]:
                del self.replicated[s]
            self._write_record(None)
        except FlashCkptError as exc:
            log.warning("after replicating step %d: %s", step, exc)

    def _write_record(self, stopped: str | None) -> None:
        write_record(self.memory.path, self.replicated, stopped)

    def _failed(self, step: int, reason: str) -> None:
        self.history.append(RoundResult(step=step, failures=1))
        if self.rank == 0:
            self.journal.append("replication_failed", step=step, error=reason, stopped=False)
        log.warning("step %d was not replicated: %s", step, reason)

    def broke(self, exc: BaseException) -> None:
        """The side group failed for good (here, or under a restore from peers): stop, suspend
        the memory tier for saves, journal and record why."""
        reason = f"{type(exc).__name__}: {exc}"
        with self._cv:
            step = self._q.current
            self.broken = reason
            self._q.pending.clear()
            self._cv.notify_all()
        self.memory.suspended = f"replication stopped ({reason})"
        self.journal.append("replication_failed", step=step, error=reason, stopped=True)
        log.error(
            "peer replication stopped%s: %s; later saves go to the %s tier",
            "" if isinstance(exc, ReplicationBroken) else " (internal error)",
            reason,
            self.local.name if self.local is not None else "next",
        )
        if self.leader:
            try:
                self._write_record(reason)
            except (OSError, FlashCkptError) as err:
                log.warning("cannot record that replication stopped: %s", err)
