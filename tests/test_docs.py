"""The README stays a README, and the documentation site builds offline in strict mode (a
broken link, anchor or API reference fails), as ``make docs`` builds it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    targets = [t for t in LINK.findall(text) if "://" not in t]
    assert "docs/guides/integration.md" in targets  # where to read more
    for target in targets:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), f"README links to {target}, which does not exist"
        if anchor and path.endswith(".md"):
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)}
            assert anchor in slugs, f"README links to {target}: no such heading"


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs and GitHub both use for these headings)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_every_guide_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, str):
            listed.append(node)
        elif isinstance(node, list):
            for n in node:
                walk(n)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)

    walk(config["nav"])
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(listed) == pages


def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    api = (site / "reference" / "checkpointer.html").read_text()
    assert "Save and restore training state" in api  # the reference came from the docstrings
    for guide in ("integration", "tiers", "distributed", "memory", "intervals", "integrations"):
        assert (site / "guides" / f"{guide}.html").is_file(), guide
    assert "Garbage collection" in (site / "benchmarks-record.html").read_text()
