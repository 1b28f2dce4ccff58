"""The fsspec remote tier against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.errors import ConfigError, StorageError
from flashckpt.journal import read_events
from flashckpt.store.files.remote import FsspecBackend
from flashckpt.store.files.retry import RetryPolicy, call_with_retry, is_transient


def test_backend_contract_on_s3(s3_env: str, s3_bucket: str) -> None:
    import boto3

    b = FsspecBackend(f"s3://{s3_bucket}/run", part_size="5MiB")
    data = os.urandom(12 << 20)  # > 2 parts: a multipart upload
    assert b.put("chunks/ab/big", [data[: 7 << 20], memoryview(data)[7 << 20 :]]) == len(data)
    assert b.put("steps/000000000001.json", [b"{}"]) == 2
    assert b.list("chunks") == ["ab"]
    assert b.list("chunks/ab") == ["big"]
    assert b.list("nothing") == []
    assert b.exists("chunks/ab/big") and b.size("chunks/ab/big") == len(data)
    assert b.read("chunks/ab/big") == data
    out = memoryview(bytearray(len(data)))
    assert b.read_into("chunks/ab/big", out) == len(data) and bytes(out) == data
    head = boto3.client("s3", endpoint_url=s3_env).head_object(
        Bucket=s3_bucket, Key="run/chunks/ab/big"
    )
    parts = head["ETag"].strip('"').rpartition("-")[2]
    assert parts.isdigit() and int(parts) >= 2, head["ETag"]  # a multipart upload
    with pytest.raises(FileNotFoundError):
        b.read("chunks/ab/missing")
    b.delete("chunks/ab/big")
    b.delete("chunks/ab/big")  # missing is fine
    assert b.list("chunks/ab") == []
    with pytest.raises(StorageError):
        b.put("../escape", [b"x"])


def test_options_reach_fsspec_and_bad_urls(s3_server: str, s3_bucket: str) -> None:
    b = FsspecBackend(f"s3://{s3_bucket}/o", options={"endpoint_url": s3_server})
    b.put("steps/x.json", [b"1"])
    assert b.read("steps/x.json") == b"1"
    with pytest.raises(ConfigError):
        FsspecBackend("not-a-url")
    with pytest.raises(ConfigError):
        FsspecBackend(f"s3://{s3_bucket}/o", part_size="1MiB")


def test_unreachable_remote_is_a_storage_error_naming_the_url(s3_server: str) -> None:
    opts = {
        "endpoint_url": "http://127.0.0.1:9",  # discard port: connection refused
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    b = FsspecBackend(
        "s3://nobucket/run",
        options=opts,
        retry=RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.01),
    )
    with pytest.raises(StorageError, match="s3://nobucket/run/steps/x"):
        b.put("steps/x", [b"1"])


def test_transient_classification() -> None:
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(errno.ECONNREFUSED, "refused"))
    assert is_transient(OSError(errno.EIO, "An error occurred (SlowDown): reduce your rate"))
    assert is_transient(OSError(errno.EIO, "503 Service Unavailable"))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(OSError(errno.EIO, "InvalidBucketName"))
    wrapped = OSError(errno.EIO, "wrapped")
    wrapped.__cause__ = ConnectionError("reset")
    assert is_transient(wrapped)


def test_call_with_retry_backs_off_then_succeeds_or_gives_up() -> None:
    sleeps: list[float] = []
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("reset")
        return "ok"

    policy = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=1.0)
    assert call_with_retry(flaky, what="t", policy=policy, sleep=sleeps.append) == "ok"
    assert len(sleeps) == 2 and sleeps[1] > sleeps[0]  # exponential: ~0.1 then ~0.2
    with pytest.raises(ConnectionError):
        call_with_retry(
            lambda: (_ for _ in ()).throw(ConnectionError("x")),
            what="t",
            policy=policy,
            sleep=sleeps.append,
        )
    assert len(sleeps) == 2 + 4
    with pytest.raises(FileNotFoundError):  # never retried
        call_with_retry(
            lambda: (_ for _ in ()).throw(FileNotFoundError("x")),
            what="t",
            policy=policy,
            sleep=sleeps.append,
        )
    assert len(sleeps) == 6


def test_checkpointer_uses_aws_endpoint_url_and_lists_no_bucket_per_save(
    tmp_path: Path, s3_env: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed: list[str] = []
    real_list = FsspecBackend.list

    def counting_list(self: FsspecBackend, prefix: str) -> list[str]:
        listed.append(prefix)
        return real_list(self, prefix)

    monkeypatch.setattr(FsspecBackend, "list", counting_list)
    model = torch.nn.Linear(600, 600)  # weight > pack threshold: its own chunk
    url = f"s3://{s3_bucket}/run"
    with flashckpt.Checkpointer(tmp_path / "ck", remote=url) as ck:  # no endpoint option: env var
        for step in range(1, 6):
            with torch.no_grad():
                model.bias.add_(1)
            ck.save(step, {"m": model})
    chunk_lists = [p for p in listed if p.startswith("chunks")]
    assert chunk_lists.count("chunks") == 1, listed  # the chunk index is listed once
    assert all(p in ("steps", "chunks") or p.startswith("chunks/") for p in listed)
    promoted = [e for e in read_events(tmp_path / "ck") if e["event"] == "promoted"]
    assert [e["step"] for e in promoted] == [1, 2, 3, 4, 5]
    assert promoted[1]["bytes"] < promoted[0]["bytes"]  # weight chunk reused, only bias new
    remote_store = flashckpt.Checkpointer(tmp_path / "other", remote=url)
    try:
        assert remote_store.steps() == [1, 2, 3, 4, 5]
        fresh = torch.nn.Linear(600, 600)
        (tmp_path / "ck").rename(tmp_path / "gone")  # only the remote copy is left for "other"
        assert remote_store.restore({"m": fresh}) == 5
        assert torch.equal(fresh.bias, model.bias) and torch.equal(fresh.weight, model.weight)
    finally:
        remote_store.close()
    ev = [e for e in read_events(tmp_path / "other") if e["event"] == "restore"]
    assert ev and ev[-1]["tier"] == "remote"
