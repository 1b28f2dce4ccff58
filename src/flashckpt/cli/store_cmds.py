"""Store commands: ``ls``, ``inspect``, ``verify``, ``gc``, ``diff``, ``export``.

All of them read a checkpoint root without any lock except ``gc``, which takes the root lock
exclusively (without waiting: while any save or promotion of any process holds it, it deletes
nothing and says so). Readers never report as damaged a step that retention deleted while they
read it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashckpt.cli import argtypes
from flashckpt.cli.progress import Progress
from flashckpt.cli.roots import open_store, pick_step
from flashckpt.errors import ConfigError, FlashCkptError, NoCheckpointError
from flashckpt.journal import JOURNAL_NAME, Journal
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore
from flashckpt.store.verify import verify_step
from flashckpt.units import format_bytes


def register(sub: Any) -> None:
    p = sub.add_parser("ls", help="list checkpoints: step, time, size, new/reused bytes, tiers")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--memory-tier", default=None, help="memory tier path (default: tiers.json)")
    p.add_argument("--remote", default=None, help="remote tier URL (default: ROOT/tiers.json)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show tensors, dtypes, shapes and non-tensor state")
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--step", type=argtypes.step, default=None, help="step to inspect (default: newest)"
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="re-hash every chunk of every tier restore reads; exit 1 on damage",
        description="Re-hash every chunk of every step in each tier a restore of ROOT reads "
        "(the tiers ROOT/tiers.json records: memory, local, remote), per tier and step. Exit 1 "
        "on damage, 2 when a tier could not be read.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--memory-tier", default=None, help="memory tier path (default: tiers.json)")
    p.add_argument("--remote", default=None, help="remote tier URL (default: ROOT/tiers.json)")
    p.add_argument(
        "--step", type=argtypes.step, default=None, help="verify one step (default: all)"
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="delete chunks no checkpoint references")
    p.add_argument("root", metavar="ROOT")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("diff", help="which tensors changed between two steps, and by how much")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("a", type=argtypes.step, metavar="A")
    p.add_argument("b", type=argtypes.step, metavar="B")
    p.set_defaults(func=cmd_diff)

    from flashckpt.cli.export import register_export

    register_export(sub)


def cmd_ls(args: argparse.Namespace) -> int:
    from flashckpt.engine.tiers.config import list_tiers

    held = list_tiers(args.root, memory_tier=args.memory_tier, remote=args.remote)
    rows = [("step", "time", "tensors", "size", "new", "reused", "tiers")]
    replicated = _replicated(held)
    dropped = _dropped(held)
    for step, holders in sorted(held.items()):
        names = ",".join(name + dropped.get((step, name), "") for name, _ in holders)
        names += " (replicated)" if step in replicated else ""  # on a peer node's memory too
        first = next((st for n, st in holders if (step, n) not in dropped), holders[0][1])
        try:
            m = first.load_manifest(step)
        except NoCheckpointError:
            continue  # deleted by retention since it was listed: not damage
        except FlashCkptError as exc:
            if not first.has_step(step):
                continue
            rows.append((str(step), "DAMAGED", "-", "-", "-", str(exc)[:40], names))
            continue
        st = m.stats
        rows.append(
            (
                str(step),
                dt.datetime.fromtimestamp(m.time_s).strftime("%Y-%m-%d %H:%M:%S"),
                str(len(m.tensors)),
                format_bytes(m.total_bytes),
                format_bytes(_num(st.get("new_bytes"))),
                format_bytes(_num(st.get("reused_bytes"))),
                names,
            )
        )
    if len(rows) == 1:
        print(f"{args.root}: no checkpoints")
        return 0
    _table(rows)
    return 0


def _dropped(held: dict[int, list[tuple[str, CheckpointStore]]]) -> dict[tuple[int, str], str]:
    """``{(step, tier): " (abandoned)"}`` for the copies lineage says are not the checkpoint
    (store/lineage.py: a crashed run's branch; restore skips them)."""
    from flashckpt.store.lineage import judge_held

    _, verdict = judge_held(held, lambda h: h[1])
    return {
        (c.step, held[c.step][c.where[1]][0]): f" ({verdict.verdicts[c]})" for c in verdict.dropped
    }


def _replicated(held: dict[int, list[tuple[str, CheckpointStore]]]) -> set[int]:
    """Steps the memory tier (under peer replication) records as held by a peer node too."""
    from flashckpt.distributed.replication.record import replicated_steps

    for holders in held.values():
        for name, store in holders:
            root = getattr(store.backend, "root", None)
            if name == "memory" and root is not None:
                return replicated_steps(Path(root))
    return set()


def cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(args.root)
    step = pick_step(store, args.step)
    m = store.load_manifest(step)
    print(
        f"step {m.step} · world size {m.world_size} · {len(m.tensors)} tensors · "
        f"{format_bytes(m.total_bytes)} · {len(m.chunks)} chunks · flashckpt {m.library}"
    )
    rows = [("key", "dtype", "shape", "size", "shards")]
    for key, e in sorted(m.tensors.items()):
        rows.append(
            (
                key,
                e.dtype,
                "x".join(map(str, e.global_shape)) or "scalar",
                format_bytes(e.nbytes),
                str(len(e.shards)),
            )
        )
    _table(rows)
    print("\nnon-tensor state:")
    for name, tree in m.tree.items():
        print(f"  {name}: {_summarize_tree(tree)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Every tier a restore of ROOT reads (its tiers.json, or --memory-tier / --remote), each
    step of each: restore reads the memory tier's copy first, so its damage is damage."""
    from flashckpt.engine.tiers.config import tier_stores

    tiers, unavailable = tier_stores(args.root, memory_tier=args.memory_tier, remote=args.remote)
    several = len(tiers) > 1
    listed = {name: store.steps() for name, store in tiers}
    if args.step is not None:
        if not any(args.step in steps for steps in listed.values()):
            every = sorted(set().union(*listed.values()))
            raise NoCheckpointError(f"step {args.step} is not in {args.root}; steps: {every}")
        listed = {name: [s for s in steps if s == args.step] for name, steps in listed.items()}
    total = bad = 0
    damaged: list[str] = []
    with Progress(total=sum(map(len, listed.values())), label="verify") as bar:
        for name, store in tiers:
            where = f"{name} tier " if several else ""
            checked: dict[str, str | None] = {}
            for step in listed[name]:
                rep = verify_step(store, step, checked=checked)
                bar.advance(1)
                if rep.vanished:
                    bar.note(
                        f"{where}step {step}: deleted by retention while verifying (not damage)"
                    )
                    continue
                total += 1
                if rep.ok:
                    bar.note(
                        f"{where}step {step}: ok ({rep.chunks} chunks, {format_bytes(rep.bytes)})"
                    )
                    continue
                bad += 1
                damaged.append(f"{name} tier step {step}")
                for prob in rep.problems:
                    bar.note(f"DAMAGED {where}{prob}")
            for stray in store.stray_names():
                print(
                    f"ignored {where}steps/{stray!r}: not a canonical step name, so not a "
                    "checkpoint (planted or foreign; remove it)"
                )
    copies = "checkpoint copies" if several else "checkpoints"
    print(f"{total - bad} of {total} {copies} ok" + (f", {bad} damaged" if bad else ""))
    if damaged:
        print(
            f"damaged: {', '.join(damaged)} (restore skips a damaged copy: it reads another "
            "tier or an older step)"
        )
        return 1
    if unavailable:  # exit 2 with one error line, as every bad input (the steps above are ok)
        raise ConfigError(f"NOT VERIFIED: {'; '.join(unavailable)}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    store = open_store(args.root)
    res = collect_garbage(store, full=True)
    if res.skipped is not None:
        Journal(Path(store.url) / JOURNAL_NAME).append(
            "gc_skipped", tier="local", reason=res.skipped
        )
        if res.damaged:  # a check found damage (a manifest, part or pin it cannot trust)
            print(f"{res.skipped}; run flashckpt verify {args.root} to see the damage")
            return 1
        hint = "try again when no save is running" if res.busy else "fix the error and retry"
        print(f"{res.skipped}; {hint}", file=sys.stderr)
        return 2
    print(
        f"deleted {res.chunks_deleted} unreferenced chunks ({format_bytes(res.bytes_deleted)})"
        + (f" and {res.temp_deleted} stale temporary files" if res.temp_deleted else "")
    )
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    store = open_store(args.root)
    ma, mb = (
        store.load_manifest(pick_step(store, args.a)),
        store.load_manifest(pick_step(store, args.b)),
    )
    rows = [("key", "changed", "max |diff|")]
    both = sorted(set(ma.tensors) & set(mb.tensors))
    for key in sorted(set(ma.tensors) ^ set(mb.tensors)):
        rows.append((key, "added" if key in mb.tensors else "removed", "-"))
    rows += _changed(store, ma, mb, [k for k in both if ma.tensors[k].kind == "torch"])
    if len(rows) == 1:
        print(f"steps {args.a} and {args.b} hold identical tensors")
        return 0
    _table(rows)
    print(f"{len(rows) - 1} of {len(set(ma.tensors) | set(mb.tensors))} tensors differ")
    return 0


def _changed(
    store: CheckpointStore, ma: Manifest, mb: Manifest, keys: list[str]
) -> list[tuple[str, str, str]]:
    """Rows for tensors whose bytes differ. Chunk hashes rule out unchanged tensors without
    reading; the rest are read and compared element-wise."""
    from flashckpt.engine.restore.reader import read_tensors

    def spans(m: Manifest, key: str) -> list[tuple[str, int, int]]:
        e = m.tensors[key]
        return [(m.chunks[x.chunk].hash, x.offset, x.length) for s in e.shards for x in s.extents]

    suspects = [k for k in keys if spans(ma, k) != spans(mb, k)]
    ta, tb = read_tensors(store, ma, suspects), read_tensors(store, mb, suspects)
    rows = []
    for key in suspects:
        a, b = ta[key], tb[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            rows.append((key, f"{list(a.shape)} {a.dtype} -> {list(b.shape)} {b.dtype}", "-"))
            continue
        diff = a != b
        n = int(diff.sum())
        if n == 0:
            continue
        delta = "-"
        if a.is_floating_point():
            delta = f"{float((a.double() - b.double()).abs().max()):.3g}"
        rows.append((key, f"{n / max(a.numel(), 1):.1%} of {a.numel()} elements", delta))
    return rows


def _num(value: Any) -> float:
    """A manifest's stats are informational and unvalidated: show 0 for anything odd."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _summarize_tree(tree: Any, depth: int = 0) -> str:
    if isinstance(tree, dict):
        if len(tree) == 1 and next(iter(tree)) in ("__t__", "__np__"):
            return "<tensor>"
        if depth >= 1:
            return "{" + f"{len(tree)} keys" + "}"
        return (
            "{"
            + ", ".join(f"{k}: {_summarize_tree(v, depth + 1)}" for k, v in list(tree.items())[:8])
            + (", ..." if len(tree) > 8 else "")
            + "}"
        )
    if isinstance(tree, list):
        return f"[{len(tree)} items]"
    text = repr(tree)
    return text if len(text) < 40 else text[:37] + "..."


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()
