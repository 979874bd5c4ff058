"""Two nodes without a shared directory: save under FSDP2 on 4 ranks to S3, load under TP x2.

Two torchrun launchers per phase (``--nnodes 2 --node_rank 0/1 --master_addr 127.0.0.1``),
each with its own working directory and TMPDIR; the only thing they share is the S3 API
(moto's server, the ``s3`` fixture) reached through the standard AWS_* environment. The
loading world is smaller and differently parallelised (TP x2, one rank per node), so every
rank reads only the slices it needs, across files written by the other node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, free_port

pytestmark = pytest.mark.timeout(600)


def _launch(tmp: Path, phase: str, url: str, per_node: int, env: dict[str, str]) -> None:
    port = free_port()
    procs = []
    for node in range(2):
        home = tmp / f"node{node}"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        penv = {
            **os.environ,
            **env,
            "TMPDIR": str(home / "tmp"),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'dist'}",
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", str(per_node),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(REPO / "tests" / "dist" / "harness.py"), f"_two_nodes_worker:{phase}", url,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, cwd=home, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for node, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"{phase} on node {node} exited {p.returncode}:\n{out[-6000:]}"


def test_fsdp2_x4_saved_on_two_nodes_loads_as_tp_x2(s3, tmp_path: Path) -> None:
    url = f"s3://{s3.bucket}/two-nodes"
    _launch(tmp_path / "save", "save_phase", url, 2, s3.env())
    s3.reset()
    _launch(tmp_path / "load", "load_phase", url, 1, s3.env())
