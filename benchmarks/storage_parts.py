"""Gathered (Hugging Face) saves to ``s3://`` from 4 FSDP2 ranks: the rank-0 funnel beside shared
multipart uploads (every rank uploads its parts, io/parts_save.py), through one S3 server.

    python benchmarks/storage_parts.py                  # 4 ranks, 128 MiB, 3 reps each
    python benchmarks/storage_parts.py --size-mb 64 --reps 2

The server is moto's S3 server (tests/s3server.py) on a local port, started here; it counts the
request bytes each client uploads, so the table shows who uploaded what. Both cases save the
same FSDP2-sharded model (benchmarks/_common.py's synthetic state) with
``save_model(shard=True, gather_dtensor=True)`` into a fresh prefix per repetition, alternating
which goes first; the funnel is the path of stores without shared uploads (forced here on S3).
Times are wall clock on rank 0 between barriers; the server shares the 2 cores with the ranks,
so compare the ratio within one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import _common as C  # noqa: E402
from s3server import client_options  # noqa: E402
from storage_save import _free_port  # noqa: E402

CASES = ("funnel", "parts")


def _worker(p: dict[str, Any]) -> None:
    """One rank: FSDP2 model over the world, then each case ``reps`` times into fresh prefixes."""
    import torch.distributed as dist
    from dist_worker import _setup

    from unickpt.io import save as save_mod
    from unickpt.plugins.fsdp2 import FSDP2CheckpointIO

    model, mesh, rank, _world = _setup(p)
    C.fill_model(model, "random", seed=0)
    shared = save_mod.supports_shared_parts

    def save(case: str, url: str) -> None:
        opts = client_options(p["endpoint"], f"{case}-r{rank}")
        save_mod.supports_shared_parts = shared if case == "parts" else (lambda store: False)  # type: ignore[assignment]
        FSDP2CheckpointIO(mesh=mesh, storage_options=opts).save_model(
            model, url, shard=True, gather_dtensor=True
        )

    times: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(int(p["reps"])):
        for case in CASES if r % 2 == 0 else CASES[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            save(case, f"s3://{p['bucket']}/{case}-{r}")
            dist.barrier()
            times[case].append(time.perf_counter() - t0)
    Path(p["result_dir"], f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=128)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        _worker(json.loads(a.worker))
        return
    from s3server import S3Server

    server = S3Server()
    try:
        bucket = server.new_bucket()
        nbytes = C.spec_bytes(C.state_spec(a.size_mb))
        with tempfile.TemporaryDirectory(prefix="unickpt-bench-parts-") as d:
            params = {"size_mb": a.size_mb, "reps": a.reps, "endpoint": server.endpoint, "bucket": bucket}
            params["result_dir"] = d
            port = _free_port()
            procs = []
            for rank in range(a.world):
                env = dict(os.environ, **server.env(), RANK=str(rank), WORLD_SIZE=str(a.world))
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
                cmd = [sys.executable, __file__, "--worker", json.dumps(params)]
                procs.append(subprocess.Popen(cmd, env=env))
            for pr in procs:
                if pr.wait(timeout=3600) != 0:
                    raise SystemExit(f"a rank failed (exit {pr.returncode})")
            times = json.loads(Path(d, "rank0.json").read_text())
    finally:
        per_rank = {
            c: [
                sum(server.received(m, f"{c}-r{r}") for m in ("PUT", "POST")) / a.reps / 2**20
                for r in range(a.world)
            ]
            for c in CASES
        }
        server.stop()
    rows = {
        c: {
            "seconds": times[c],
            "best_s": min(times[c]),
            "GiB/s": C.gib_s(nbytes, min(times[c])),
            "MiB_per_rank": per_rank[c],
        }
        for c in CASES
    }
    ratio = rows["funnel"]["best_s"] / rows["parts"]["best_s"]
    print(
        f"\n{a.world}-rank FSDP2 gathered save of {nbytes / 2**20:.0f} MiB to s3:// (moto server), best of {a.reps}:\n"
    )
    print("| path | best s | GiB/s | uploaded per save, MiB per rank |")
    print("| --- | --- | --- | --- |")
    for c, r in rows.items():
        shares = " / ".join(f"{x:.1f}" for x in r["MiB_per_rank"])
        print(f"| {c} | {r['best_s']:.2f} | {r['GiB/s']:.3f} | {shares} |")
    print(f"\nfunnel time / shared parts time: {ratio:.2f}x")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"nbytes": nbytes, "world": a.world, "rows": rows, "ratio": ratio})
        )


if __name__ == "__main__":
    main()
