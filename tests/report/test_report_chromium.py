"""Render the report in headless Chromium and check the plots are really drawn.

Chromium is required (``make test`` installs it); a missing browser fails this test loudly.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flashckpt.report import build_report

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail(
            "chromium is not installed; the report test renders the page in headless Chromium. "
            "Install it with: apt-get update && apt-get install -y chromium (or run make test)"
        )
    return exe


def _run(args: list[str], tmp: Path) -> str:
    cmd = [_chromium(), *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=45)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Minimal PNG decoder (8-bit RGB/RGBA, not interlaced): width, height, RGB rows."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0
            bpp = 4 if color == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        ftype, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line[j] for i in range(0, stride, bpp) for j in (i, i + 1, i + 2)))
        prev = line
    return width, height, rows


def _count(rows: list[bytes], rgb: tuple[int, int, int]) -> int:
    needle = bytes(rgb)
    return sum(sum(1 for i in range(0, len(r), 3) if r[i : i + 3] == needle) for r in rows)


@pytest.fixture(scope="module")
def rendered(
    tmp_path_factory: pytest.TempPathFactory, journal_factory: Callable[[], list[dict[str, Any]]]
) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("chromium")
    page = tmp / "report.html"
    page.write_text(build_report(journal_factory(), gpu_hour_price=2.5), encoding="utf-8")
    return tmp, page


def test_dom_has_the_svg_plots(rendered: tuple[Path, Path]) -> None:
    tmp, page = rendered
    dom = _run(["--dump-dom", page.as_uri()], tmp)
    assert dom.count("<svg") == 6
    assert dom.count("<polyline") >= 4 and dom.count("<circle") > 50
    # the restart card: kill -> first resumed step, and its parts
    card = dom.split('<div class="k">restart</div>', 1)[1].split('<div class="card">', 1)[0]
    assert "1.79 min" in card and "down 400 ms · start 1.58 min · restore 12 s" in card


def test_screenshot_shows_the_charts(rendered: tuple[Path, Path]) -> None:
    tmp, page = rendered
    png = tmp / "report.png"
    _run([f"--screenshot={png}", "--window-size=1280,1800", page.as_uri()], tmp)
    width, height, rows = read_png(png)
    assert (width, height) == (1280, 1800)
    # chart colours really reach the screen: new-bytes/blocking bars (blue), throughput bars
    # and the useful-time bar (green), the crash marker (red), interval line (purple)
    for rgb, at_least in (
        ((0x25, 0x63, 0xEB), 5000),
        ((0x10, 0xB9, 0x81), 5000),
        ((0x8B, 0x5C, 0xF6), 200),
        ((0xEF, 0x44, 0x44), 200),
    ):
        assert _count(rows, rgb) >= at_least, rgb
    # nothing is drawn past the content: the bottom rows are plain background
    assert len(set(rows[-1])) <= 3


# Measures every chart's text in the browser (injected into a copy of the page; the report
# itself has no scripts): labels outside their chart (clipped) and axis titles overlapping
# tick labels.
_PROBE = """<script>
const bad = [];
for (const svg of document.querySelectorAll("svg.chart")) {
  const box = svg.getBoundingClientRect();
  const name = svg.getAttribute("aria-label");
  const texts = [...svg.querySelectorAll("text")];
  for (const t of texts) {
    const r = t.getBoundingClientRect();
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5)
      bad.push(`${name}: '${t.textContent}' clipped`);
  }
  const title = texts.find(t => (t.getAttribute("transform") || "").startsWith("rotate"));
  for (const t of texts.filter(t => t.classList.contains("tick"))) {
    const a = title.getBoundingClientRect(), b = t.getBoundingClientRect();
    if (a.right > b.left && a.left < b.right && a.bottom > b.top && a.top < b.bottom)
      bad.push(`${name}: axis title overlaps '${t.textContent}'`);
  }
}
document.body.insertAdjacentHTML("beforeend",
  `<pre id="probe">${bad.length ? bad.join("\\n") : "ALL-LABELS-FIT"}</pre>`);
</script>"""


def test_labels_are_readable_in_the_browser(
    tmp_path: Path, journal_factory: Callable[[], list[dict[str, Any]]]
) -> None:
    events = [e for e in journal_factory() if e["event"] != "bench"]  # no raw-device line
    for e in events:  # ~0.93 GiB/s: the y axis counts up to 1000 MiB/s
        if e["event"] == "durable":
            e["throughput_Bps"] = 1.0e9
    html = build_report(events, gpu_hour_price=2.5)
    assert "e+" not in html.split("<footer>")[0]  # no exponent notation on any label
    page = tmp_path / "probe.html"
    page.write_text(html.replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    dom = _run(["--dump-dom", page.as_uri()], tmp_path)
    probe = dom.rsplit('<pre id="probe">', 1)[1].split("</pre>", 1)[0]  # the last: not the script
    assert probe == "ALL-LABELS-FIT"
    assert "1000 MiB/s" in dom
