"""Async saves against a Python-bound training loop, side by side in one process (group ``async``).

For each saver (unickpt ``save_model(use_async=True)``, whose writer is a separate process;
DCP ``async_save`` with ``AsyncCheckpointerType.THREAD`` and ``.PROCESS``), on the same state:

- ``idle_s``: the save's duration (call to committed) while the main thread only waits;
- ``busy_s``: the same save's duration while the main thread runs a pure-Python loop (it holds
  the GIL between bytecodes, as a Python-heavy training step does), polling for the commit;
- ``loop_ratio``: the loop's speed during that save over its speed with no save, the two
  measured back to back (``>= 0.9`` is the goal);
- ``lost_s``: what the save cost that loop: the time it ran (call included) less the time its
  iterations take at its speed alone; the goal is ``lost_s`` near ``copy_s``;
- ``blocked_s``: how long the save call itself blocked, and ``copy_s``: the time to copy this
  process's bytes into CPU buffers already allocated (the least a snapshot can cost);
- for unickpt, ``writer_run_s`` and ``writer_wait_s``: the writer process's time running and
  waiting on a run queue during the save under the loop (``/proc/<pid>/task/*/schedstat``), which
  tells a save slowed by the CPU it needs from one starved of the CPU it waits for.

One warm-up save per saver (process start-up, buffer allocation) is not counted. Ratios are
what to compare: the machine is shared and absolute figures drift.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C

_CHUNK = 2000  # Python loop iterations between two polls (well under a millisecond)
_BUSY_LIMIT_S = 120.0


def _spin_chunk(x: int) -> int:
    for i in range(_CHUNK):
        x = (x * 31 + i) % 1000003
    return x


def _loop(seconds: float, done: Callable[[], bool] | None = None) -> tuple[float, float]:
    """Run the Python loop for ``seconds`` (or until ``done()``); (chunks per second, elapsed)."""
    t0 = time.perf_counter()
    n, x = 0, 1
    while True:
        x = _spin_chunk(x)
        n += 1
        now = time.perf_counter()
        if (
            (done is not None and done())
            or (done is None and now - t0 >= seconds)
            or now - t0 > _BUSY_LIMIT_S
        ):
            return n / (now - t0), now - t0


def _copy_time(state: dict[str, Any]) -> float:
    import torch

    bufs = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        bufs[k].copy_(v)
    t0 = time.perf_counter()
    for k, v in state.items():
        bufs[k].copy_(v)
    return time.perf_counter() - t0


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds ``pid``'s threads have run and waited on a run queue (0, 0 where unknown)."""
    run = wait = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                r, w, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                run, wait = run + int(r), wait + int(w)
    return run / 1e9, wait / 1e9


def _one(
    start: Callable[[int], Callable[[], bool]],
    finish: Callable[[], None],
    reps: int,
    worker: Callable[[], int | None] | None = None,
) -> dict[str, Any]:
    """``start(i)`` begins save ``i`` and returns its ``done()``; ``finish()`` waits for it;
    ``worker()``: the pid of the process that writes (its scheduling measured), if any."""
    out: dict[str, list[float]] = {
        "blocked_s": [],
        "idle_s": [],
        "busy_s": [],
        "loop_ratio": [],
        "lost_s": [],
    }
    if worker is not None:
        out |= {"writer_run_s": [], "writer_wait_s": []}
    done = start(0)  # warm-up: process start, buffers
    finish()
    for i in range(1, reps + 1):
        t0 = time.perf_counter()
        done = start(2 * i)
        out["blocked_s"].append(time.perf_counter() - t0)
        finish()
        out["idle_s"].append(time.perf_counter() - t0)
        base, _ = _loop(max(0.5, min(3.0, out["idle_s"][-1])))  # the loop alone, right before
        pid = None if worker is None else worker()
        before = _schedstat(pid) if pid else (0.0, 0.0)
        t0 = time.perf_counter()
        done = start(2 * i + 1)
        rate, elapsed = _loop(0.0, done)
        out["busy_s"].append(time.perf_counter() - t0)
        if pid:
            after = _schedstat(pid)
            out["writer_run_s"].append(after[0] - before[0])
            out["writer_wait_s"].append(after[1] - before[1])
        finish()
        out["loop_ratio"].append(rate / base)
        out["lost_s"].append(out["busy_s"][-1] - rate * elapsed / base)
    return {k: C.median(v) for k, v in out.items()} | {"runs": out}


def async_contention(p: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    specs = C.state_spec(float(p["size_mb"]))
    model = C.build_model(specs, fill="random", seed=int(p.get("seed", 0)))
    state, nbytes = C.plain_state(model), C.spec_bytes(specs)
    work = Path(p["workdir"]) / "async_contention"
    C.rm(work)
    work.mkdir(parents=True)
    # DCP's process mode needs a process group: a world of one, for every saver alike.
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(store.port))
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
        )
    reps = int(p.get("reps", 2))
    res: dict[str, Any] = {"copy_s": _copy_time(state)}

    from unickpt.io import GeneralCheckpointIO

    io = GeneralCheckpointIO()

    def u_start(i: int) -> Callable[[], bool]:
        io.save_model(model, str(work / f"u{i % 2}"), shard=True, gather_dtensor=False, use_async=True)
        return lambda: not io._async.pending

    res["unickpt"] = _one(u_start, io.wait, reps, lambda: io._async.writer.pid)
    io.close()

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    for name, kind in (
        ("dcp_thread", AsyncCheckpointerType.THREAD),
        ("dcp_process", AsyncCheckpointerType.PROCESS),
    ):
        fut: list[Any] = []

        def d_start(i: int, kind: Any = kind, name: str = name, fut: list[Any] = fut) -> Callable[[], bool]:
            d = work / f"{name}{i % 2}"
            C.rm(d)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f = dcp.async_save(state, checkpoint_id=str(d), async_checkpointer_type=kind)
            fut[:] = [f]
            return f.done

        def d_finish(fut: list[Any] = fut) -> None:
            fut[0].result()

        try:
            res[name] = _one(d_start, d_finish, reps)
        except Exception as e:  # reported, the other savers still compared
            res[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    C.rm(work)
    u = res["unickpt"]
    return {
        "status": "ok",
        "bytes": nbytes,
        "times": u["runs"]["busy_s"],
        "extra": res,
    }
