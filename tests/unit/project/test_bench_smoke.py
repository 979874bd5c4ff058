"""Smoke test of the benchmark harness: every group of ``make bench`` runs end to end, at a tiny
size, and writes the rows it promises.

Not a benchmark: nothing here looks at how fast anything was, only that every case still runs
against the library as it is (a case that calls an API the library no longer has is an error
row, and fails here) and that every target finds the rows it compares.
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
@pytest.mark.timeout(900)
def test_quick_run_writes_expected_rows(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "run.py"),
        "--quick",  # every group but scaling
        "--size-mb",
        "8",
        "--storage-mb",
        "4",
        "--reps",
        "1",
        "--merge-reps",
        "1",
        "--world",  # worlds of 2 and 1: every case runs, at a third less CPU than the default 4 and 2
        "2",
        "--load-world",
        "1",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    cp = subprocess.run(
        cmd, capture_output=True, text=True, timeout=840, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["key"]: r for r in report["rows"]}
    groups = {r["group"] for r in report["rows"]}
    assert {
        "raw",
        "safetensors",
        "torch",
        "dcp",
        "unickpt",
        "hash",
        "async",
        "dist",
        "merge",
        "storage",
    } <= groups
    # Colossal-AI is the one optional peer (its tests skip without it too).
    failed = {
        k: r.get("reason")
        for k, r in rows.items()
        if r["status"] != "ok" and not (r["group"] == "colossalai" and r["status"] == "skipped")
    }
    assert not failed, failed
    unmeasured = [t["target"] for t in report["targets"] if t.get("status") == "not measured"]
    assert not unmeasured, unmeasured
    assert {"staged_ddp", "staged_fsdp2", "async_gil", "w2_manager_save_hf", "s3_unickpt_load"} <= set(rows)
    for key in ("raw_save", "raw_load", "st_save", "st_load"):
        row = rows[key]
        assert len(row["times"]) == 1
        assert row["bytes"] == report["state"]["bytes"] > 7 * 2**20 * 0.9
        assert row["gib_s"] > 0
        # The peak is reset just after the base is read; RSS may shrink by a page or two between.
        assert row["rss_peak_mb"] >= row["rss_base_mb"] - 1 > 0
    # The markdown table on stdout names every case, and the scratch dir is cleaned up.
    assert "| raw | raw write + fsync (disk limit) |" in cp.stdout
    assert not (tmp_path / "work").exists()
    assert report["machine"]["cores"] >= 1
    assert {t["target"] for t in report["targets"]}  # targets listed, measured or not
