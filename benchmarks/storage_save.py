"""Storage save group (issue 17): a 4-rank FSDP2 save to ``s3://`` through one S3 server,
unickpt's sliced save side by side with DCP's ``FsspecWriter`` in the same run.

    python benchmarks/storage_save.py                  # 4 ranks, 128 MiB, 3 reps each
    python benchmarks/storage_save.py --size-mb 32 --reps 1 --world 2

The server is moto's S3 server (tests/s3server.py) on a local port, started here; it counts the
request bytes each client uploads, so the table also shows that every byte is uploaded once.
Both writers save the same FSDP2-sharded model (benchmarks/_common.py's synthetic state) into a
fresh prefix per repetition, alternating which goes first. unickpt hashes (xxh3) and
fingerprints every slice as it uploads (the defaults); DCP writes no hashes. Times are wall
clock on rank 0 between barriers; the server shares the 2 cores with the ranks, so compare the
ratio within one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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

CASES = ("unickpt", "dcp")


def _worker(p: dict[str, Any]) -> None:
    """One rank: FSDP2 model over the world, then each case ``reps`` times into fresh prefixes."""
    import torch.distributed as dist
    from dist_worker import _setup

    model, mesh, rank, _world = _setup(p)
    C.fill_model(model, "random", seed=0)

    def opts(case: str) -> dict[str, Any]:
        return client_options(p["endpoint"], f"{case}-r{rank}")

    def save_unickpt(url: str) -> None:
        from unickpt.plugins.fsdp2 import FSDP2CheckpointIO

        io = FSDP2CheckpointIO(mesh=mesh, storage_options=opts("unickpt"))
        io.save_model(model, url, shard=True, gather_dtensor=False)

    def save_dcp(url: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save({"model": model.state_dict()}, storage_writer=FsspecWriter(url, **opts("dcp")))

    fns = {"unickpt": save_unickpt, "dcp": save_dcp}
    times: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(int(p["reps"])):
        order = CASES if r % 2 == 0 else CASES[::-1]
        for case in order:
            url = f"s3://{p['bucket']}/{case}-{r}"
            dist.barrier()
            t0 = time.perf_counter()
            fns[case](url)
            dist.barrier()
            times[case].append(time.perf_counter() - t0)
    Path(p["result_dir"], f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        with tempfile.TemporaryDirectory(prefix="unickpt-bench-s3-") as d:
            params = {
                "size_mb": a.size_mb,
                "reps": a.reps,
                "endpoint": server.endpoint,
                "bucket": bucket,
                "result_dir": d,
            }
            port = _free_port()
            procs = []
            for rank in range(a.world):
                env = dict(
                    os.environ,
                    **server.env(),
                    RANK=str(rank),
                    WORLD_SIZE=str(a.world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                )
                cmd = [sys.executable, __file__, "--worker", json.dumps(params)]
                procs.append(subprocess.Popen(cmd, env=env))
            for pr in procs:
                if pr.wait(timeout=3600) != 0:
                    raise SystemExit(f"a rank failed (exit {pr.returncode})")
            times = json.loads(Path(d, "rank0.json").read_text())
    finally:
        uploaded = {
            c: sum(server.received(m, f"{c}-r{r}") for m in ("PUT", "POST") for r in range(a.world))
            for c in CASES
        }
        server.stop()
    rows = {}
    for c in CASES:
        best = min(times[c])
        rows[c] = {
            "seconds": times[c],
            "best_s": best,
            "GiB/s": C.gib_s(nbytes, best),
            "uploaded_per_save_MiB": uploaded[c] / a.reps / 2**20,
        }
    ratio = rows["unickpt"]["GiB/s"] / rows["dcp"]["GiB/s"]
    print(
        f"\n{a.world}-rank FSDP2 save of {nbytes / 2**20:.0f} MiB to s3:// (moto server), best of {a.reps}:\n"
    )
    print("| writer | best s | GiB/s | uploaded per save (MiB) |")
    print("| --- | --- | --- | --- |")
    for c, r in rows.items():
        print(f"| {c} | {r['best_s']:.2f} | {r['GiB/s']:.3f} | {r['uploaded_per_save_MiB']:.1f} |")
    print(f"\nunickpt / DCP FsspecWriter: {ratio:.2f}x")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"nbytes": nbytes, "world": a.world, "rows": rows, "ratio": ratio})
        )


if __name__ == "__main__":
    main()
