"""The prepared GPU check (benchmarks/gpu_check.py), run on CPU so that it cannot rot.

The same phases as on a GPU, with gloo and a model of a few MB: every phase must succeed, and the
loaded and the asynchronously saved states must be bit-exact. Nothing here looks at speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    cp = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--dry-run",
            "--steps",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(env, OMP_NUM_THREADS="1"),
        cwd=tmp_path,
    )
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    rows = {r["phase"]: r for r in report["rows"]}
    assert set(rows) == {"save", "load", "async", "pool"}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["load"]["bitwise_equal"] is True
    assert rows["load"]["dcp_bitwise_equal"] is True
    assert rows["async"]["unickpt"]["bitwise_equal"] is True
    for phase in ("save", "load"):
        assert rows[phase]["unickpt_gb_s"] > 0 and rows[phase]["dcp_gb_s"] > 0
    for who in ("unickpt", "dcp"):
        a = rows["async"][who]
        assert 0 < a["blocked_s"] <= a["committed_s"]
        assert a["step_ratio"] > 0 and a["first_step_s"] > 0
    # The pool holds exactly the state (one rank writes everything), reused, then released.
    pool = rows["pool"]
    assert pool["model_set_bytes"] == pool["state_bytes"] == report["state_bytes"]
    assert pool["held_ratio"] == 1.0
    assert pool["allocations_second_save"] == 0
    assert pool["released_bytes"] == pool["held_bytes"] > 0
    assert pool["held_after_release"] == 0
