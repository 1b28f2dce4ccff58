"""The memory tier's recycling pool (store/files/staged.py): no process that opens a file of the
tier, ever, ends the writer (a write lease left held would: the kernel sends it SIGIO), and the
files a killed writer left are reused by the next one."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.files.staged import FREE_DIR
from flashckpt.store.store import STAGING_DIR

SIZE = 64 * 4096


POOL_TWO = """
import os, signal, subprocess, sys
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import STAGING_DIR
mem, size = sys.argv[1], int(sys.argv[2])
backend = LocalBackend(mem)
backend.recycle_bytes = 1 << 30
for i in range(2):  # two chunk files freed into the pool
    backend.put(f"chunks/ab/ab{i:02d}", [os.urandom(size)])
    assert backend.recycle(f"chunks/ab/ab{i:02d}") == size
"""
KILLED = POOL_TWO + "os.kill(os.getpid(), signal.SIGKILL)\n"


def test_the_files_a_killed_writer_pooled_are_reused_by_the_next(mem: Path) -> None:
    """The pool is on disk, not in the process: the files a writer killed with SIGKILL left
    are checked (this user's, one link, nobody has them open) and refilled by the next."""
    killed = subprocess.run([sys.executable, "-c", KILLED, str(mem), str(SIZE)], timeout=60)
    assert killed.returncode == -9
    fresh = LocalBackend(mem)
    fresh.recycle_bytes = 1 << 30
    staged = fresh.open_staged(STAGING_DIR, SIZE)
    assert staged.recycled
    staged.write(b"q" * SIZE)
    staged.publish("chunks/ef/ef00")
    assert (mem / "chunks" / "ef" / "ef00").read_bytes() == b"q" * SIZE


WRITER = (
    POOL_TWO
    + """
staged = backend.open_staged(STAGING_DIR, size)  # a save refilling a pooled file
assert staged.recycled
def backup():  # a reader opening every file of the tier, as tar or rsync would
    subprocess.run([sys.executable, "-c", sys.argv[3], mem], check=True, timeout=60)
backup()  # opens the staged file being filled and the pooled one waiting
staged.write(b"w" * size)
staged.publish("chunks/cd/cd00")
backup()
print("writer alive")
"""
)


READER = """
import os, sys
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        with open(os.path.join(d, f), "rb") as fh:
            fh.read(1)
"""


def test_a_reader_opening_any_file_of_the_tier_never_ends_the_writer(mem: Path) -> None:
    """A backup reading the memory tier while a save refills a pooled file opened the staged
    file under the writer's write lease: the kernel sent the writer SIGIO, whose default
    action ends the process (the writer died with -29 before the lease was given back at
    once)."""
    out = subprocess.run(
        [sys.executable, "-c", WRITER, str(mem), str(SIZE), READER],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"the writer ended with {out.returncode}: {out.stderr[-2000:]}"
    assert "writer alive" in out.stdout
    assert (mem / "chunks" / "cd" / "cd00").read_bytes() == b"w" * SIZE


def _file_events(fn) -> dict[str, int]:
    """How many directory listings (``list``) and opens (``open``) ``fn()`` makes in this
    thread."""
    seen: list[str] = []
    me = threading.get_ident()

    def hook(event: str, args: tuple) -> None:
        if watching and threading.get_ident() == me:
            if event in ("os.scandir", "os.listdir"):
                seen.append("list")
            elif event == "open":
                seen.append("open")

    watching = False
    sys.addaudithook(hook)  # audit hooks cannot be removed: this one goes quiet after
    watching = True
    try:
        fn()
    finally:
        watching = False
    return {"list": seen.count("list"), "open": seen.count("open")}


def test_a_staged_chunk_takes_a_pooled_file_without_listing_the_pool(mem: Path) -> None:
    """The pool's files are listed once per process and then known: each staged chunk used to
    list them all again (a cost per chunk that grew with the pool) and walk down to them from
    the root. A file that went away behind the pool's back is skipped, and the next one of
    the size is taken."""
    backend = LocalBackend(mem)
    backend.recycle_bytes = 1 << 30
    paths = [f"chunks/{i:02x}/{i:02x}00" for i in range(20)]
    for p in paths:
        backend.put(p, [b"z" * SIZE])
    assert backend.remove_files(paths) == [SIZE] * 20  # every one kept, none deleted
    pooled = sorted((mem / FREE_DIR).iterdir())
    assert len(pooled) == 20 and not (mem / "chunks" / "00" / "0000").exists()
    pooled[0].unlink()  # someone cleaned up behind the pool's back

    (mem / "chunks" / "ee").mkdir()  # made by the first publish otherwise (two opens more)

    def take_ten() -> None:
        for i in range(10):
            staged = backend.open_staged(STAGING_DIR, SIZE)
            assert staged.recycled
            staged.write(b"t" * SIZE)
            staged.publish(f"chunks/ee/ee{i:02d}")

    # each: the root, staging/, staging/free from staging/'s fd, the pooled file; then the
    # publish's root, chunks/, chunks/ee; once more free/ for the file that vanished (before:
    # free/ was walked to from the root, and the pool listed, for every chunk)
    assert _file_events(take_ten) == {"list": 0, "open": 10 * 7 + 1}
    assert len(list((mem / FREE_DIR).iterdir())) == 9
    assert (mem / "chunks" / "ee" / "ee09").read_bytes() == b"t" * SIZE
    assert backend.drain_free() == 9 * SIZE
