"""One rank of a distributed benchmark world (FSDP2 over gloo on CPU).

Started by run.py once per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set:

    python benchmarks/dist_worker.py TASK PARAMS_JSON

TASK "save": build the synthetic state sharded with FSDP2 over all ranks, then time DCP save,
DCP's HuggingFaceStorageWriter (the input torch's consolidate_safetensors_files needs), unickpt
sharded save (gather_dtensor=False), unickpt gathered save and torch's full-state gather +
safetensors write on rank 0; the last two also report the writing rank's peak RSS.
TASK "cols": every matrix column-sharded (TP's Shard(1)) over all ranks: gathered save with the
column slices moved to row slices vs written row by row, and the sliced save (hf_columns.py).
TASK "staged": an async save's copy (``io.stage.stage_written``) under DDP (every rank holds the
whole model) and FSDP2: bytes staged per rank against the bytes that rank writes (its files' data,
counted on disk) and the bytes it holds; times staging against copying every held slice.
TASK "load": build the same model sharded over this (smaller) world and time loading the
checkpoints the save world wrote (resharding), DCP vs unickpt, checking they agree.

Times are wall clock on rank 0 between barriers; every rank writes its figures to
PARAMS["result_dir"]/rank<r>.json. With UNICKPT_BENCH_PROFILE=DIR in the environment, every rank
runs each timed case under cProfile and writes DIR/<case>-rank<r>.prof (read them with pstats).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C


def _setup(p: dict[str, Any]) -> tuple[Any, Any, int, int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    specs = C.state_spec(float(p["size_mb"]))
    model = C.build_model(specs, device="meta")
    for child in [model.embed, *model.layers]:
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model, mesh, rank, world


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _timed_case(
    rank: int,
    reps: int,
    body: Callable[[], Any],
    before: Callable[[], Any] | None = None,
    name: str = "",
) -> dict[str, Any]:
    """Each rep: before() on all ranks, barrier, body(), barrier. Peak RSS over all reps.

    One warm-up rep first (reported as first_s), as in the single-process cases.
    """
    prof_dir = os.environ.get("UNICKPT_BENCH_PROFILE")
    if prof_dir and name:
        import cProfile

        prof = cProfile.Profile()
        inner = body

        def body() -> Any:
            return prof.runcall(inner)

    times = []
    base = C.rss_mb()
    C.reset_peak_rss()
    for _ in range(reps + 1):
        if before is not None:
            before()
        _barrier()
        t0 = time.perf_counter()
        body()
        _barrier()
        times.append(time.perf_counter() - t0)
    if prof_dir and name:
        os.makedirs(prof_dir, exist_ok=True)
        prof.dump_stats(os.path.join(prof_dir, f"{name}-rank{rank}.prof"))
    return {
        "status": "ok",
        "times": times[1:],
        "first_s": times[:1],
        "rss_base_mb": round(base, 1),
        "rss_peak_mb": round(C.peak_rss_mb(), 1),
    }


def _rank0_rm(rank: int, path: Path) -> Callable[[], None]:
    def f() -> None:
        if rank == 0:
            C.rm(path)

    return f


def _rank0_drop(rank: int, path: Path) -> Callable[[], None]:
    def f() -> None:
        if rank == 0:
            C.drop_cache_tree(path)

    return f


def _fsync_rank0(rank: int, path: Path) -> None:
    # Saves are compared at the same durability: after the tool returns (and a barrier), rank 0
    # fsyncs the whole output (cheap where the tool already did).
    _barrier()
    if rank == 0:
        C.fsync_tree(path)


def task_save(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    model, mesh, rank, _world = _setup(p)
    C.fill_model(model, "random", seed=1000 + rank)
    sd = model.state_dict()
    work = Path(p["workdir"])
    reps = int(p["reps"])
    res: dict[str, Any] = {}
    want = set(
        p.get("cases")
        or [
            "dcp_save",
            "dcp_hf_save",
            "dcp_hf_consolidated_save",
            "unickpt_save",
            "unickpt_gathered_save",
            "unickpt_gathered_save_nohash",
            "manager_save",
            "manager_save_hf",
            "torch_gathered_save",
        ]
    )

    # 1. DCP, default FileSystemWriter (.distcp files + pickled .metadata)
    d = work / "dcp"

    def dcp_body() -> None:
        dcp.save(sd, checkpoint_id=str(d))
        _fsync_rank0(rank, d)

    if "dcp_save" in want:
        res["dcp_save"] = _timed_case(rank, reps, dcp_body, _rank0_rm(rank, d), name="dcp_save")

    # 2. DCP HuggingFaceStorageWriter, one safetensors file per rank with DCP sharding metadata
    hf = work / "dcp_hf"
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        def hf_body() -> None:
            dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path=str(hf), save_distributed=True))
            _fsync_rank0(rank, hf)

        if "dcp_hf_save" in want:
            res["dcp_hf_save"] = _timed_case(rank, reps, hf_body, _rank0_rm(rank, hf), name="dcp_hf_save")

        # 2b. the same with consolidation into Hugging Face files (what a user loading them in
        # transformers needs; rank 0 consolidates after every rank wrote its shard file)
        hfc = work / "dcp_hf_consolidated"

        def hfc_body() -> None:
            w = HuggingFaceStorageWriter(path=str(hfc), save_distributed=True, enable_consolidation=True)
            dcp.save(sd, storage_writer=w)
            _fsync_rank0(rank, hfc)

        if "dcp_hf_consolidated_save" in want:
            res["dcp_hf_consolidated_save"] = _guard(
                lambda: _timed_case(
                    rank, reps, hfc_body, _rank0_rm(rank, hfc), name="dcp_hf_consolidated_save"
                )
            )
    except ImportError as e:
        res["dcp_hf_save"] = {"status": "skipped", "reason": f"not available in this torch: {e}"}

    # 3. unickpt sharded save, every rank writes its own slices
    io_cls, why = C.probe_fsdp2_io()
    u = work / "unickpt"
    ug = work / "unickpt_gathered"
    if io_cls is None:
        res["unickpt_save"] = {"status": "skipped", "reason": f"not available: {why}"}
        res["unickpt_gathered_save"] = {"status": "skipped", "reason": f"not available: {why}"}
    else:
        io = io_cls(mesh=mesh)
        if p.get("unickpt_hashes") is False:  # PARAMS {"unickpt_hashes": false}: neither hash
            io.hashes = io.fingerprints = False

        def u_body() -> None:
            io.save_model(model, str(u), shard=True, gather_dtensor=False, size_per_shard=int(p["shard_mb"]))
            _fsync_rank0(rank, u)

        if "unickpt_save" in want:
            res["unickpt_save"] = _guard(
                lambda: _timed_case(rank, reps, u_body, _rank0_rm(rank, u), name="unickpt_save")
            )

        def ug_body() -> None:
            io.save_model(model, str(ug), shard=True, gather_dtensor=True, size_per_shard=int(p["shard_mb"]))
            _fsync_rank0(rank, ug)

        if "unickpt_gathered_save" in want:
            res["unickpt_gathered_save"] = _guard(
                lambda: _timed_case(rank, reps, ug_body, _rank0_rm(rank, ug), name="unickpt_gathered_save")
            )

        # 3a. the same gathered save without hashes or fingerprints (DCP computes neither)
        if "unickpt_gathered_save_nohash" in want:
            plain = io_cls(mesh=mesh)
            plain.hashes = plain.fingerprints = False
            ugn = work / "unickpt_gathered_nohash"

            def ugn_body() -> None:
                plain.save_model(
                    model, str(ugn), shard=True, gather_dtensor=True, size_per_shard=int(p["shard_mb"])
                )
                _fsync_rank0(rank, ugn)

            res["unickpt_gathered_save_nohash"] = _guard(
                lambda: _timed_case(
                    rank, reps, ugn_body, _rank0_rm(rank, ugn), name="unickpt_gathered_save_nohash"
                )
            )
            if rank == 0:
                C.rm(ugn)

        # 3b. the CheckpointManager (model only, sync), without and with its Hugging Face copy
        for case, save_hf in (("manager_save", False), ("manager_save_hf", True)):
            if case not in want:
                continue
            from types import SimpleNamespace

            from unickpt import CheckpointManager

            mroot = work / case
            mgr = CheckpointManager(
                str(mroot),
                booster=SimpleNamespace(checkpoint_io=io),
                save_steps=1,
                keep_last=1,
                save_hf=save_hf,
            )
            step = [0]

            def m_body(mgr: Any = mgr, mroot: Path = mroot, step: list[int] = step) -> None:
                step[0] += 1
                mgr.save(step[0], model, None, force=True)
                _fsync_rank0(rank, mroot)

            res[case] = _guard(lambda m_body=m_body, case=case: _timed_case(rank, reps, m_body, name=case))
            if rank == 0:
                C.rm(mroot)

    # 4. torch's own gathered path: full state dict to CPU on rank 0, then safetensors save_file
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    tg = work / "torch_gathered"

    def tg_body() -> None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            tg.mkdir(parents=True, exist_ok=True)
            save_file(full, str(tg / "model.safetensors"), metadata={"format": "pt"})
        del full
        _fsync_rank0(rank, tg)

    if "torch_gathered_save" in want:
        res["torch_gathered_save"] = _timed_case(
            rank, 1, tg_body, _rank0_rm(rank, tg), name="torch_gathered_save"
        )

    if rank == 0:
        res["layout"] = {
            "dcp": _layout(d, "*.metadata"),
            "dcp_hf": _layout(hf, "*.json"),
            "unickpt": _layout(u, "*.json"),
        }
        C.rm(ug)
        C.rm(tg)
        C.rm(hfc)
    del torch
    return res


def _layout(path: Path, meta_glob: str) -> dict[str, Any]:
    """File count, bytes, metadata bytes and (unickpt index) tensor and slice counts."""
    if not path.exists():
        return {}
    files = list(C.iter_files(path))
    metas = [f for f in files if f.match(meta_glob)]
    out: dict[str, Any] = {
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "meta_files": [f.name for f in metas],
        "meta_bytes": sum(f.stat().st_size for f in metas),
    }
    for f in metas:
        if f.name.endswith(".index.json"):
            try:
                tensors = json.loads(f.read_text()).get("unickpt", {}).get("tensors", {})
                out["tensors"] = len(tensors)
                out["slices"] = sum(len(t.get("slices", [])) for t in tensors.values())
            except (ValueError, AttributeError):
                pass
            try:  # what every loading rank pays before reading a byte: parse + validate the index
                from unickpt.spec.index import load_index

                t0 = time.perf_counter()
                load_index(f)
                out["index_parse_s"] = time.perf_counter() - t0
            except Exception as e:
                out["index_parse_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _guard(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        return {"status": "error", "reason": f"{type(e).__name__}: {e}".splitlines()[0][:200]}


def task_load(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    model, mesh, rank, _world = _setup(p)
    C.fill_model(model, "zeros")
    sd = model.state_dict()
    work = Path(p["workdir"])
    reps = int(p["reps"])
    res: dict[str, Any] = {}

    d = work / "dcp"
    if d.exists():
        res["dcp_load"] = _timed_case(
            rank, reps, lambda: dcp.load(sd, checkpoint_id=str(d)), _rank0_drop(rank, d)
        )
        ref = {k: v.to_local().clone() for k, v in sd.items()}
    else:
        res["dcp_load"] = {"status": "skipped", "reason": "DCP save did not run"}
        ref = None

    io_cls, why = C.probe_fsdp2_io()
    u = work / "unickpt"
    if io_cls is None:
        res["unickpt_load"] = {"status": "skipped", "reason": f"not available: {why}"}
    elif not u.exists():
        res["unickpt_load"] = {
            "status": "skipped",
            "reason": "unickpt sharded save did not produce a checkpoint",
        }
    else:
        io = io_cls(mesh=mesh)

        def before() -> None:
            C.fill_model(model, "zeros")
            _rank0_drop(rank, u)()

        r = _guard(lambda: _timed_case(rank, reps, lambda: io.load_model(model, str(u)), before))
        if ref is not None and r.get("status") == "ok":
            now = model.state_dict()
            r["extra"] = {"matches_dcp_load": all(torch.equal(now[k].to_local(), ref[k]) for k in ref)}
        res["unickpt_load"] = r
    return res


def task_cols(p: dict[str, Any]) -> dict[str, Any]:
    """TP-style column slices: every matrix ``Shard(1)`` over all ranks (vectors ``Shard(0)``).

    Times unickpt's gathered save with the column slices moved to row slices before they are
    written (``io/hf_rows.py``) against writing them row by row (``ROW_MOVES = False``), and
    the sliced save of the same tensors; every rank reports its peak RSS.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from unickpt.io import hf_rows

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = C.build_model(C.state_spec(float(p["size_mb"])), seed=1000)
    with torch.no_grad():
        for mod in model.modules():
            for n, prm in list(mod.named_parameters(recurse=False)):
                placement = Shard(1) if prm.dim() == 2 else Shard(0)
                mod.register_parameter(n, nn.Parameter(distribute_tensor(prm.data, mesh, [placement])))
    io_cls, why = C.probe_fsdp2_io()
    if io_cls is None:
        return {"status": "skipped", "reason": why}
    io = io_cls(mesh=mesh)
    work = Path(p["workdir"])
    reps = int(p["reps"])
    res: dict[str, Any] = {}
    for case, gather, moves in (
        ("cols_sliced_save", False, True),
        ("cols_gathered_row_moves", True, True),
        ("cols_gathered_per_row", True, False),
    ):
        d = work / case

        def body(d: Path = d, gather: bool = gather) -> None:
            io.save_model(model, str(d), shard=True, gather_dtensor=gather, size_per_shard=int(p["shard_mb"]))
            _fsync_rank0(rank, d)

        hf_rows.ROW_MOVES = moves
        res[case] = _guard(
            lambda body=body, d=d, case=case: _timed_case(rank, reps, body, _rank0_rm(rank, d), name=case)
        )
        hf_rows.ROW_MOVES = True
        if rank == 0:
            C.rm(d)
    return res


def _data_bytes(path: Path) -> int:
    """Tensor data bytes of a safetensors file (its size less the length word and the header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - n


def task_staged(p: dict[str, Any]) -> dict[str, Any]:
    """Bytes an async save stages per rank vs the bytes the rank writes, DDP and FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unickpt.io.pinned import stage_copy
    from unickpt.io.stage import stage_written
    from unickpt.plugins.ddp import DDPCheckpointIO

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = C.state_spec(float(p["size_mb"]))
    work = Path(p["workdir"])
    res: dict[str, Any] = {}
    for layout in ("ddp", "fsdp2"):
        model = C.build_model(specs, seed=7)
        if layout == "ddp":
            io: Any = DDPCheckpointIO()
        else:
            mesh = init_device_mesh("cpu", (world,))
            for child in [model.embed, *model.layers]:
                fully_shard(child, mesh=mesh)
            fully_shard(model, mesh=mesh)
            io_cls, why = C.probe_fsdp2_io()
            if io_cls is None:
                res[layout] = {"status": "skipped", "reason": why}
                continue
            io = io_cls(mesh=mesh)
        payload = io.plan_model(model)
        held = sum(sl.nbytes for sls in payload.slices.values() for sl in sls)
        stage_s, full_s = [], []
        staging: dict[Any, Any] = {}
        full_staging: dict[Any, Any] = {}
        for _ in range(1 + int(p["reps"])):
            _barrier()
            t0 = time.perf_counter()
            staged = stage_written(payload, staging)
            stage_s.append(time.perf_counter() - t0)
            _barrier()
            t0 = time.perf_counter()
            for name, sls in payload.slices.items():  # every held slice, replicas included
                for k, sl in enumerate(sls):
                    stage_copy(sl.tensor, full_staging, (name, k))
            full_s.append(time.perf_counter() - t0)
        del full_staging
        d = work / f"staged-{layout}"
        io.write(staged, str(d), shard=True, gather_dtensor=False, size_per_shard=float("inf"))
        counts: list[Any] = [None] * world
        assert staged.staged is not None
        dist.all_gather_object(counts, staged.staged.nbytes)
        writers = [r for r in range(world) if counts[r] > 0]
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        written = (
            _data_bytes(d / files[writers.index(rank)])
            if rank in writers and len(files) == len(writers)
            else -1
        )
        res[layout] = {
            "status": "ok",
            "times": stage_s[1:],
            "full_copy_s": full_s[1:],
            "bytes": staged.staged.nbytes,
            "extra": {"held": held, "staged": staged.staged.nbytes, "written": written},
        }
        _barrier()
        if rank == 0:
            C.rm(d)
    return res


def main() -> None:
    warnings.simplefilter("ignore")
    task, params = sys.argv[1], json.loads(sys.argv[2])
    import torch.distributed as dist

    try:
        res = {"save": task_save, "load": task_load, "cols": task_cols, "staged": task_staged}[task](params)
    except Exception as e:
        traceback.print_exc()
        res = {"fatal": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    rank = int(os.environ["RANK"])
    out = Path(params["result_dir"]) / f"rank{rank}.json"
    out.write_text(json.dumps(res))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
