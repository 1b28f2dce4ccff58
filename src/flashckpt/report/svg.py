"""Hand-written inline SVG charts: no JavaScript, no fonts, no external resources.

Two chart shapes cover the report: :func:`bar_chart` (one band per save, bars grouped or stacked,
optional line overlays) and :func:`time_chart` (lines, steps and points against seconds since the
start of the run, with vertical event markers). Every label goes through :func:`esc`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

W, H = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 70, 16, 34, 44
TICK_CHAR_PX = 6.6  # the widest average glyph advance of the 11px tick font (system-ui)
TITLE_PX = 24  # room for the rotated y-axis title left of the tick labels
PALETTE = ("#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#0891b2", "#db2777", "#65a30d")

Fmt = Callable[[float], str]


def esc(value: object) -> str:
    """HTML/SVG-escape any value (journal strings are untrusted)."""
    return escape(str(value), quote=True)


def sig3(v: float) -> str:
    """About 3 significant digits, never in exponent notation (``1000``, ``12.5``, ``0.25``)."""
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1e-3 or v == 0:
        return f"{v:.3g}"
    return f"{v:.1e}"  # not reached by the charts' units; still readable


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e9:
        return f"{sig3(v / 1e9)}G"
    if a >= 1e6:
        return f"{sig3(v / 1e6)}M"
    if a >= 1e4:
        return f"{sig3(v / 1e3)}k"
    return sig3(v)


_BINARY = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


def fmt_bytes(v: float) -> str:
    """Binary units, 3 significant digits, no exponent (``1000 MiB``, not ``1e+03 MiB``)."""
    for unit, scale in _BINARY:
        if abs(v) >= scale:
            return f"{sig3(v / scale)} {unit}"
    return f"{int(v)} B"


def fmt_rate(v: float) -> str:
    return fmt_bytes(v) + "/s"


def fmt_s(v: float) -> str:
    a = abs(v)
    if a >= 86_400:
        return f"{sig3(v / 86_400)} d"
    if a >= 3600:
        return f"{sig3(v / 3600)} h"
    if a >= 60:
        return f"{sig3(v / 60)} min"
    if a >= 1 or a == 0:
        return f"{sig3(v)} s"
    return f"{sig3(v * 1000)} ms"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def unit_ticks(hi: float, fmt: Fmt, n: int = 5) -> list[float]:
    """Ticks from 0 to ``hi`` that are round in the unit ``fmt`` prints: powers of 1024 for
    bytes, minutes/hours/days for durations, plain decimals otherwise."""
    unit = 1.0
    if fmt in (fmt_bytes, fmt_rate):
        unit = next((u for u in (2.0**40, 2.0**30, 2.0**20, 2.0**10) if hi >= u), 1.0)
    elif fmt is fmt_s:
        unit = next((u for u in (86_400.0, 3600.0, 60.0) if hi >= u), 1.0)
    return [t * unit for t in nice_ticks(0.0, hi / unit, n)]


@dataclass(frozen=True, kw_only=True)
class Series:
    """One data series. ``kind``: ``bar``, ``line``, ``step`` or ``points``; ``ys`` may hold
    ``None`` for gaps; ``notes`` are per-point tooltips."""

    label: str
    ys: Sequence[float | None]
    xs: Sequence[float] | None = None
    kind: str = "bar"
    color: str = PALETTE[0]
    dash: bool = False
    notes: Sequence[str] | None = None


@dataclass(frozen=True, kw_only=True)
class Marker:
    """A vertical line at ``x`` (e.g. a crash), labelled on hover and with a short tag."""

    x: float
    label: str
    color: str = "#ef4444"
    tag: str = ""


@dataclass(kw_only=True)
class _Frame:
    x0: float
    x1: float
    y0: float
    y1: float
    y_fmt: Fmt = fmt_num
    parts: list[str] = field(default_factory=list)

    left: float = field(init=False)

    def __post_init__(self) -> None:
        # the plot's left edge: wide enough for the longest y tick label and the axis title,
        # so neither is clipped nor overlaps the other
        longest = max((len(self.y_fmt(y)) for y in self.y_ticks()), default=1)
        self.left = max(float(LEFT), TITLE_PX + 6 + TICK_CHAR_PX * longest)

    def y_ticks(self) -> list[float]:
        return [y for y in unit_ticks(self.y1, self.y_fmt) if y <= self.y1 + 1e-12]

    def sx(self, x: float) -> float:
        left = self.left
        return left + (x - self.x0) / ((self.x1 - self.x0) or 1.0) * (W - left - RIGHT)

    def sy(self, y: float) -> float:
        return H - BOTTOM - (y - self.y0) / ((self.y1 - self.y0) or 1.0) * (H - TOP - BOTTOM)


def _svg(title: str, body: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{esc(title)}</title>{body}</svg>'
    )


def empty_chart(title: str, message: str = "no data yet") -> str:
    return _svg(
        title,
        f'<rect x="0" y="0" width="{W}" height="{H}" class="bg"/>'
        f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="empty">{esc(message)}</text>',
    )


def _axes(f: _Frame, *, y_label: str, x_label: str) -> None:
    left = f.left
    for y in f.y_ticks():
        py = f.sy(y)
        f.parts.append(
            f'<line x1="{left:.1f}" x2="{W - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" class="grid"/>'
        )
        f.parts.append(
            f'<text x="{left - 6:.1f}" y="{py + 4:.1f}" text-anchor="end" class="tick">'
            f"{esc(f.y_fmt(y))}</text>"
        )
    f.parts.append(
        f'<text x="14" y="{(H - BOTTOM + TOP) / 2}" class="axis" text-anchor="middle" '
        f'transform="rotate(-90 14 {(H - BOTTOM + TOP) / 2})">{esc(y_label)}</text>'
    )
    f.parts.append(
        f'<text x="{(left + W - RIGHT) / 2:.1f}" y="{H - 6}" class="axis" '
        f'text-anchor="middle">{esc(x_label)}</text>'
    )
    f.parts.append(
        f'<line x1="{left:.1f}" x2="{W - RIGHT}" y1="{H - BOTTOM}" y2="{H - BOTTOM}" class="base"/>'
    )


def _legend(f: _Frame, series: Sequence[Series | Marker]) -> None:
    x = f.left
    for s in series:
        label, color = s.label, s.color
        if isinstance(s, Marker):
            label = s.tag or s.label
        f.parts.append(f'<rect x="{x}" y="10" width="10" height="10" rx="2" fill="{esc(color)}"/>')
        f.parts.append(f'<text x="{x + 14}" y="19" class="legend">{esc(label)}</text>')
        x += 26 + 6.5 * len(label)


def _max_y(series: Sequence[Series], stacked: bool) -> float:
    bars = [s for s in series if s.kind == "bar"]
    top = 0.0
    if stacked and bars:
        n = max(len(s.ys) for s in bars)
        top = max(sum(s.ys[i] or 0.0 for s in bars if i < len(s.ys)) for i in range(n))
    for s in series:
        if s.kind != "bar" or not stacked:
            top = max([top, *(y for y in s.ys if y is not None)])
    return top if top > 0 else 1.0


def bar_chart(
    *,
    title: str,
    categories: Sequence[str],
    series: Sequence[Series],
    y_label: str,
    x_label: str = "save (step)",
    y_fmt: Fmt = fmt_num,
    stacked: bool = False,
) -> str:
    """One band per category (e.g. per save); ``bar`` series grouped or stacked, ``line`` and
    ``points`` series drawn across the band centres."""
    n = len(categories)
    if n == 0 or not series:
        return empty_chart(title)
    y1 = unit_ticks(_max_y(series, stacked), y_fmt)[-1]
    f = _Frame(x0=0.0, x1=float(n), y0=0.0, y1=y1, y_fmt=y_fmt)
    _axes(f, y_label=y_label, x_label=x_label)
    bars = [s for s in series if s.kind == "bar"]
    band = (W - f.left - RIGHT) / n
    width = band * 0.8 / (1 if stacked or not bars else len(bars))
    base = [0.0] * n
    for j, s in enumerate(bars):
        for i, y in enumerate(s.ys[:n]):
            if y is None:
                continue
            y0 = base[i] if stacked else 0.0
            px = f.sx(i) + band * 0.1 + (0 if stacked else j * width)
            top, bottom = f.sy(y0 + y), f.sy(y0)
            note = s.notes[i] if s.notes else f"{categories[i]}: {y_fmt(y)}"
            f.parts.append(
                f'<rect x="{px:.1f}" y="{top:.1f}" width="{max(width, 0.6):.1f}" '
                f'height="{max(bottom - top, 0.0):.1f}" fill="{esc(s.color)}">'
                f"<title>{esc(s.label)} · {esc(note)}</title></rect>"
            )
            if stacked:
                base[i] += y
    for s in series:
        if s.kind != "bar":
            xs = [i + 0.5 for i in range(n)]
            _draw_xy(f, s, xs, y_fmt=y_fmt, x_names=list(categories))
    every = max(1, math.ceil(n / 10))
    for i in range(0, n, every):
        f.parts.append(
            f'<text x="{f.sx(i + 0.5):.1f}" y="{H - BOTTOM + 15}" text-anchor="middle" '
            f'class="tick">{esc(categories[i])}</text>'
        )
    _legend(f, series)
    return _svg(title, "".join(f.parts))


def _draw_xy(
    f: _Frame, s: Series, xs: Sequence[float], *, y_fmt: Fmt, x_names: Sequence[str]
) -> None:
    pts = [(x, y) for x, y in zip(xs, s.ys) if y is not None]
    dash = ' stroke-dasharray="5 4"' if s.dash else ""
    if s.kind in ("line", "step") and len(pts) > 1:
        coords: list[str] = []
        for k, (x, y) in enumerate(pts):
            if s.kind == "step" and k:
                coords.append(f"{f.sx(x):.1f},{f.sy(pts[k - 1][1]):.1f}")
            coords.append(f"{f.sx(x):.1f},{f.sy(y):.1f}")
        f.parts.append(
            f'<polyline points="{" ".join(coords)}" fill="none" stroke="{esc(s.color)}" '
            f'stroke-width="2"{dash}><title>{esc(s.label)}</title></polyline>'
        )
    if s.kind == "points" or len(pts) <= 60:
        notes = list(s.notes) if s.notes else None
        for k, (x, y) in enumerate(pts):
            note = notes[k] if notes and k < len(notes) else f"{x_names[k]}: {y_fmt(y)}"
            f.parts.append(
                f'<circle cx="{f.sx(x):.1f}" cy="{f.sy(y):.1f}" r="3.2" fill="{esc(s.color)}">'
                f"<title>{esc(s.label)} · {esc(note)}</title></circle>"
            )


def time_chart(
    *,
    title: str,
    series: Sequence[Series],
    y_label: str,
    x_label: str = "time since start",
    y_fmt: Fmt = fmt_num,
    markers: Sequence[Marker] = (),
    x_end: float | None = None,
) -> str:
    """Series against ``xs`` in seconds since the start, with vertical ``markers``; the time
    axis runs to ``x_end`` (the end of the run) when given, else to the last point."""
    xs_all = [x for s in series for x in (s.xs or ())] + [m.x for m in markers]
    ys_all = [y for s in series for y in s.ys if y is not None]
    if not xs_all or (not ys_all and not markers):
        return empty_chart(title)
    x1 = max([*xs_all, x_end or 0.0])
    x1 = x1 if x1 > 0 else 1.0
    top = max(ys_all) if ys_all and max(ys_all) > 0 else 1.0
    f = _Frame(x0=0.0, x1=x1, y0=0.0, y1=unit_ticks(top, y_fmt)[-1], y_fmt=y_fmt)
    _axes(f, y_label=y_label, x_label=x_label)
    for x in unit_ticks(x1, fmt_s, 6):
        if x <= x1:  # a label that would run past the right edge ends at the tick instead
            px, label = f.sx(x), fmt_s(x)
            anchor = "end" if px + TICK_CHAR_PX * len(label) / 2 > W - 2 else "middle"
            f.parts.append(
                f'<text x="{px:.1f}" y="{H - BOTTOM + 15}" text-anchor="{anchor}" '
                f'class="tick">{esc(label)}</text>'
            )
    for k, m in enumerate(markers):
        px = f.sx(m.x)
        f.parts.append(
            f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{H - BOTTOM}" '
            f'stroke="{esc(m.color)}" stroke-width="2" stroke-dasharray="3 3">'
            f"<title>{esc(m.label)}</title></line>"
        )
        if m.tag and len(markers) <= 12:  # beyond that the legend and tooltips say it
            right = px > W - RIGHT - 80
            f.parts.append(
                f'<text x="{px + (-4 if right else 4):.1f}" y="{TOP + 10 + 13 * (k % 3)}" '
                f'text-anchor="{"end" if right else "start"}" class="mark" '
                f'fill="{esc(m.color)}">{esc(m.tag)}</text>'
            )
    for s in series:
        names = [fmt_s(x) for x in (s.xs or ())]
        _draw_xy(f, s, list(s.xs or ()), y_fmt=y_fmt, x_names=names)
    seen: dict[str, Marker] = {}
    for m in markers:
        seen.setdefault(m.tag or m.label, m)
    _legend(f, [*series, *seen.values()])
    return _svg(title, "".join(f.parts))
