"""unickpt benchmark suite (issue 8): unickpt side by side with the tools users would pick
instead, and with the disk's own limit, in one run on the same synthetic tensors.

    python benchmarks/run.py                      # ~1 GiB of fp32+bf16, a few minutes on 2 cores
    python benchmarks/run.py --quick              # ~64 MiB, a few minutes (smoke test)
    python benchmarks/run.py --size-mb 256 --only raw,unickpt,dist
    make bench BENCH_ARGS="--quick"

Every case runs in a fresh subprocess (distributed cases: one process per rank), so its peak
RSS (VmHWM) is its own. Prints a markdown table and writes JSON to benchmarks/results/.
Cases whose unickpt API is not importable yet are reported as "not available: <reason>".
Timings on shared machines drift: compare the ratios within one run, not absolute figures
across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402

GROUPS = (
    "raw",
    "safetensors",
    "torch",
    "dcp",
    "colossalai",
    "unickpt",
    "hash",
    "async",
    "dist",
    "merge",
    "scaling",
    "storage",
)
DEFAULT_GROUPS = GROUPS  # every group runs unless --only/--skip says otherwise


# ------------------------------------------------------------------------------ running cases


def run_case(name: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one single-process case in a fresh interpreter and return its result dict."""
    cmd = [sys.executable, str(HERE / "run.py"), "--case", name, "--params", json.dumps(params)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timed out after {timeout:.0f}s"}
    for line in cp.stdout.splitlines():
        if line.startswith(C.RESULT_PREFIX):
            return json.loads(line[len(C.RESULT_PREFIX) :])
    tail = (cp.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": "error", "reason": f"exit {cp.returncode}: {tail[:200]}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(
    task: str, world: int, params: dict[str, Any], timeout: float, script: str = "dist_worker.py"
) -> dict[str, Any]:
    """Launch ``world`` ranks of ``script``; returns {"ranks": [per-rank dicts]} or an error."""
    result_dir = Path(tempfile.mkdtemp(prefix=f"bench-{task}-w{world}-", dir=params["workdir"]))
    params = dict(params, result_dir=str(result_dir))
    port = _free_port()
    procs = []
    logs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        log = open(result_dir / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), task, json.dumps(params)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    timed_out = False
    for pr in procs:
        try:
            pr.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    for log in logs:
        log.close()
    ranks = []
    for r in range(world):
        f = result_dir / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    if timed_out or any(x is None for x in ranks):
        tail = (result_dir / "rank0.log").read_text().strip().splitlines()[-1:] or ["no output"]
        why = f"timed out after {timeout:.0f}s" if timed_out else "a rank exited without results"
        return {"error": f"{why}: {tail[0][:200]}", "ranks": ranks}
    fatal = [x.get("fatal") for x in ranks if x and x.get("fatal")]
    if fatal:
        return {"error": fatal[0], "ranks": ranks}
    return {"ranks": ranks}


# ------------------------------------------------------------------------------ rows


def staged_rows(rows: Rows, base: dict[str, Any], root: Path, timeout: float, args: Any) -> None:
    """Async staging under DDP x4 and FSDP2 x4: bytes staged per rank vs bytes written per rank."""
    world = 4
    wd = root / f"staged-w{world}"
    wd.mkdir(exist_ok=True)
    sz = float(args.size_mb)
    print(f"  [world {world}, {sz:g} MiB: async staging]", file=sys.stderr, flush=True)
    out = run_world(
        "staged", world, dict(base, size_mb=sz, reps=max(2, int(args.reps)), workdir=str(wd)), timeout * 3
    )
    ranks = [r or {} for r in out.get("ranks") or [{}] * world]
    for layout, name in (("ddp", "DDP"), ("fsdp2", "FSDP2")):
        per = [r.get(layout) or {} for r in ranks]
        label = f"{name} x{world} {sz:g} MiB: async staging (stage_written)"
        if not all(x.get("status") == "ok" for x in per):
            bad = next((x for x in per if x.get("status") != "ok"), {})
            rows.add(
                "async",
                f"staged_{layout}",
                label,
                {"status": "error", "reason": bad.get("reason") or out.get("error", "no result")},
            )
            continue
        staged = [x["extra"]["staged"] for x in per]
        written = [x["extra"]["written"] for x in per]
        held = [x["extra"]["held"] for x in per]
        res = dict(per[0])
        res["extra"] = {
            "staged_per_rank": staged,
            "written_per_rank": written,
            "held_per_rank": held,
            "staged_over_written": max(
                s / w if w > 0 else (1.0 if s == 0 else float("inf"))
                for s, w in zip(staged, written, strict=True)
            ),
            "full_copy_s": C.median(per[0]["full_copy_s"]),
        }
        rows.add("async", f"staged_{layout}", label, res)


class Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(
        self, group: str, key: str, label: str, res: dict[str, Any], nbytes: int | None = None
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"group": group, "key": key, "label": label, **res}
        if row.get("status") == "ok":
            times = row.get("times") or []
            row["median_s"] = C.median(times)
            b = nbytes if nbytes is not None else row.get("bytes")
            if b:
                row["bytes"] = b
                row["gib_s"] = C.gib_s(b, row["median_s"])
        self.rows.append(row)
        print(f"  {label:<52} {_short(row)}", file=sys.stderr, flush=True)
        return row

    def get(self, key: str) -> dict[str, Any] | None:
        for r in self.rows:
            if r["key"] == key and r.get("status") == "ok":
                return r
        return None


def _short(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('reason', '')}"
    s = f"{row['median_s']:.3f} s"
    if "gib_s" in row:
        s += f"  {row['gib_s']:.2f} GiB/s"
    if "rss_peak_mb" in row:
        s += f"  peak {row['rss_peak_mb']:.0f} MB"
    return s


def _world_rows(
    rows: Rows,
    group: str,
    prefix: str,
    label_prefix: str,
    out: dict[str, Any],
    nbytes: int,
    cases: dict[str, str],
) -> None:
    """Rows from a distributed world: time from rank 0, RSS from rank 0 (the writing rank) and max."""
    if "error" in out and not any(out.get("ranks") or []):
        for key, label in cases.items():
            rows.add(
                group, f"{prefix}{key}", f"{label_prefix}{label}", {"status": "error", "reason": out["error"]}
            )
        return
    ranks = [r or {} for r in out["ranks"]]
    for key, label in cases.items():
        r0 = ranks[0].get(key) or {"status": "error", "reason": out.get("error", "no result")}
        res = dict(r0)
        if res.get("status") == "ok":
            res["rss_peak_max_mb"] = max((r.get(key) or {}).get("rss_peak_mb", 0) for r in ranks)
            res["rss_extra_max_mb"] = max(
                (r.get(key) or {}).get("rss_peak_mb", 0) - (r.get(key) or {}).get("rss_base_mb", 0)
                for r in ranks
            )
        rows.add(group, f"{prefix}{key}", f"{label_prefix}{label}", res, nbytes)


# ------------------------------------------------------------------------------ the suite


def suite(args: argparse.Namespace) -> dict[str, Any]:
    groups = set(args.only.split(",")) if args.only else set(DEFAULT_GROUPS)
    groups -= set(args.skip.split(",")) if args.skip else set()
    unknown = groups - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown group(s): {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}")
    size = float(args.size_mb)
    specs = C.state_spec(size)
    nbytes = C.spec_bytes(specs)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="unickpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    base = {"size_mb": size, "reps": args.reps, "shard_mb": args.shard_mb, "seed": 0}
    sp = dict(base, workdir=str(root / "sp"))
    Path(sp["workdir"]).mkdir(exist_ok=True)
    rows = Rows()
    t_start = time.perf_counter()
    print(
        f"state: {len(specs)} tensors, {nbytes / C.MiB:.0f} MiB (fp32+bf16), reps={args.reps}, workdir={root}",
        file=sys.stderr,
    )
    to = args.timeout

    def single(group: str, key: str, label: str, case: str, **extra: Any) -> None:
        if group in groups:
            rows.add(group, key, label, run_case(case, dict(sp, **extra), to))

    # 1. single process, same tensors
    single("raw", "raw_save", "raw write + fsync (disk limit)", "raw_save")
    single("raw", "raw_load", "raw read, page cache dropped (disk limit)", "raw_load")
    single("safetensors", "st_save", "safetensors.torch.save_file (+fsync)", "safetensors_save")
    single("safetensors", "st_load", "safetensors load_file + load_state_dict", "safetensors_load")
    single("torch", "torch_save", "torch.save (+fsync)", "torch_save")
    single("torch", "torch_load", "torch.load(weights_only=True) + load_state_dict", "torch_load")
    single("dcp", "dcp_save", "torch DCP save, 1 process", "dcp_save")
    single("dcp", "dcp_load", "torch DCP load, 1 process", "dcp_load")
    single(
        "colossalai",
        "cai_save",
        "Colossal-AI GeneralCheckpointIO save (sharded safetensors)",
        "colossalai_save",
    )
    single("colossalai", "cai_load", "Colossal-AI GeneralCheckpointIO load", "colossalai_load")
    single("unickpt", "u_save", "unickpt save_model(shard=True), hashes+fingerprints", "unickpt_save")
    single(
        "unickpt",
        "u_save_nofp",
        "unickpt save_model(shard=True), hashes, no fingerprints",
        "unickpt_save",
        fingerprints=False,
    )
    single(
        "unickpt",
        "u_save_nohash",
        "unickpt save_model(shard=True), no hashes, no fingerprints",
        "unickpt_save",
        hashes=False,
        fingerprints=False,
    )
    single("unickpt", "u_load", "unickpt load_model", "unickpt_load")
    single("unickpt", "u_load_verify", "unickpt load_model(verify=True)", "unickpt_load", verify=True)
    single("hash", "hash_xxh3", "xxh3-64 of stored bytes (in memory)", "hash_xxh3")
    single("hash", "hash_fp", "layout-invariant fingerprint (in memory)", "hash_fingerprint")
    # The kernel alone (fingerprint v2), per dtype and block layout.
    fp_mib = min(256, max(16, int(size // 4)))
    single(
        "hash",
        "fp_kernel_v0_2d_F32",
        f"memory read reference: numpy uint64 sum ({fp_mib} MiB in memory)",
        "hash_fp_kernel",
        version=0,
        dtype="F32",
        layout="2d",
        mib=fp_mib,
        reps=max(5, int(args.reps)),
    )
    for layout, dtype in [("2d", "F32"), ("2d", "BF16"), ("2d", "F64"), ("1d", "F32"), ("cols", "F32")]:
        for v in (2,):
            single(
                "hash",
                f"fp_kernel_v{v}_{layout}_{dtype}",
                f"fingerprint v{v} kernel, {dtype} {layout} ({fp_mib} MiB in memory)",
                "hash_fp_kernel",
                version=v,
                dtype=dtype,
                layout=layout,
                mib=fp_mib,
                reps=max(5, int(args.reps)),
            )
    single("async", "async", "CheckpointManager async save: blocked", "async_save", reps=max(2, args.reps))
    if "async" in groups:
        staged_rows(rows, base, root, to, args)
    single(
        "async",
        "async_gil",
        "async save during a Python-bound loop (unickpt writer process, DCP thread/process)",
        "async_contention",
        reps=max(2, args.reps),
    )

    # 2. distributed FSDP2: save on `world`, load resharded on `load_world`
    dist_dirs: dict[float, Path] = {}

    all_cases = {
        "dcp_save": "DCP save",
        "dcp_hf_save": "DCP HuggingFaceStorageWriter save",
        "unickpt_save": "unickpt sharded save (gather_dtensor=False)",
        "dcp_hf_consolidated_save": "DCP HuggingFaceStorageWriter save + consolidation",
        "unickpt_gathered_save": "unickpt gathered save (every rank writes its bytes)",
        "unickpt_gathered_save_nohash": "unickpt gathered save, hashes and fingerprints off",
        "manager_save": "CheckpointManager save (model, sync)",
        "manager_save_hf": "CheckpointManager save, save_hf=True",
        "torch_gathered_save": "torch full_state_dict + save_file on rank 0",
    }

    def dist_save(
        sz: float, world: int, reps: int, tag: str, group: str, cases: tuple[str, ...] = tuple(all_cases)
    ) -> dict[str, Any]:
        wd = root / f"dist-{sz:g}MB-w{world}"
        wd.mkdir(exist_ok=True)
        p = dict(base, size_mb=sz, reps=reps, workdir=str(wd), cases=list(cases))
        print(f"  [world {world}, {sz:g} MiB: save]", file=sys.stderr, flush=True)
        out = run_world("save", world, p, to * 3)
        b = C.spec_bytes(C.state_spec(sz))
        _world_rows(
            rows,
            group,
            tag,
            f"FSDP2 x{world} {sz:g} MiB: ",
            out,
            b,
            {k: all_cases[k] for k in cases},
        )
        if out.get("ranks") and out["ranks"][0]:
            layouts[tag] = dict(
                out["ranks"][0].get("layout", {}), world=world, size_mb=sz, tensors=len(C.state_spec(sz))
            )
        return out

    layouts: dict[str, Any] = {}
    if "dist" in groups or "merge" in groups:
        if "dist" in groups:
            chosen = tuple(c for c in args.dist_cases.split(",") if c) or tuple(all_cases)
            unknown_cases = set(chosen) - set(all_cases)
            if unknown_cases:
                raise SystemExit(f"unknown dist case(s): {', '.join(sorted(unknown_cases))}")
            dist_save(size, args.world, args.reps, f"w{args.world}_", "dist", chosen)
        else:  # merge sources only
            dist_save(size, args.world, 1, f"w{args.world}_", "merge-src", ("dcp_hf_save", "unickpt_save"))
        dist_dirs[size] = root / f"dist-{size:g}MB-w{args.world}"
    if "dist" in groups and not args.dist_cases:
        wd = dist_dirs[size]
        print(f"  [world {args.load_world}: load resharded from {args.world}]", file=sys.stderr, flush=True)
        p = dict(base, reps=args.reps, workdir=str(wd))
        out = run_world("load", args.load_world, p, to * 3)
        _world_rows(
            rows,
            "dist",
            f"load{args.world}to{args.load_world}_",
            f"FSDP2 {args.world}->{args.load_world} {size:g} MiB: ",
            out,
            nbytes,
            {"dcp_load": "DCP load resharded", "unickpt_load": "unickpt load resharded"},
        )

    # 3. offline merge at two sizes (the smaller one is a quarter of the bytes)
    small = size / 4
    if "merge" in groups:
        dist_save(
            small,
            args.world,
            1,
            f"w{args.world}_small_",
            "merge-src",
            ("dcp_save", "dcp_hf_save", "unickpt_save"),
        )
        dist_dirs[small] = root / f"dist-{small:g}MB-w{args.world}"
        for sz in (small, size):
            wd = dist_dirs[sz]
            b = C.spec_bytes(C.state_spec(sz))
            mp = dict(base, size_mb=sz, reps=args.merge_reps, workdir=str(wd), bytes=b)
            for key, label, case, src in (
                ("copy", "plain copy (copy_file_range) of unickpt files + fsync", "copy", "unickpt"),
                ("consolidate", "torch consolidate_safetensors_files", "merge_consolidate", "dcp_hf"),
                ("merge", "unickpt.merge_checkpoint", "merge_unickpt", "unickpt"),
            ):
                res = run_case(case, dict(mp, src=str(wd / src), out=str(wd / f"out_{key}")), to)
                rows.add("merge", f"{key}_{sz:g}", f"{label}, {sz:g} MiB", res, b)
                C.rm(wd / f"out_{key}")

    # 4. scaling: sharded save at three world sizes and two model sizes (size/16 and size/4, so
    # the default run stays within minutes; size/4 at the largest world is measured above).
    if "scaling" in groups:
        for sz in (size / 16, small):
            for w in args.scaling_worlds:
                if w == args.world and sz in dist_dirs:
                    continue  # measured above
                tag = f"w{w}_{'small_' if sz == small else 'tiny_'}"
                dist_save(sz, w, 1, tag, "scaling", ("dcp_save", "unickpt_save"))
                C.rm(root / f"dist-{sz:g}MB-w{w}")

    # 5. a resharded load from an S3 API (moto's server), unickpt beside DCP's FsspecReader
    if "storage" in groups:
        import storage

        storage.run_group(rows, root, base, args, run_world)

    elapsed = time.perf_counter() - t_start
    if not args.keep:
        C.rm(root)
    return {
        "rows": rows.rows,
        "layouts": layouts,
        "elapsed_s": round(elapsed, 1),
        "state": {"tensors": len(specs), "bytes": nbytes, "size_mb": size},
        "workdir": str(root),
    }


# ------------------------------------------------------------------------------ ratios vs targets


def ratios(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    by = {r["key"]: r for r in rows if r.get("status") == "ok"}
    out: list[dict[str, Any]] = []

    def add(
        name: str, num: str, den: str, target: float, higher_is_better: bool = True, how: str = "gib_s"
    ) -> None:
        a, b = by.get(num), by.get(den)
        if a is None or b is None:
            missing = num if a is None else den
            out.append({"target": name, "status": "not measured", "reason": f"{missing} not available"})
            return
        if how == "gib_s" and "x_raw_paired" in a and "x_raw_paired" in b:
            # drift-corrected: each tool against the disk limit measured beside it
            v = a["x_raw_paired"] / b["x_raw_paired"]
        elif how == "paired":
            v = a.get("x_raw_paired", a["gib_s"] / b["gib_s"])
        elif how == "gib_s":
            v = a["gib_s"] / b["gib_s"]
        elif how == "time":
            v = b["median_s"] / a["median_s"]
        else:  # field ratio a/b
            v = a[how] / b[how]
        met = v >= target if higher_is_better else v <= target
        out.append({"target": name, "value": v, "threshold": target, "met": met, "num": num, "den": den})

    w, lw = args.world, args.load_world
    add("unickpt save >= 0.85x raw write+fsync (1 process, paired)", "u_save", "raw_save", 0.85, how="paired")
    add(
        "unickpt save, hashes off, vs raw write+fsync (paired)",
        "u_save_nohash",
        "raw_save",
        0.85,
        how="paired",
    )
    add("unickpt save >= 2x DCP save (1 process)", "u_save", "dcp_save", 2.0)
    add(f"unickpt save >= 2x DCP save (FSDP2 x{w})", f"w{w}_unickpt_save", f"w{w}_dcp_save", 2.0)
    # issue 19: gathered (Hugging Face) saves without a rank-0 funnel
    g, sl = f"w{w}_unickpt_gathered_save", f"w{w}_unickpt_save"
    add(f"gathered save time <= 1.25x sliced save (FSDP2 x{w})", sl, g, 1.25, False, "time")
    add(
        f"gathered save >= 3x torch full_state_dict + save_file (FSDP2 x{w})",
        g,
        f"w{w}_torch_gathered_save",
        3.0,
    )
    add(
        f"gathered save >= 3x DCP HuggingFaceStorageWriter + consolidation (FSDP2 x{w})",
        g,
        f"w{w}_dcp_hf_consolidated_save",
        3.0,
    )
    add(  # like for like: DCP computes no hash
        f"gathered save, hashes off, >= 3x DCP HuggingFaceStorageWriter + consolidation (FSDP2 x{w})",
        f"w{w}_unickpt_gathered_save_nohash",
        f"w{w}_dcp_hf_consolidated_save",
        3.0,
    )
    add(
        f"manager save_hf=True time <= 1.3x without (FSDP2 x{w})",
        f"w{w}_manager_save",
        f"w{w}_manager_save_hf",
        1.3,
        False,
        "time",
    )
    gr = by.get(g)
    if gr and "rss_extra_max_mb" in gr:
        v = float(gr["rss_extra_max_mb"])
        out.append(
            {
                "target": "gathered save: extra peak RSS on any rank <= 160 MB (MB)",
                "value": v,
                "threshold": 160.0,
                "met": v <= 160,
            }
        )
    add("unickpt load >= 1x DCP load (1 process)", "u_load", "dcp_load", 1.0)
    add(
        f"unickpt load >= 1x DCP load (resharded {w}->{lw})",
        f"load{w}to{lw}_unickpt_load",
        f"load{w}to{lw}_dcp_load",
        1.0,
    )
    # hashing share: end to end (hashes on vs off) and in-memory compute of both hashes
    on, off = by.get("u_save"), by.get("u_save_nohash")
    if on and off:
        if "x_raw_paired" in on and "x_raw_paired" in off:  # drift-corrected by the paired raw writes
            v = 1 - on["x_raw_paired"] / off["x_raw_paired"]
        else:
            v = (on["median_s"] - off["median_s"]) / on["median_s"]
        out.append(
            {
                "target": "hashes+fingerprints <= 5% of save time (on vs off, end to end)",
                "value": v,
                "threshold": 0.05,
                "met": v <= 0.05,
            }
        )
    else:
        out.append(
            {
                "target": "hashes+fingerprints <= 5% of save time (on vs off, end to end)",
                "status": "not measured",
                "reason": "unickpt save with hashes on/off not available",
            }
        )
    hx, hf = by.get("hash_xxh3"), by.get("hash_fp")
    save_ref = on or by.get("raw_save")
    if hx and hf and save_ref:
        v = (hx["median_s"] + hf["median_s"]) / save_ref["median_s"]
        ref = "unickpt save" if on else "raw write+fsync (unickpt save not available)"
        out.append(
            {
                "target": f"hash compute (xxh3 + fingerprint, serial) as share of {ref}",
                "value": v,
                "threshold": 0.05,
                "met": v <= 0.05,
            }
        )
    v2 = by.get("fp_kernel_v2_2d_F32")
    out.append(
        {
            "target": "fingerprint v2 kernel, fp32 in memory, one thread >= 8 GiB/s",
            "value": v2["gib_s"],
            "threshold": 8.0,
            "met": v2["gib_s"] >= 8.0,
        }
        if v2
        else {"target": "fingerprint v2 kernel >= 8 GiB/s", "status": "not measured", "reason": "not run"}
    )
    add(
        "fingerprint v2 kernel fp32 / memory read (numpy sum) in the same run (no threshold)",
        "fp_kernel_v2_2d_F32",
        "fp_kernel_v0_2d_F32",
        0.0,
    )
    small, size = args.size_mb / 4, args.size_mb
    add(
        f"merge >= 1.5x consolidate_safetensors_files ({size:g} MiB)",
        f"merge_{size:g}",
        f"consolidate_{size:g}",
        1.5,
    )
    add(
        f"merge >= 1.5x consolidate_safetensors_files ({small:g} MiB)",
        f"merge_{small:g}",
        f"consolidate_{small:g}",
        1.5,
    )
    add(
        f"merge >= 0.7x plain copy ({size:g} MiB, paired)",
        f"merge_{size:g}",
        f"copy_{size:g}",
        0.7,
        how="paired",
    )
    add(
        f"merge >= 0.7x plain copy ({small:g} MiB, paired)",
        f"merge_{small:g}",
        f"copy_{small:g}",
        0.7,
        how="paired",
    )
    add(
        f"merge peak RSS {size:g} MiB / {small:g} MiB <= 1.25x",
        f"merge_{size:g}",
        f"merge_{small:g}",
        1.25,
        False,
        "rss_peak_mb",
    )
    add(
        f"consolidate peak RSS {size:g} MiB / {small:g} MiB (reference)",
        f"consolidate_{size:g}",
        f"consolidate_{small:g}",
        1.25,
        False,
        "rss_peak_mb",
    )
    s3s = by.get("s3_unickpt_save")
    if s3s and "x_dcp_paired" in s3s.get("extra", {}):
        v = s3s["extra"]["x_dcp_paired"]
        out.append(
            {
                "target": f"unickpt save >= 1.5x DCP FsspecWriter save (S3, FSDP2 x{w}, paired per rep)",
                "value": v,
                "threshold": 1.5,
                "met": v >= 1.5,
            }
        )
    s3u = by.get("s3_unickpt_load")
    if s3u and "x_dcp_paired" in s3u.get("extra", {}):
        v = s3u["extra"]["x_dcp_paired"]
        out.append(
            {
                "target": f"unickpt load >= 1.5x DCP FsspecReader load (S3, resharded {w}->{lw}, paired per rep)",
                "value": v,
                "threshold": 1.5,
                "met": v >= 1.5,
            }
        )
    else:
        add(
            f"unickpt load >= 1.5x DCP FsspecReader load (S3, resharded {w}->{lw})",
            "s3_unickpt_load",
            "s3_dcp_load",
            1.5,
        )
    if s3u and "extra" in s3u:
        v = s3u["extra"]["x_checkpoint"]
        out.append(
            {
                "target": f"unickpt {w}->{lw} load from S3 fetches <= 1.1x the checkpoint's bytes",
                "value": v,
                "threshold": 1.1,
                "met": v <= 1.1,
            }
        )
    for layout, name in (("ddp", "DDP"), ("fsdp2", "FSDP2")):
        st = by.get(f"staged_{layout}")
        if st and "staged_over_written" in (st.get("extra") or {}):
            v = st["extra"]["staged_over_written"]
            out.append(
                {
                    "target": f"async staging under {name} x4: bytes staged <= 1.01x bytes written, every rank",
                    "value": v,
                    "threshold": 1.01,
                    "met": v <= 1.01,
                }
            )
    g = by.get("async_gil")
    if g and "extra" in g and "unickpt" in g["extra"]:
        for saver in ("unickpt", "dcp_thread", "dcp_process"):
            u = g["extra"].get(saver, {})
            if "loop_ratio" not in u:
                continue
            out.append(
                {
                    "target": f"{saver}: Python-bound loop during an async save >= 0.9x its speed alone",
                    "value": u["loop_ratio"],
                    "threshold": 0.9,
                    "met": u["loop_ratio"] >= 0.9,
                }
            )
            out.append(
                {
                    "target": f"{saver}: async save during that loop <= 2x the save with an idle main thread",
                    "value": u["busy_s"] / u["idle_s"],
                    "threshold": 2.0,
                    "met": u["busy_s"] / u["idle_s"] <= 2.0,
                }
            )
    a = by.get("async")
    if a and "extra" in a:
        blocked = C.median(a["extra"]["async"]["blocked"])
        sync = C.median(a["extra"]["sync"]["total"])
        out.append(
            {
                "target": "async save blocking <= 15% of sync save",
                "value": blocked / sync,
                "threshold": 0.15,
                "met": blocked / sync <= 0.15,
            }
        )
    else:
        out.append(
            {
                "target": "async save blocking <= 15% of sync save",
                "status": "not measured",
                "reason": "CheckpointManager not available",
            }
        )
    return out


# ------------------------------------------------------------------------------ report


def _fmt(x: Any, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    by = {r["key"]: r for r in rows if r.get("status") == "ok"}
    ref_for = {"save": by.get("raw_save"), "load": by.get("raw_load")}
    lines = [
        f"state: {report['state']['tensors']} tensors, {report['state']['bytes'] / C.MiB:.0f} MiB; "
        f"median of {report['args']['reps']} reps; command: `{report['command']}`",
        "",
        "| group | case | median s | GiB/s | x raw | peak RSS MB (over base) | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(
                f"| {r['group']} | {r['label']} | | | | | {r.get('status')}: {r.get('reason', '')} |"
            )
            continue
        kind = "load" if "load" in r["key"] or r["key"].startswith("raw_load") else "save"
        ref = ref_for.get(kind)
        xr_s = ""
        if "x_raw_paired" in r:
            xr_s = f"{r['x_raw_paired']:.2f}"
        elif ref and "gib_s" in r and r["group"] not in ("hash", "merge", "async"):
            xr_s = f"{r['gib_s'] / ref['gib_s']:.2f}*"
        rss = ""
        if "rss_peak_mb" in r:
            rss = f"{r['rss_peak_mb']:.0f} ({r['rss_peak_mb'] - r.get('rss_base_mb', 0):+.0f})"
        note = []
        ex = r.get("extra") or {}
        if "bit_exact" in ex:
            note.append("bit-exact" if ex["bit_exact"] else "MISMATCH")
        if "matches_dcp_load" in ex:
            note.append("equals DCP load" if ex["matches_dcp_load"] else "DIFFERS from DCP load")
        first = r.get("first_s") or []
        if first and first[0] > 1.5 * r["median_s"] and first[0] - r["median_s"] > 0.05:
            note.append(f"first call {first[0]:.2f} s")
        if "x_dcp_paired" in ex:
            note.append(f"{ex['x_dcp_paired']:.2f}x DCP's speed (median of per-rep ratios)")
        if "fetched_per_rank" in ex:
            mib = ", ".join(f"{b / C.MiB:.1f}" for b in ex["fetched_per_rank"])
            note.append(
                f"fetched per rank {mib} MiB ({ex['x_checkpoint']:.2f}x the checkpoint), "
                f"requests per rank {ex['requests_per_rank']}"
            )
        if "uploaded_per_rank" in ex:  # storage group saves
            mib = ", ".join(f"{b / C.MiB:.1f}" for b in ex["uploaded_per_rank"])
            note.append(f"uploaded per rank {mib} MiB, requests per rank {ex.get('requests_per_rank')}")
        if "rss_peak_max_mb" in r:
            note.append(f"max over ranks {r['rss_peak_max_mb']:.0f} MB")
        if "staged_per_rank" in ex:
            mib = lambda xs: ", ".join(f"{b / C.MiB:.1f}" for b in xs)  # noqa: E731
            note.append(
                f"staged per rank {mib(ex['staged_per_rank'])} MiB, written {mib(ex['written_per_rank'])} MiB, "
                f"held {mib(ex['held_per_rank'])} MiB (staged/written {ex['staged_over_written']:.4f}); "
                f"copying every held slice {ex['full_copy_s']:.3f} s"
            )
        if r["key"] == "async_gil" and ex:
            for saver in ("unickpt", "dcp_thread", "dcp_process"):
                u = ex.get(saver, {})
                if "loop_ratio" in u:
                    lost = f", loop lost {u['lost_s']:.3f} s" if "lost_s" in u else ""
                    note.append(
                        f"{saver}: loop {u['loop_ratio']:.2f}x, save {u['busy_s']:.2f} s busy / "
                        f"{u['idle_s']:.2f} s idle, blocked {u['blocked_s']:.3f} s{lost}"
                    )
                elif "error" in u:
                    note.append(f"{saver}: {u['error']}")
            if "copy_s" in ex:
                note.append(f"copying the bytes {ex['copy_s']:.3f} s")
        if r["key"] == "async" and ex:
            note.append(
                f"sync save {C.median(ex['sync']['total']):.3f} s; async total {C.median(ex['async']['total']):.3f} s"
            )
        lines.append(
            f"| {r['group']} | {r['label']} | {r['median_s']:.3f} | {_fmt(r.get('gib_s'), '.2f')} | "
            f"{xr_s} | {rss} | {'; '.join(note)} |"
        )
    lines += [
        "",
        "x raw: throughput over a raw write+fsync (saves) or raw read (loads) of the same bytes, "
        "run right before each repetition (median of the paired ratios); * = against the separate "
        "raw row instead (distributed cases: single-process raw, not an aggregate limit).",
        "",
        "| target (ratio in this run) | value | threshold | met |",
        "|---|---:|---:|---|",
    ]
    for t in report["targets"]:
        if "value" in t:
            lines.append(
                f"| {t['target']} | {t['value']:.2f} | {t['threshold']:.2f} | {'yes' if t['met'] else 'NO'} |"
            )
        else:
            lines.append(f"| {t['target']} | | | {t['status']}: {t['reason']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=None, help="synthetic state size in MiB (default 1024)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="64 MiB, 2 reps, small worlds, no scaling group: a smoke run of a few minutes",
    )
    ap.add_argument(
        "--reps", type=int, default=None, help="repetitions per case (median reported; default 3)"
    )
    ap.add_argument("--merge-reps", type=int, default=None, help="repetitions per merge case (default 2)")
    ap.add_argument(
        "--shard-mb", type=int, default=None, help="size_per_shard for unickpt sharded saves (MB)"
    )
    ap.add_argument("--only", default="", help=f"comma-separated groups: {','.join(GROUPS)}")
    ap.add_argument("--skip", default="", help="comma-separated groups to leave out")
    ap.add_argument(
        "--dist-cases",
        default="",
        help="comma-separated save cases of the dist group (e.g. unickpt_gathered_save,"
        "dcp_hf_consolidated_save); given, the group runs only these and no resharded load",
    )
    ap.add_argument("--world", type=int, default=4, help="save world size (FSDP2)")
    ap.add_argument("--load-world", type=int, default=2, help="resharded load world size")
    ap.add_argument("--scaling-worlds", default="1,2,4", help="world sizes of the scaling group")
    ap.add_argument(
        "--storage-mb", type=float, default=None, help="state size of the storage group (MiB; default 64)"
    )
    ap.add_argument(
        "--workdir", default="", help="scratch directory (default: a new temp dir, removed after)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument(
        "--json", default="", help="output JSON path (default benchmarks/results/bench-<time>.json)"
    )
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per case (x3 per distributed world)"
    )
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.case:  # internal: one case in this fresh process
        import cases

        try:
            res = cases.CASES[args.case](json.loads(args.params))
        except Exception as e:
            import traceback

            traceback.print_exc()
            res = {"status": "error", "reason": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
        C.emit(res)
        return

    if args.size_mb is None:
        args.size_mb = 64.0 if args.quick else 1024.0
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    if args.merge_reps is None:
        args.merge_reps = 1 if args.quick else 2
    if args.shard_mb is None:
        args.shard_mb = max(8, int(args.size_mb) // 4)
    if args.storage_mb is None:
        args.storage_mb = 16.0 if args.quick else 64.0
    if args.quick and not args.only:
        args.skip = ",".join(filter(None, [args.skip, "scaling"]))
    args.scaling_worlds = [int(x) for x in str(args.scaling_worlds).split(",") if x]

    command = "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = suite(args)
    report["args"] = {k: v for k, v in vars(args).items() if k not in ("case", "params")}
    report["command"] = command.strip()
    report["machine"] = C.machine_info(os.path.dirname(report["workdir"]) or "/")
    report["targets"] = ratios(report["rows"], args)
    report["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    md = markdown(report)
    report["markdown"] = md
    out = Path(args.json) if args.json else HERE / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    m = report["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, {m['disk']}, torch {m['versions'].get('torch')}, "
        f"fingerprint kernel {m['versions'].get('unickpt fingerprint kernel')}"
    )
    print(md)
    print(f"\nJSON: {out}  ({report['elapsed_s']} s)")


if __name__ == "__main__":
    main()
