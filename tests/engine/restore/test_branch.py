"""A writer's branch point (engine/restore/lineage.py Branch): set by restore(), fixed at the
first save, unknown when restore() was never called."""

from __future__ import annotations

from flashckpt.engine.restore.lineage import Branch
from flashckpt.store.format.lineage import Lineage


def test_never_restored_is_unknown() -> None:
    assert Branch(3).lineage() == Lineage(generation=3, parent_generation=2, parent_step=None)


def test_restored_step_and_its_generation() -> None:
    b = Branch(5)
    b.restored(40, 2)
    assert b.lineage() == Lineage(generation=5, parent_generation=2, parent_step=40)


def test_fresh_start() -> None:
    b = Branch(1)
    b.restored(None, None)
    assert b.lineage() == Lineage(generation=1, parent_generation=0, parent_step=-1)


def test_a_copy_of_unknown_generation_leaves_the_branch_unknown() -> None:
    b = Branch(4)
    b.restored(7, None)  # loaded from a peer's tier: no lineage was read
    assert b.lineage().parent_step is None


def test_the_first_save_fixes_the_branch_point() -> None:
    b = Branch(4)
    b.restored(10, 3)
    first = b.lineage()
    b.restored(2, 1)  # a later restore(step=2) in the same writer
    assert b.lineage() == first == Lineage(generation=4, parent_generation=3, parent_step=10)
