"""Smoke test of the benchmark harness: it runs end to end and writes the rows it promises.

Not a benchmark: nothing here looks at how fast anything was, only that the script works.
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
@pytest.mark.timeout(420)
def test_quick_run_writes_expected_rows(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "run.py"),
        "--quick",
        "--size-mb",
        "16",
        "--reps",
        "1",
        "--only",
        "raw,safetensors",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    cp = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["key"]: r for r in report["rows"]}
    assert set(rows) == {"raw_save", "raw_load", "st_save", "st_load"}
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row.get("reason"))
        assert len(row["times"]) == 1
        assert row["bytes"] == report["state"]["bytes"] > 15 * 2**20 * 0.9
        assert row["gib_s"] > 0
        # The peak is reset just after the base is read; RSS may shrink by a page or two between.
        assert row["rss_peak_mb"] >= row["rss_base_mb"] - 1 > 0
    # The markdown table on stdout names every case, and the scratch dir is cleaned up.
    assert "| raw | raw write + fsync (disk limit) |" in cp.stdout
    assert not (tmp_path / "work").exists()
    assert report["machine"]["cores"] >= 1
    assert {t["target"] for t in report["targets"]}  # targets listed, measured or not
