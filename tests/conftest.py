import os

# Multi-process tests share 2 cores: one thread per process avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free local port (skips when moto[server]/s3fs are absent)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 's3fs')")
    from s3server import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on the session's S3 server; the environment points boto/s3fs at it."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.bucket = s3_server.new_bucket()
    s3_server.reset()
    return s3_server
