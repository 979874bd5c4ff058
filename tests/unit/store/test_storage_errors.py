"""A store's client failing, through the API and the command line, on a real S3 API (moto's server).

Missing credentials, a refused connection, a storage option the file system does not take, and a
store that stops answering (a TCP server that accepts and never replies, or a forwarder to moto
that stalls mid-save) each end in a ``StorageError`` naming the URL and the cause, in bounded time,
without a credential in the message; the command line exits 2. A save that the store stops
answering mid-way fails within the deadline and leaves the previous checkpoint committed, bit-exact.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO, merge_checkpoint, verify_checkpoint
from unickpt.cli.main import main
from unickpt.errors import ConfigError, StorageError, UnickptError
from unickpt.store.storage import open_storage
from unickpt.store.storage_guard import ENV, redactor, shown_url, store_timeout

KEY = "AKIAUNICKPTTEST0042"
SECRET = "s3cr3t-Value-9f8e7d6c"
TOKEN = "sEsSiOn-ToKeN-5a4b3c"
DEADLINE = 3.0  # seconds: the deadline the stalling cases run with (the first call makes the client)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 5))


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


class _Silent:
    """A TCP server that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        for s in [self.sock, *self.conns]:
            s.close()


@pytest.fixture
def silent() -> Iterator[_Silent]:
    s = _Silent()
    yield s
    s.close()


@pytest.fixture
def no_ambient_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere botocore looks: none in the environment, empty credential and config
    files, no instance metadata."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    (tmp_path / "credentials").write_text("")
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def saved(s3_server: Any, no_ambient_credentials: None) -> str:
    """A committed checkpoint of ``_model(0)`` on the S3 server (written with good credentials)."""
    url = f"s3://{s3_server.new_bucket()}/ckpt"
    io = GeneralCheckpointIO()
    io.storage_options = s3_server.storage_options()  # type: ignore[attr-defined]
    io.save_model(_model(0), url, shard=True, size_per_shard=0.01)
    return url


def _case(name: str, s3_server: Any, silent: _Silent) -> tuple[dict[str, Any], str, float]:
    """(storage options, what the message must say, seconds the operation may take) for a failure."""
    base: dict[str, Any] = {"skip_instance_cache": True, "client_kwargs": {"region_name": "us-east-1"}}
    creds = {"key": KEY, "secret": SECRET, "token": TOKEN}
    if name == "no_credentials":
        return {**base, "endpoint_url": s3_server.endpoint}, "no usable credentials", 10.0
    if name == "unknown_option":
        return {**base, **creds, "endpoint_url": s3_server.endpoint, "foo": 1}, "storage option 'foo'", 10.0
    if name == "refused":
        opts = {**base, **creds, "endpoint_url": f"http://127.0.0.1:{_free_port()}"}
        opts["config_kwargs"] = {"retries": {"max_attempts": 1}}  # botocore's own retries: seconds each
        return opts, "endpoint cannot be reached", 10.0
    assert name == "silent"
    opts = {**base, **creds, "endpoint_url": silent.endpoint, "unickpt_timeout": DEADLINE}
    return opts, f"did not finish within {DEADLINE:g} s", DEADLINE + 6.0


CASES = ["no_credentials", "unknown_option", "refused", "silent"]


def _check(e: BaseException, url: str, said: str) -> None:
    text = str(e)
    assert isinstance(e, StorageError), f"{type(e).__name__}: {e}"
    assert url in text and said in text, text
    for secret in (SECRET, TOKEN, KEY):
        assert secret not in text, text


def _run_op(op: str, url: str, opts: dict[str, Any], tmp_path: Path, mp: pytest.MonkeyPatch) -> None:
    if op == "load_model":
        io = GeneralCheckpointIO()
        io.storage_options = opts  # type: ignore[attr-defined]
        io.load_model(_model(1), url)
    elif op == "save_model":
        io = GeneralCheckpointIO()
        io.storage_options = opts  # type: ignore[attr-defined]
        io.save_model(_model(1), url, shard=True, size_per_shard=0.01)
    elif op == "merge":
        merge_checkpoint(url, tmp_path / "merged", storage_options=opts)
    else:  # verify_checkpoint takes a URL's options from fsspec's configuration and the environment
        import fsspec.config

        mp.setitem(fsspec.config.conf, "s3", {k: v for k, v in opts.items() if k != "unickpt_timeout"})
        if "unickpt_timeout" in opts:
            mp.setenv(ENV, str(opts["unickpt_timeout"]))
        verify_checkpoint(url)


@pytest.mark.parametrize("op", ["load_model", "save_model", "merge", "verify"])
@pytest.mark.parametrize("case", CASES)
def test_api_raises_storage_error(
    case: str,
    op: str,
    saved: str,
    s3_server: Any,
    silent: _Silent,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opts, said, bound = _case(case, s3_server, silent)
    t0 = time.monotonic()
    with pytest.raises(UnickptError) as got, monkeypatch.context() as mp:
        _run_op(op, saved, opts, tmp_path, mp)
    took = time.monotonic() - t0
    _check(got.value, saved, said)
    assert took < bound, f"{op} took {took:.1f} s"
    assert not (tmp_path / "merged").exists()
    # The checkpoint is still committed and whole (read with good credentials).
    io = GeneralCheckpointIO()
    io.storage_options = s3_server.storage_options()  # type: ignore[attr-defined]
    target = _model(2)
    io.load_model(target, saved)
    assert _same(target, _model(0))


def _cli_options(opts: dict[str, Any]) -> list[str]:
    import json

    out: list[str] = []
    for k, v in opts.items():
        out += ["--storage-option", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return out


@pytest.mark.parametrize("command", ["verify", "inspect", "merge"])
@pytest.mark.parametrize("case", CASES)
def test_cli_exits_2_naming_the_url(
    case: str,
    command: str,
    saved: str,
    s3_server: Any,
    silent: _Silent,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    opts, said, bound = _case(case, s3_server, silent)
    args = [command, saved, *([str(tmp_path / "merged")] if command == "merge" else []), *_cli_options(opts)]
    t0 = time.monotonic()
    code = main(args)
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert code == 2, err
    assert f"unickpt {command}: error: " in err and saved in err and said in err, err
    assert "internal error" not in err
    for secret in (SECRET, TOKEN, KEY):
        assert secret not in out + err
    assert took < bound
    assert ENV not in os.environ  # the command's unickpt_timeout is undone after it


def test_cli_bad_timeout_is_a_config_error(saved: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", saved, "--storage-option", "unickpt_timeout=soon"]) == 2
    assert "storage option unickpt_timeout: expected seconds" in capsys.readouterr().err


@pytest.mark.long
def test_save_stalled_mid_way_fails_in_time_and_keeps_the_previous_checkpoint(
    s3_server: Any, no_ambient_credentials: None
) -> None:
    from stallproxy import StallProxy

    url = f"s3://{s3_server.new_bucket()}/ckpt"
    good = GeneralCheckpointIO()
    good.storage_options = s3_server.storage_options()  # type: ignore[attr-defined]
    good.save_model(_model(0), url, shard=True, size_per_shard=0.01)
    before = s3_server.objects(url)
    index = before["model.safetensors.index.json"]
    assert sum(n.endswith(".safetensors") for n in before) >= 3

    proxy = StallProxy(s3_server.endpoint)
    proxy.stall_at = ("PUT", 3)  # the lock, the first data file, then the store stops answering
    try:
        io = GeneralCheckpointIO()
        io.storage_options = {  # type: ignore[attr-defined]
            **s3_server.storage_options(),
            "key": KEY,  # moto takes any key
            "secret": SECRET,
            "endpoint_url": proxy.endpoint,
            "unickpt_timeout": DEADLINE,
        }
        t0 = time.monotonic()
        with pytest.raises(StorageError) as got:
            io.save_model(_model(1), url, shard=True, size_per_shard=0.01)
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert proxy.stalled.is_set() and proxy.requests["PUT"] >= 3, got.value  # data files go up in parallel
    _check(got.value, url, f"did not finish within {DEADLINE:g} s")
    assert "put_object of s3://" in str(got.value)
    # One deadline, then the failed save's cleanup at QUIET_TIMEOUT a step (not one deadline each).
    assert took < DEADLINE + 5.0, took
    after = s3_server.objects(url)
    assert after["model.safetensors.index.json"] == index  # the index, the commit point, untouched
    for name, data in before.items():
        assert after[name] == data
    target = _model(2)
    good.load_model(target, url)
    assert _same(target, _model(0))


def test_a_load_stalled_mid_way_fails_in_time(s3_server: Any, no_ambient_credentials: None) -> None:
    from stallproxy import StallProxy

    url = f"s3://{s3_server.new_bucket()}/ckpt"
    good = GeneralCheckpointIO()
    good.storage_options = s3_server.storage_options()  # type: ignore[attr-defined]
    good.save_model(_model(0), url, shard=True, size_per_shard=0.01)
    proxy = StallProxy(s3_server.endpoint)
    proxy.stall_at = ("GET", 2)  # the index is read, then the store stops answering
    try:
        io = GeneralCheckpointIO()
        io.storage_options = {  # type: ignore[attr-defined]
            **s3_server.storage_options(),
            "endpoint_url": proxy.endpoint,
            "unickpt_timeout": DEADLINE,
        }
        t0 = time.monotonic()
        with pytest.raises(StorageError) as got:
            io.load_model(_model(1), url)
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert proxy.stalled.is_set(), got.value
    _check(got.value, url, f"did not finish within {DEADLINE:g} s")
    assert took < DEADLINE + 5.0, took


def test_store_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert store_timeout() == 120.0
    monkeypatch.setenv(ENV, "7.5")
    assert store_timeout() == 7.5
    assert store_timeout(3) == 3.0  # the storage option wins
    assert store_timeout(0) is None
    monkeypatch.setenv(ENV, "0")
    assert store_timeout() is None
    for bad in ("-1", "nan", "inf", "soon"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError, match=f"{ENV}: expected seconds .* got '{bad}'"):
            store_timeout()
    with pytest.raises(ConfigError, match="storage option unickpt_timeout: expected seconds"):
        store_timeout([1])
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ConfigError, match=ENV):
        open_storage("s3://bucket/x", {"anon": True})


def test_redactor_hides_every_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envSecretValue")
    opts = {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"aws_session_token": TOKEN, "region_name": "us-east-1"},
        "account_key": "azureAccountKey==",
        "anon": False,
        "endpoint_url": "http://127.0.0.1:9000",
    }
    url = "ftp://alice:hunter22@host/dir"
    redact = redactor(url, opts)
    text = f"{KEY} {SECRET} {TOKEN} azureAccountKey== envSecretValue {url} http://bob:pw123@x/y us-east-1"
    shown = redact(text)
    for secret in (KEY, SECRET, TOKEN, "azureAccountKey==", "envSecretValue", "hunter22", "pw123"):
        assert secret not in shown
    assert "ftp://alice:***@host/dir" in shown and "http://bob:***@x/y" in shown
    assert "us-east-1" in shown
    assert shown_url("s3://bucket/key") == "s3://bucket/key"


def test_store_answers_pass_through(s3: Any) -> None:
    """A missing object, an object that exists, a lost exclusive write: answers, not errors."""
    from unickpt.errors import IncompleteCheckpointError

    store, root = open_storage(f"s3://{s3.bucket}/x", s3.storage_options())
    with pytest.raises(IncompleteCheckpointError):
        store.read_bytes(store.join(root, "missing"))
    assert store.listdir(store.join(root, "nothing")) == []
    assert store.put(store.join(root, "a"), b"1", exclusive=True) is True
    assert store.put(store.join(root, "a"), b"2", exclusive=True) is False
    assert store.read_bytes(store.join(root, "a")) == b"1"


def test_a_stream_on_an_unreachable_store_is_a_storage_error(s3_server: Any, silent: _Silent) -> None:
    """Files opened on the store (the convert tools' streams) map their errors too."""
    opts, _, _ = _case("refused", s3_server, silent)
    store, root = open_storage("s3://bucket/x", opts)
    with pytest.raises(
        StorageError, match=r"open of s3://bucket/x/a\.bin failed: the store's endpoint cannot be"
    ):
        store.fs.open(store.join(root, "a.bin"), "rb")  # type: ignore[attr-defined]
    mem, mroot = open_storage(f"memory://streams-{os.getpid()}")
    with mem.fs.open(mem.join(mroot, "f"), "wb") as f:  # type: ignore[attr-defined]
        f.write(b"abc")
    with mem.fs.open(mem.join(mroot, "f"), "rb") as f:  # type: ignore[attr-defined]
        assert f.read() == b"abc"
