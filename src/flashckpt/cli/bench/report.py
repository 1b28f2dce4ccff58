"""Targets and the markdown table for ``flashckpt bench`` (pure functions of the result JSON)."""

from __future__ import annotations

from typing import Any

MiB = 1 << 20


def _target(
    name: str, value: float | None, limit: float, how: str, best: float | None = None
) -> dict[str, Any]:
    """``value``: the ratio of medians (decides PASS/FAIL); ``best``: the ratio of minimums,
    shown because a shared host adds seconds of noise to single samples."""
    ok = None if value is None else value <= limit
    return {"target": name, "value": value, "best": best, "limit": limit, "how": how, "pass": ok}


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ratio(a: Any, b: Any) -> float | None:
    return None if a is None or not b else float(a) / float(b)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue-3 target as a ratio measured in this run (None: the part did not run)."""
    m = _get(result, "save", "methods") or {}
    fa = m.get("flashckpt_async", {})

    def best(a: str, b: str, key: str = "min_durable_s") -> float | None:
        return _ratio(_get(m, a, key), _get(m, b, key))

    rows = [
        _target(
            "blocking <= 0.2x dcp.async_save blocking",
            _ratio(fa.get("returned_s"), _get(m, "dcp_async_save", "blocking_s")),
            0.2,
            "flashckpt async save() return (optimizer hook armed) / dcp.async_save blocking",
        ),
        _target(
            "staging alone <= 0.2x dcp.async_save blocking (informational: no overlap)",
            _ratio(fa.get("blocking_s"), _get(m, "dcp_async_save", "blocking_s")),
            0.2,
            "flashckpt async time to staged / dcp.async_save blocking",
            best("flashckpt_async", "dcp_async_save", "min_blocking_s"),
        ),
        _target(
            "time to durable <= 1.25x raw write",
            _ratio(fa.get("durable_s"), _get(m, "raw_write", "durable_s")),
            1.25,
            "flashckpt async durable / raw sequential write + fsync",
            best("flashckpt_async", "raw_write"),
        ),
        _target(
            "sync save <= dcp.save",
            _ratio(_get(m, "flashckpt_sync", "durable_s"), _get(m, "dcp_save", "durable_s")),
            1.0,
            "flashckpt sync / dcp.save",
            best("flashckpt_sync", "dcp_save"),
        ),
        _target(
            "unchanged re-save <= 0.1x full save",
            _ratio(_get(m, "flashckpt_incremental", "durable_s"), fa.get("durable_s")),
            0.1,
            "flashckpt incremental re-save durable / flashckpt async full save durable",
            best("flashckpt_incremental", "flashckpt_async"),
        ),
    ]
    loop = _get(result, "loop", "methods") or {}
    rows.append(
        _target(
            "loop: extra time per async save <= 0.25x torch.save",
            _ratio(
                _get(loop, "flashckpt_async", "extra_per_save_s"),
                _get(loop, "torch_save", "mean_call_s"),
            ),
            0.25,
            "flashckpt async extra loop time per save / torch.save call time (same state)",
        )
    )
    rss = result.get("rss")
    if rss:
        rows.append(
            _target(
                "host RSS flat over saves",
                rss["growth_after_warmup_bytes"] / max(rss["state_bytes"], 1),
                0.25,
                f"max RSS growth after warm-up over {rss['saves']} saves / state bytes",
            )
        )
    if "d2h_copy" in m:
        rows.append(
            _target(
                "GPU: staging near the device-to-host copy",
                _ratio(fa.get("blocking_s"), _get(m, "d2h_copy", "blocking_s")),
                1.5,
                "flashckpt async time to staged / one pinned D2H copy of the state",
            )
        )
    if result.get("loop", {}).get("device", "cpu").startswith("cuda"):
        rows.append(
            _target(
                "GPU: overlapped training within 5% of no checkpoints",
                _get(loop, "flashckpt_async", "slowdown"),
                0.05,
                "flashckpt async loop time / loop time without checkpoints - 1",
            )
        )
    return rows


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _save_table(save: dict[str, Any]) -> list[str]:
    m = save["methods"]
    raw = _get(m, "raw_write", "durable_s")
    lines = [
        f"State: {save['state_bytes'] / 1e9:.2f} GB on {save['device']}, median of "
        f"{save['repeats']}; page cache dropped: {save['caches_dropped']}",
        "",
        "| method | blocking s | call returns s | durable s | best durable s | durable / raw "
        "write | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in m.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} | | | | | |")
            continue
        gbps = save["state_bytes"] / r["durable_s"] / 1e9 if r["durable_s"] else None
        lines.append(
            f"| {name} | {_f(r['blocking_s'])} | {_f(r.get('returned_s'))} | "
            f"{_f(r['durable_s'])} | {_f(r.get('min_durable_s'))} | "
            f"{_f(_ratio(r['durable_s'], raw), 2)} | {_f(gbps, 2)} |"
        )
    return lines


def _loop_table(loop: dict[str, Any]) -> list[str]:
    lines = [
        f"Training loop on {loop['device']}: {loop['steps']} steps, a save every "
        f"{loop['every']}, state {loop['state_bytes'] / 1e6:.0f} MB, "
        f"{loop.get('rounds', 1)} round(s) (medians); baseline runs "
        f"{', '.join(_f(x, 2) for x in loop['baseline_runs_s'])} s",
        "",
        "| method | loop s | mean step s | call s | extra per save s | per round s "
        "| extra CPU per save s | slowdown |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in loop["methods"].items():
        slow = r.get("slowdown")
        rounds = " / ".join(_f(x) for x in r.get("extra_per_save_runs_s", [])) or "-"
        lines.append(
            f"| {name} | {_f(r['loop_s'], 2)} | {_f(r['mean_step_s'])} | "
            f"{_f(r.get('mean_call_s'))} | {_f(r.get('extra_per_save_s'))} | {rounds} | "
            f"{_f(r.get('extra_cpu_per_save_s'))} | {'-' if slow is None else f'{slow:+.1%}'} |"
        )
    return lines


def _gil_lines(g: dict[str, Any]) -> list[str]:
    lines = [
        f"GIL probe: Python-heavy loop while {g['bytes'] / MiB:.0f} MiB are hashed, written "
        f"and fsynced by {g['workers']} workers (alone: {g['alone_it_per_s']:.0f} it/s)",
        "",
        "| persist in | loop slowdown | persist s | loop time lost s |",
        "|---|---:|---:|---:|",
    ]
    for k in ("threads", "process", "flashckpt"):
        dur = g[f"{k}_persist_s"] if k != "flashckpt" else g["flashckpt_save_s"]
        lines.append(f"| {k} | {g[f'{k}_slowdown']:.1%} | {dur:.2f} | {g[f'{k}_lost_s']:.2f} |")
    return lines


def render(result: dict[str, Any]) -> str:
    mc = result["machine"]
    lines = [
        f"Machine: {mc['nproc']} CPUs ({mc['cpu']}), {mc['mem_total_gb']} GB RAM, "
        f"torch {mc['torch']}, disk `{mc['disk']}` ({mc['fs_type']})"
        + (f", GPU {mc['gpu']}" if "gpu" in mc else ""),
        "",
    ]
    if "save" in result:
        lines += [*_save_table(result["save"]), ""]
    if "rss" in result:
        r = result["rss"]
        lines += [
            f"RSS over {r['saves']} async saves of {r['state_bytes'] / 1e6:.0f} MB: "
            f"warm {r['warm_rss_bytes'] / MiB:.0f} MiB, max growth after warm-up "
            f"{r['growth_after_warmup_bytes'] / MiB:.1f} MiB",
            "",
        ]
    if "gil" in result:
        lines += [*_gil_lines(result["gil"]), ""]
    if "loop" in result:
        lines += [*_loop_table(result["loop"]), ""]
    lines += [
        "| target | ratio (medians) | ratio (best runs) | limit | result |",
        "|---|---:|---:|---:|---|",
    ]
    for t in result["targets"]:
        res = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        lines.append(
            f"| {t['target']} | {_f(t['value'])} | {_f(t.get('best'))} | {t['limit']} | {res} |"
        )
    return "\n".join(lines)
