"""Tier identity and ownership: a memory tier belongs to one root and to the current user."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import warnings

import pytest

import flashckpt
from flashckpt.cli import main
from flashckpt.engine.tiers import identity as tierid
from flashckpt.engine.tiers.config import list_tiers, read_config
from hostile.util import small_state

pytestmark = pytest.mark.timeout(60)
OTHER_UID = 54321


def test_second_root_refuses_the_first_roots_memory_tier(tmp_path):
    mem = tmp_path / "shm" / "run"
    with flashckpt.Checkpointer(tmp_path / "a", memory_tier=mem) as ckpt:
        ckpt.save(5, small_state(5.0))
    with pytest.raises(flashckpt.ConfigError, match="belongs to another checkpoint root") as info:
        flashckpt.Checkpointer(tmp_path / "b", memory_tier=mem)
    msg = str(info.value)
    assert str(tmp_path / "a") in msg and str(tmp_path / "b") in msg
    assert tierid.find_root_id(tmp_path / "a") in msg and tierid.find_root_id(tmp_path / "b") in msg
    assert not (tmp_path / "b" / "steps").exists() or not list((tmp_path / "b" / "steps").iterdir())
    # the owning root reopens it fine
    with flashckpt.Checkpointer(tmp_path / "a", memory_tier=mem) as ckpt:
        assert ckpt.steps() == [5]


def test_memory_tier_is_created_0700_and_records_the_root_id(tmp_path):
    mem = tmp_path / "shm" / "run"
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ckpt:
        ckpt.save(1, small_state(1.0))
    assert stat.S_IMODE(os.lstat(mem).st_mode) == 0o700
    assert os.lstat(mem).st_uid == os.geteuid()
    rid = (tmp_path / "root" / "root-id").read_text().strip()
    assert json.loads((mem / "tiers.json").read_text())["root_id"] == rid
    assert json.loads((tmp_path / "root" / "tiers.json").read_text())["root_id"] == rid


def test_memory_tier_owned_by_another_user_is_refused(tmp_path):
    mem = tmp_path / "shm" / "planted"
    mem.mkdir(parents=True, mode=0o700)
    os.chown(mem, OTHER_UID, OTHER_UID)
    with pytest.raises(flashckpt.ConfigError, match=f"owned by uid {OTHER_UID}"):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem)


def test_world_writable_memory_tier_is_refused(tmp_path):
    mem = tmp_path / "shm" / "open"
    mem.mkdir(parents=True)
    os.chmod(mem, 0o777)
    with pytest.raises(flashckpt.ConfigError, match="writable by group or others"):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem)


def test_symlinked_memory_tier_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "run").symlink_to(real)
    with pytest.raises(flashckpt.ConfigError, match="symlink"):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=tmp_path / "shm" / "run")


def test_planted_step_in_a_foreign_tier_is_never_restored(tmp_path):
    """Another user pre-creates the predictable tier and plants step 999 in it."""
    mem = tmp_path / "shm" / "run"
    with flashckpt.Checkpointer(tmp_path / "attacker", memory_tier=mem) as ckpt:
        ckpt.save(999, small_state(999.0))
    os.chmod(mem, 0o777)
    with flashckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, small_state(1.0))
    with pytest.raises(flashckpt.ConfigError):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem)


def _ls(root) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert main(["ls", str(root)]) == 0
    return out.getvalue()


def test_ls_does_not_follow_a_memory_tier_of_another_root(tmp_path):
    mem_b = tmp_path / "shm" / "b"
    with flashckpt.Checkpointer(tmp_path / "b", memory_tier=mem_b) as ckpt:
        ckpt.save(77, small_state(77.0))
    with flashckpt.Checkpointer(tmp_path / "a") as ckpt:
        ckpt.save(1, small_state(1.0))
    cfg = tmp_path / "a" / "tiers.json"
    doc = json.loads(cfg.read_text())
    doc["tiers"].insert(0, {"name": "memory", "url": str(mem_b)})
    cfg.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="belongs to another checkpoint root"):
        held = list_tiers(tmp_path / "a")
    assert sorted(held) == [1]
    assert "77" not in _ls(tmp_path / "a")


def test_tiers_json_of_another_user_is_not_trusted(tmp_path):
    with flashckpt.Checkpointer(tmp_path / "a", memory_tier=tmp_path / "shm" / "a") as ckpt:
        ckpt.save(1, small_state(1.0))
    assert "memory" in read_config(tmp_path / "a")
    os.chown(tmp_path / "a" / "tiers.json", OTHER_UID, OTHER_UID)
    assert read_config(tmp_path / "a") == {}
    os.chown(tmp_path / "a" / "tiers.json", os.geteuid(), os.getegid())
    os.chmod(tmp_path / "a" / "tiers.json", 0o666)
    assert read_config(tmp_path / "a") == {}


def test_root_id_is_created_once(tmp_path):
    (tmp_path / "r").mkdir()
    ids = {tierid.ensure_root_id(tmp_path / "r") for _ in range(3)}
    assert len(ids) == 1 and len(ids.pop()) == 32
    (tmp_path / "r" / "root-id").write_text("../../etc\n")
    with pytest.raises(flashckpt.ConfigError, match="damaged"):
        tierid.find_root_id(tmp_path / "r")


def test_second_root_refuses_the_first_roots_remote_tier(tmp_path):
    """A remote prefix records the root it belongs to (``root-id``): a root with an id of its
    own given another run's remote= is refused naming both; a fresh root adopts the id (it
    continues that run after its local disk was lost) and restores from the remote."""
    import torch

    remote = f"memory://flashckpt-claim/{tmp_path.name}"
    with flashckpt.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        assert ckpt.wait_promoted(60)
    with flashckpt.Checkpointer(tmp_path / "b") as ckpt:  # run b: a root (and id) of its own
        ckpt.save(1, {"w": torch.zeros(4)})
    with pytest.raises(flashckpt.ConfigError, match="belongs to another checkpoint root"):
        flashckpt.Checkpointer(tmp_path / "b", remote=remote)
    state = {"w": torch.zeros(4)}
    with flashckpt.Checkpointer(tmp_path / "a2", remote=remote) as ckpt:  # a new disk for a
        assert ckpt.restore(state) == 1
    assert torch.equal(state["w"], torch.ones(4))
    assert (tmp_path / "a2" / "root-id").read_text() == (tmp_path / "a" / "root-id").read_text()
