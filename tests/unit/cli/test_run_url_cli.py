"""``unickpt inspect``/``verify`` on a CheckpointManager run saved to a real S3 API (moto's server):
the same reports, checks and exit codes as on a local copy of the run; ``inspect`` reads only
indexes and small records (sizes come from the listing); damage on the store is named."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from unickpt import CheckpointManager
from unickpt.cli.main import main

AGENT = 'config_kwargs={"user_agent_extra": "unickpt-client/cli"}'


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, object]:
        return {"n": self.n, "t": torch.arange(3) + self.n}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.n = int(sd["n"])  # type: ignore[call-overload]


class _Config:
    def to_json_string(self) -> str:
        return '{"model_type": "tiny"}'


def _fs(s3: Any) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options("test"))
    fs.invalidate_cache()
    return fs


@pytest.fixture(scope="module")
def saved_run(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Two committed steps on S3 (a 256x256 model with a config, AdamW, StepLR, an extra state), saved once
    per module, and a local copy downloaded from the store. Tests that damage it restore it."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/run"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))
    m.config = _Config()  # type: ignore[assignment]  # written beside the model, hashed in COMMIT
    opt = torch.optim.AdamW(m.named_parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    opts = s3_server.storage_options("mgr")
    mgr = CheckpointManager(url, save_steps=1, keep_last=None, storage_options=opts)
    counter = _Counter()
    for step in (1, 2):
        m(torch.randn(2, 256)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n = step
        mgr.save(step, m, opt, sched, counter=counter)
    local = tmp_path_factory.mktemp("copy") / "run"
    _fs(s3_server).get(f"{bucket}/run/", str(local), recursive=True)
    assert sorted(p.name for p in local.iterdir()) == ["latest", "step-1", "step-2"]
    return url, local


class _Run:
    """The module's run on S3 and this test's local copy; damage done through it on the store
    is undone when the test ends."""

    def __init__(self, s3: Any, url: str, local: Path) -> None:
        self.fs, self.url, self.local = _fs(s3), url, local
        self.base = url.removeprefix("s3://")
        self.saved: dict[str, bytes] = {}

    def _keep(self, rel: str) -> None:
        if rel not in self.saved:
            self.saved[rel] = (self.local / rel).read_bytes()

    def flip(self, rel: str, at: int = -2) -> None:
        """Flip one bit of byte ``at`` of ``rel`` on the store and in the local copy."""
        self._keep(rel)
        raw = bytearray(self.saved[rel])
        raw[at] ^= 0x20
        self.fs.pipe_file(f"{self.base}/{rel}", bytes(raw))
        (self.local / rel).write_bytes(bytes(raw))

    def delete(self, rel: str) -> None:
        self._keep(rel)
        self.fs.rm_file(f"{self.base}/{rel}")
        (self.local / rel).unlink()

    def restore(self) -> None:
        for rel, data in self.saved.items():
            self.fs.pipe_file(f"{self.base}/{rel}", data)


@pytest.fixture
def run(s3: Any, saved_run: tuple[str, Path], tmp_path: Path) -> Iterator[_Run]:
    url, local = saved_run
    mine = tmp_path / "run"
    shutil.copytree(local, mine)
    r = _Run(s3, url, mine)
    yield r
    r.restore()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")


def _same(text: str, url: str, local: Path) -> str:
    return text.replace(url, "RUN").replace(str(local), "RUN")


def _no_times(info: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in info.items() if k != "time"}
    if "steps" in out:
        out["steps"] = [{k: v for k, v in r.items() if k != "time"} for r in out["steps"]]
    return out


def _read_by_inspect(local: Path, sub: str) -> int:
    """Bytes of what ``inspect`` reads: on a run, each step's COMMIT and model index and
    ``latest``; on a step, its COMMIT, indexes, scheduler JSON and rank-0 train-state JSON."""
    if not sub:
        rels = ["latest"] + [
            f"{s}/{f}" for s in ("step-1", "step-2") for f in ("COMMIT", "model/model.safetensors.index.json")
        ]
    else:
        rels = [
            sub.strip("/") + "/" + f
            for f in (
                "COMMIT",
                "model/model.safetensors.index.json",
                "optimizer/optimizer.safetensors.index.json",
                "lr_scheduler.json",
                "train_state/rank-00000.json",
            )
        ]
    return sum((local / r).stat().st_size for r in rels)


def test_inspect_run_and_step_on_s3_match_the_local_copy(
    s3: Any, run: _Run, capsys: pytest.CaptureFixture[str]
) -> None:
    url, local = run.url, run.local
    for sub in ("", "/step-2", "/step-1"):
        s3.reset()
        code, out, err = _cli(capsys, "inspect", url + sub, "--json", "--storage-option", AGENT)
        assert (code, err) == (0, "")
        remote = json.loads(out)
        served = s3.served("GET", "cli")
        code, out, err = _cli(capsys, "inspect", str(local) + sub, "--json")
        assert (code, err) == (0, "")
        mine = json.loads(out)
        assert remote["path"] == url + sub and mine["path"] == str(local) + sub
        for t in [remote.get("time")] + [r["time"] for r in remote.get("steps", [])]:
            assert t is None or _TIME.fullmatch(t), t  # the COMMIT object's LastModified
        assert _no_times({**remote, "path": ""}) == _no_times({**mine, "path": ""})
        # Only indexes and small records were fetched (and the listings): every data file is
        # at least 1 KiB and the model's largest is 256 KiB, so reading any one would show.
        wanted = _read_by_inspect(local, sub)
        assert wanted <= served < wanted + (24 << 10), (served, wanted)
    assert remote["type"] == "step" and remote["bytes"] == sum(
        p.stat().st_size for p in (local / "step-1").rglob("*") if p.is_file()
    )
    for sub in ("", "/step-2"):
        code, text, _ = _cli(capsys, "inspect", url + sub)
        code2, text2, _ = _cli(capsys, "inspect", str(local) + sub)
        assert code == code2 == 0
        assert _TIME.sub("T", _same(text, url, local)) == _TIME.sub("T", _same(text2, url, local))
        first = "run        : " if not sub else "step       : 2   ("
        assert text.startswith(first + url + sub)


def test_verify_run_and_step_on_s3_match_the_local_copy(
    s3: Any, run: _Run, capsys: pytest.CaptureFixture[str]
) -> None:
    url, local = run.url, run.local
    for sub, extra in (("", ["--all"]), ("", []), ("/step-1", [])):
        code, out, err = _cli(capsys, "verify", url + sub, *extra)
        code2, out2, err2 = _cli(capsys, "verify", str(local) + sub, *extra)
        assert (code, err) == (code2, err2) == (0, "")
        assert _same(out, url, local) == _same(out2, url, local)
    assert "step 1 train_state: OK     1 rank(s), 3 file(s) rehashed" in out
    assert "step 1 model      : OK     4 tensors, 4 slice(s) rehashed, 1 side file(s) rehashed" in out
    assert out.splitlines()[-1] == f"OK: {url}/step-1: step(s) 1: every part checked, no damage found"


#: Objects of step 2 damaged at once (one bit each) and how verify names each.
FLIPS = {
    "train_state/rank-00000.safetensors": "step 2 train_state: RUN/step-2/train_state/rank-00000.safetensors: expected xxh3-64 ",
    "lr_scheduler.json": "step 2 train_state: RUN/step-2/lr_scheduler.json: expected xxh3-64 ",
    "model/config.json": "step 2 model: RUN/step-2/model/config.json: expected xxh3-64 ",
    "model/model-00001-of-00001.safetensors": "step 2 model: tensor '2.bias' in file 'model-00001-of-00001.safetensors' (stored as '2.bias@0'): expected xxh3-64 ",
}


def test_verify_on_s3_names_each_flipped_byte(s3: Any, run: _Run, capsys: pytest.CaptureFixture[str]) -> None:
    url, local = run.url, run.local
    for rel in FLIPS:
        run.flip(f"step-2/{rel}")
    for target in (url, f"{url}/step-2"):
        code, _, err = _cli(capsys, "verify", target)
        assert code == 1, err
        assert f"FAILED: {target}: damaged or missing data:" in err
        shown = _same(err, url, local)
        assert shown.count("expected xxh3-64") == len(FLIPS), err
        for named in FLIPS.values():
            assert named in shown
    code2, _, err2 = _cli(capsys, "verify", str(local / "step-2"))
    assert code2 == 1 and _same(err, url, local) == _same(err2, url, local)
    code, _, _ = _cli(capsys, "verify", f"{url}/step-1")
    assert code == 0  # the other step is intact


def test_a_step_without_commit_on_s3_is_not_listed_and_refused(
    s3: Any, run: _Run, capsys: pytest.CaptureFixture[str]
) -> None:
    url, local = run.url, run.local
    run.delete("step-2/COMMIT")
    code, out, _ = _cli(capsys, "inspect", url, "--json")
    code2, out2, _ = _cli(capsys, "inspect", str(local), "--json")
    assert code == code2 == 0
    info = json.loads(out)
    assert [r["step"] for r in info["steps"]] == [1] and info["latest"] == 1
    assert info["uncommitted"] == ["step-2"] == json.loads(out2)["uncommitted"]
    for cmd in ("inspect", "verify"):
        code, _, err = _cli(capsys, cmd, f"{url}/step-2")
        code2, _, err2 = _cli(capsys, cmd, str(local / "step-2"))
        assert code == code2 == 2
        assert f"{url}/step-2 holds no committed checkpoint: it is a CheckpointManager step directory" in err
        assert _same(err, url, local) == _same(err2, url, local)
    code, out, _ = _cli(capsys, "verify", url, "--all")
    assert code == 0 and "step 2" not in out
    run.delete("step-1/COMMIT")
    code, _, err = _cli(capsys, "verify", url)
    assert code == 2 and f"{url} holds no committed checkpoint" in err


def test_verify_on_s3_names_a_missing_train_state_object(
    s3: Any, run: _Run, capsys: pytest.CaptureFixture[str]
) -> None:
    url, local = run.url, run.local
    run.delete("step-2/train_state/rank-00000.json")
    code, _, err = _cli(capsys, "verify", url)
    code2, _, err2 = _cli(capsys, "verify", str(local))
    assert code == code2 == 1
    assert _same(err, url, local) == _same(err2, url, local)
    assert (
        f"  step 2 train_state: {url}/step-2/train_state/rank-00000.json: cannot be read (No such file" in err
    )


@pytest.mark.slow  # a fresh interpreter: about 4 s
def test_run_commands_on_s3_never_import_torch(s3: Any, run: _Run) -> None:
    code = f"""
import sys, contextlib, io
import unickpt.cli.main as m
with contextlib.redirect_stdout(io.StringIO()):
    assert m.main(["inspect", {run.url!r}]) == 0
    assert m.main(["inspect", "--json", {run.url + "/step-2"!r}]) == 0
    assert m.main(["verify", "--all", {run.url!r}]) == 0
bad = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
assert not bad, bad
print("CLEAN")
"""
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root))  # the s3 fixture's AWS_ENDPOINT_URL and keys
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("CLEAN")
