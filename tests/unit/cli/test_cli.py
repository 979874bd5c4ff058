"""The unickpt command line: exit codes, no tracebacks, fast start without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from unickpt.cli.main import main
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def _ckpt(d: Path, scale: float = 1.0, cols: bool = False) -> Path:
    a = (np.arange(24, dtype=np.float32).reshape(4, 6) * scale).astype(np.float32)
    if cols:
        boxes = [((0, 0), (4, 2)), ((0, 2), (4, 4))]
    else:
        boxes = [((0, 0), (1, 6)), ((1, 0), (3, 6))]
    sl = [SliceData(o, s, np.ascontiguousarray(a[o[0] : o[0] + s[0], o[1] : o[1] + s[1]])) for o, s in boxes]
    b = np.ones(3, dtype=np.float32)
    write_checkpoint(
        str(d),
        {"w": TensorData("F32", a.shape, sl), "b": TensorData("F32", (3,), [SliceData((0,), (3,), b)])},
        files=2,
    )
    return d


def _flip(d: Path) -> None:
    f = sorted(p for p in d.iterdir() if p.suffix == ".safetensors")[0]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))


def test_inspect_and_verify_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = _ckpt(tmp_path / "c")
    assert main(["inspect", str(c)]) == 0
    out = capsys.readouterr().out
    assert "w" in out and "F32" in out and "[4,6]" in out and "2: [0:1,0:6] [1:4,0:6]" in out
    assert main(["inspect", "--json", str(c)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensors"]["w"]["num_slices"] == 2 and info["totals"]["bytes"] == 24 * 4 + 12
    assert main(["verify", "-q", str(c)]) == 0
    _flip(c)
    assert main(["verify", "-q", str(c)]) == 1
    err = capsys.readouterr().err
    assert "model-00001-of-00002.safetensors" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"weight_map": {"w": "../../etc/passwd.safetensors"}}', b"[]"],
)
def test_unusable_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    d = tmp_path / "bad"
    d.mkdir()
    (d / "model.safetensors.index.json").write_bytes(content)
    for cmd in (["verify"], ["inspect"]):
        assert main([*cmd, str(d)]) == 2
        err = capsys.readouterr().err
        assert "error" in err and "Traceback" not in err
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert main(["diff", str(d), str(d)]) == 2


def test_hostile_header_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    assert main(["verify", str(f)]) == 2
    assert "header" in capsys.readouterr().err


def test_diff_and_merge_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _ckpt(tmp_path / "a")
    b = _ckpt(tmp_path / "b", cols=True)
    c = _ckpt(tmp_path / "c", scale=2.0)
    assert main(["diff", str(a), str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", "--json", str(a), str(c)]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["changed"] == ["w"] and rep["same"] == ["b"]
    assert main(["merge", "-q", str(b), str(tmp_path / "m")]) == 0
    assert main(["diff", "--deep", str(tmp_path / "m"), str(a)]) == 0
    _flip(b)
    assert main(["merge", "-q", str(b), str(tmp_path / "m2")]) == 1
    assert "integrity" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists()
    assert main(["merge", "-q", str(a), str(tmp_path / "m")]) == 2  # output exists


def test_help_and_version() -> None:
    for sub in ("inspect", "verify", "diff", "merge", "convert"):
        r = subprocess.run(
            [sys.executable, "-m", "unickpt", sub, "--help"], capture_output=True, text=True, check=False
        )
        assert r.returncode == 0 and "usage: unickpt " + sub in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "unickpt", "--version"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0 and r.stdout.startswith("unickpt ")
    r = subprocess.run([sys.executable, "-m", "unickpt"], capture_output=True, text=True, check=False)
    assert r.returncode == 2


def test_cli_never_imports_torch_for_inspect_verify_diff(tmp_path: Path) -> None:
    a = _ckpt(tmp_path / "a")
    b = _ckpt(tmp_path / "b", cols=True)
    merged = tmp_path / "m"
    code = f"""
import sys, contextlib, io
import unickpt.cli.main as m
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    assert m.main(["inspect", {str(a)!r}]) == 0
    assert m.main(["inspect", "--json", {str(a)!r}]) == 0
    assert m.main(["verify", "-q", {str(a)!r}]) == 0
    assert m.main(["diff", {str(a)!r}, {str(b)!r}]) == 0
    assert m.main(["diff", "--deep", {str(a)!r}, {str(b)!r}]) == 0
    assert m.main(["merge", "-q", {str(b)!r}, {str(merged)!r}]) == 0
bad = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
assert not bad, bad
print("CLEAN")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("CLEAN")
