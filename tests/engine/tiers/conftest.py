"""Fixtures for tier tests: a real S3-compatible server (moto in server mode) on loopback."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Start moto's S3 server on 127.0.0.1 for the session; yields its endpoint URL."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh bucket; yields its name."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``AWS_ENDPOINT_URL`` pointing at the test server (for subprocesses and s3fs alike)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A memory-tier directory: under /dev/shm when it exists, else under tmp_path."""
    base = Path("/dev/shm")
    if base.is_dir() and os.access(base, os.W_OK):
        d = base / f"flashckpt-test-{uuid.uuid4().hex[:12]}"
    else:
        d = tmp_path / "shm"
    yield d
    if d.is_dir() and str(d).startswith("/dev/shm/"):
        import shutil

        shutil.rmtree(d, ignore_errors=True)
