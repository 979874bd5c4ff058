"""One rank of the storage benchmark (``--only storage``): checkpoints on an S3 API (moto's server).

    python benchmarks/storage_worker.py TASK PARAMS_JSON      (started by run.py, one per rank)

TASK "save" (the save world, FSDP2): each rep, DCP writes its checkpoint straight to ``s3://``
with ``FsspecWriter``, unickpt saves its sliced checkpoint straight to ``s3://`` (streamed, hashed,
committed by its index), and each rank puts its own bytes as one object with s3fs (the raw
ceiling of the server), alternating the order rep by rep (``save_dcp``, ``save_unickpt``,
``save_raw`` with ``dsave-<rank>``, ``usave-<rank>``, ``raw-<rank>`` in their requests).
TASK "load" (a smaller world, FSDP2, resharded): each rep loads DCP's checkpoint with
``FsspecReader`` and unickpt's with ``load_model("s3://...")``, each rank naming itself in its
requests (``dcp-<rank>``, ``unickpt-<rank>``) so the server counts the bytes each one fetched;
the two loads must give the same tensors.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _common as C
from dist_worker import _barrier, _setup
from s3server import client_options


def options(p: dict[str, Any], client: str) -> dict[str, Any]:
    """s3fs options for the benchmark's server, with the client's name in every request."""
    return client_options(p["endpoint"], client)


def task_save(p: dict[str, Any]) -> dict[str, Any]:
    """Each rep (one warm-up first): DCP's ``FsspecWriter``, unickpt's sliced ``save_model`` and the
    raw ceiling (each rank one s3fs ``pipe_file`` of its bytes) into fresh prefixes, alternating
    the order rep by rep; the last rep's DCP and unickpt checkpoints are what the load task reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    model, mesh, rank, _ = _setup(p)
    C.fill_model(model, "random", seed=1000 + rank)
    io_cls, why = C.probe_fsdp2_io()
    if io_cls is None:
        return {"fatal": f"unickpt FSDP2 IO not available: {why}"}
    url = f"s3://{p['bucket']}"
    reps = int(p["reps"])
    io = io_cls(mesh=mesh)
    io.storage_options = options(p, f"usave-{rank}")
    import s3fs

    raw_fs = s3fs.S3FileSystem(**options(p, f"raw-{rank}"), skip_instance_cache=True)
    import torch

    mine = b"".join(
        bytes(v.to_local().contiguous().view(-1).view(torch.uint8).numpy())
        for v in model.state_dict().values()
    )

    def dcp_body(prefix: str) -> None:
        dcp.save(model.state_dict(), storage_writer=FsspecWriter(prefix, **options(p, f"dsave-{rank}")))

    def u_body(prefix: str) -> None:
        io.save_model(model, prefix, shard=True, gather_dtensor=False, size_per_shard=int(p["shard_mb"]))

    def raw_body(prefix: str) -> None:
        raw_fs.pipe_file(f"{prefix.removeprefix('s3://')}/rank{rank}.bin", mine)

    bodies = {"dcp_save": dcp_body, "unickpt_save": u_body, "raw_save": raw_body}
    final = {"dcp_save": "dcp", "unickpt_save": "unickpt", "raw_save": "raw"}
    times: dict[str, list[float]] = {k: [] for k in bodies}
    for r in range(reps + 1):
        order = list(bodies) if r % 2 == 0 else list(bodies)[::-1]
        for key in order:
            prefix = f"{url}/{final[key]}" if r == reps else f"{url}/{final[key]}-{r}"
            _barrier()
            t0 = time.perf_counter()
            bodies[key](prefix)
            _barrier()
            times[key].append(time.perf_counter() - t0)
            if r < reps and rank == 0:  # keep the server's memory to one copy of each
                raw_fs.rm(prefix.removeprefix("s3://"), recursive=True)
            _barrier()
    res: dict[str, Any] = {
        key: {"status": "ok", "times": ts[1:], "first_s": ts[:1]} for key, ts in times.items()
    }
    res["unickpt_save"]["x_dcp_paired"] = [
        d / u for d, u in zip(times["dcp_save"][1:], times["unickpt_save"][1:], strict=True)
    ]
    res["unickpt_save"]["x_raw_paired"] = [
        w / u for w, u in zip(times["raw_save"][1:], times["unickpt_save"][1:], strict=True)
    ]
    res["dcp_save"]["x_raw_paired"] = [
        w / d for w, d in zip(times["raw_save"][1:], times["dcp_save"][1:], strict=True)
    ]
    return res


def task_load(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    model, mesh, rank, _ = _setup(p)
    io_cls, why = C.probe_fsdp2_io()
    if io_cls is None:
        return {"fatal": f"unickpt FSDP2 IO not available: {why}"}
    url = f"s3://{p['bucket']}"
    reps = int(p["reps"])
    io = io_cls(mesh=mesh)
    io.storage_options = options(p, f"unickpt-{rank}")

    def dcp_body() -> None:
        sd = model.state_dict()
        dcp.load(sd, storage_reader=FsspecReader(f"{url}/dcp", **options(p, f"dcp-{rank}")))

    def u_body() -> None:
        io.load_model(model, f"{url}/unickpt")

    # Alternate the two loads rep by rep (one warm-up rep first), so that drift on a shared
    # machine hits both alike; the ratio is taken per rep.
    times: dict[str, list[float]] = {"dcp_load": [], "unickpt_load": []}
    want: dict[str, Any] = {}
    base = round(C.rss_mb(), 1)
    C.reset_peak_rss()
    for _ in range(reps + 1):
        for key, body in (("dcp_load", dcp_body), ("unickpt_load", u_body)):
            _barrier()
            t0 = time.perf_counter()
            body()
            _barrier()
            times[key].append(time.perf_counter() - t0)
            if key == "dcp_load" and not want:
                want = {k: v.to_local().clone() for k, v in model.state_dict().items()}
                C.fill_model(model, "random", seed=7)  # the unickpt load must bring every value back
    got = {k: v.to_local() for k, v in model.state_dict().items()}
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    if bad:
        return {"fatal": f"unickpt and DCP loads disagree on {bad[:3]}"}
    peak = round(C.peak_rss_mb(), 1)
    res: dict[str, Any] = {
        key: {"status": "ok", "times": ts[1:], "first_s": ts[:1], "rss_base_mb": base, "rss_peak_mb": peak}
        for key, ts in times.items()
    }
    res["unickpt_load"]["x_dcp_paired"] = [
        d / u for d, u in zip(times["dcp_load"][1:], times["unickpt_load"][1:], strict=True)
    ]
    return res


def main() -> None:
    task, params = sys.argv[1], json.loads(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    try:
        res = {"save": task_save, "load": task_load}[task](params)
    except Exception:
        res = {"fatal": traceback.format_exc()[-2000:]}
    Path(params["result_dir"], f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
