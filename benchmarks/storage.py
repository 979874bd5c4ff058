"""The ``storage`` group of run.py: a resharded load from an S3 API, unickpt beside DCP's fsspec reader.

    python benchmarks/run.py --only storage                  # 64 MiB through moto's S3 server
    python benchmarks/run.py --only storage --storage-mb 256

One moto S3 server (``tests/s3server.py``, the one the tests use) runs in this process and
counts the body bytes it serves to and receives from each client. A world of ``--world`` ranks
(FSDP2) saves the same synthetic state with DCP (``FsspecWriter``) and with unickpt (sliced
``save_model("s3://...")``), both straight to the store, beside the raw ceiling (each rank one
s3fs ``pipe_file`` of its bytes), ``reps`` times each after a warm-up, alternating the order
(rows: median save time, the median paired DCP/unickpt and raw/writer ratios, bytes uploaded
and requests made per rank and save); a world of ``--load-world`` ranks then loads both, resharded,
``reps`` times each after a warm-up, alternating rep by rep (``storage_worker.py``). Rows: median
load time (rank 0, between barriers), the median of the per-rep DCP/unickpt time ratios, and per
rank the bytes and requests the server served (per load).

moto keeps objects in memory and answers from one Python process on the same cores as the
ranks, so absolute figures are far below a real store's; the comparison (same server, same
bytes, same run) and the byte counts are what carry over.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import _common as C

HERE = Path(__file__).resolve().parent


def run_group(rows: Any, root: Path, base: dict[str, Any], args: Any, run_world: Any) -> None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    try:
        from s3server import S3Server
    except ImportError as e:  # moto[server] / s3fs missing: report, do not fail the suite
        for key in ("dcp_load", "unickpt_load"):
            rows.add("storage", f"s3_{key}", f"S3 {key}", {"status": "skipped", "reason": str(e)})
        return
    server = S3Server()
    try:
        _run(rows, root, base, args, run_world, server)
    finally:
        server.stop()


def _run(rows: Any, root: Path, base: dict[str, Any], args: Any, run_world: Any, server: Any) -> None:
    size = float(args.storage_mb)
    nbytes = C.spec_bytes(C.state_spec(size))
    wd = root / "storage"
    wd.mkdir(exist_ok=True)
    p = dict(base, size_mb=size, workdir=str(wd), endpoint=server.endpoint, bucket=server.new_bucket())
    w, lw = args.world, args.load_world
    print(f"  [storage: world {w} saves {size:g} MiB to S3]", file=sys.stderr, flush=True)
    server.reset()
    out = run_world("save", w, p, args.timeout * 3, script="storage_worker.py")
    saves = {
        "raw_save": ("raw", "raw: each rank one s3fs pipe_file of its bytes"),
        "dcp_save": ("dsave", "DCP FsspecWriter save"),
        "unickpt_save": ("usave", "unickpt save_model(s3://...)"),
    }
    ranks0 = (out.get("ranks") or [{}])[0] or {}
    for key, (client, label) in saves.items():
        res = dict(ranks0.get(key) or {"status": "error", "reason": out.get("error", "no result")})
        if res.get("status") == "ok":
            saved = int(args.reps) + 1  # the warm-up rep uploaded too
            up = [sum(server.received(m, f"{client}-{r}") for m in ("PUT", "POST")) / saved for r in range(w)]
            # every request of the save per rank (rank 0's lock, listing, index and commit included)
            reqs = [
                sum(n for (_, c), n in server.requests.items() if c == f"{client}-{r}") / saved
                for r in range(w)
            ]
            extra: dict[str, Any] = {
                "uploaded_per_rank": [int(x) for x in up],
                "requests_per_rank": [round(x, 2) for x in reqs],
                "x_checkpoint": sum(up) / nbytes,
            }
            for k in ("x_dcp_paired", "x_raw_paired"):
                paired = res.pop(k, None)
                if paired:
                    extra[k] = C.median(paired)
            res["extra"] = extra
        rows.add("storage", f"s3_{key}", f"FSDP2 x{w} {size:g} MiB to S3: {label}", res, nbytes)
    labels = {"dcp_load": "DCP FsspecReader load", "unickpt_load": "unickpt load_model(s3://...)"}
    if "error" in out:
        for key, label in labels.items():
            rows.add("storage", f"s3_{key}", label, {"status": "error", "reason": out["error"]})
        return
    server.reset()
    print(f"  [storage: world {lw} loads resharded from {w}]", file=sys.stderr, flush=True)
    out = run_world("load", lw, p, args.timeout * 3, script="storage_worker.py")
    loads = int(args.reps) + 1  # the warm-up rep fetched too
    for key, label in labels.items():
        ranks = [r or {} for r in out.get("ranks") or []]
        res = dict(ranks[0].get(key) or {"status": "error", "reason": out.get("error", "no result")})
        if res.get("status") == "ok":
            client = key.split("_")[0]
            fetched = [server.served("GET", f"{client}-{r}") / loads for r in range(lw)]
            requests = [server.requests[("GET", f"{client}-{r}")] / loads for r in range(lw)]
            paired = res.pop("x_dcp_paired", None)
            res["extra"] = {
                **({"x_dcp_paired": C.median(paired)} if paired else {}),
                "fetched_per_rank": [int(x) for x in fetched],
                "requests_per_rank": [round(x, 1) for x in requests],
                "x_checkpoint": sum(fetched) / nbytes,
            }
        rows.add("storage", f"s3_{key}", f"FSDP2 {w}->{lw} {size:g} MiB from S3: {label}", res, nbytes)
