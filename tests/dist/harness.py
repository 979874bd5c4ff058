"""Launch real multi-process worlds (gloo on CPU) for tests, and the per-rank entry point.

From a test (parent process)::

    results = run_world(2, "test_plugins_train:train_worker", str(tmp_path), timeout=120)
    # results[r] is what train_worker(...) returned on rank r

``run_world`` starts ``nprocs`` Python processes with the environment torchrun would give
them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT, OMP_NUM_THREADS=1). Each runs this file as a script: it initialises the gloo
process group (with a short collective timeout, ``UNICKPT_TEST_PG_TIMEOUT_S``, default 90 s),
imports the worker module (found on ``tests/dist``), calls the function with the given
arguments and pickles the return value, or the traceback, into a result directory. When a
rank fails, the others get a grace period to fail too (a peer stuck in a collective does not
finish) and are then killed; when the whole world overruns ``timeout`` every process is
killed and :class:`WorldTimeout` is raised, so a hung collective fails the test instead of
stalling CI. Each process gets its own session, so killing reaches its children too.

Start a world once per test module and run many cases inside it (:func:`run_cases`):
starting a process costs seconds (importing torch) on a small machine.

By hand, the same workers run under torchrun (arguments are passed as strings)::

    cd /work/main
    OMP_NUM_THREADS=1 PYTHONPATH=.:tests/dist .venv/bin/torchrun --nproc_per_node 2 \\
        tests/dist/harness.py test_plugins_train:train_worker /tmp/run1
    # add --out DIR to keep per-rank result pickles; failures print tracebacks and exit 1

This is test code: results travel as pickles between processes we started ourselves.
Checkpoint files are never unpickled.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# After one rank fails, how long the others may take to fail or finish on their own before
# they are killed (a rank blocked in a collective with the dead peer would wait for the
# process-group timeout otherwise).
FAIL_GRACE_S = 10.0


class WorldError(AssertionError):
    """One or more ranks failed; the message holds every failed rank's traceback."""

    def __init__(self, message: str, rank_errors: dict[int, str]) -> None:
        super().__init__(message)
        self.rank_errors = rank_errors


class WorldTimeout(WorldError):
    """The world did not finish within its timeout and was killed."""


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text[-n_chars:]


def run_world(
    nprocs: int,
    target: str,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Run ``target`` ("module:function") on ``nprocs`` ranks; return the per-rank results.

    Raises :class:`WorldError` with every failed rank's traceback (and stderr tail), or
    :class:`WorldTimeout` after killing the world when it overruns ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="unickpt-world-", dir=workdir) as tmp:
        out = Path(tmp)
        args_file = out / "args.pkl"
        args_file.write_bytes(pickle.dumps(args))
        base_env = dict(os.environ)
        base_env.update(env or {})
        pythonpath = [str(REPO), str(HERE)]
        if base_env.get("PYTHONPATH"):
            pythonpath.append(base_env["PYTHONPATH"])
        port = free_port()
        cmd = [
            sys.executable,
            str(HERE / "harness.py"),
            target,
            "--args-file",
            str(args_file),
            "--out",
            str(out),
        ]
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        try:
            for rank in range(nprocs):
                rank_env = dict(base_env)
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nprocs),
                    LOCAL_WORLD_SIZE=str(nprocs),
                    GROUP_RANK="0",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join(pythonpath),
                    PYTHONUNBUFFERED="1",
                )
                log = out / f"rank{rank}.log"
                logs.append(log)
                with open(log, "wb") as fh:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            env=rank_env,
                            cwd=str(REPO),
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            deadline = time.monotonic() + timeout
            first_failure: float | None = None
            timed_out = False
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if first_failure is None and any(c not in (None, 0) for c in codes):
                    first_failure = now
                if now > deadline:
                    timed_out = True
                    break
                if first_failure is not None and now - first_failure > FAIL_GRACE_S:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill(p)
        errors: dict[int, str] = {}
        results: list[Any] = []
        for rank, p in enumerate(procs):
            res = out / f"rank{rank}.pkl"
            err = out / f"rank{rank}.err"
            if err.exists():
                errors[rank] = err.read_text()
            elif p.returncode != 0 or not res.exists():
                errors[rank] = f"exit code {p.returncode}, no result; output tail:\n{_tail(logs[rank])}"
            if res.exists() and rank not in errors:
                results.append(pickle.loads(res.read_bytes()))
            else:
                results.append(None)
        if timed_out:
            tails = "\n".join(f"--- rank {r} output tail ---\n{_tail(logs[r], 2000)}" for r in range(nprocs))
            raise WorldTimeout(
                f"world of {nprocs} running {target} exceeded {timeout:.0f} s and was killed\n{tails}", errors
            )
        if errors:
            parts = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise WorldError(f"{len(errors)} of {nprocs} ranks failed running {target}:\n{parts}", errors)
        return results


# -- helpers for worker functions (run inside the ranks) ---------------------------------------


@dataclass
class CaseResult:
    """Outcome of one case on this rank: ``error`` holds a traceback when it failed on any rank."""

    name: str
    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0


def run_cases(cases: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, CaseResult]:
    """Run named cases one after another on every rank; a failing case does not stop the rest.

    After each case the ranks exchange their outcome, so a case counts as failed when any
    rank failed (and every rank reports the same verdict, with the failing ranks' tracebacks).
    A case that leaves a peer blocked in a collective ends with the process-group timeout.
    """
    import torch.distributed as dist

    results: dict[str, CaseResult] = {}
    for name, fn in cases:
        t0 = time.perf_counter()
        try:
            value, error = fn(), ""
        except Exception:
            value, error = None, traceback.format_exc()
        seconds = time.perf_counter() - t0
        errors: list[str] = [error]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[str] = [""] * dist.get_world_size()
            try:
                dist.all_gather_object(gathered, error)
            except Exception:
                gathered = [error, f"outcome exchange failed:\n{traceback.format_exc()}"]
            errors = gathered
        failed = [f"[rank {r}] {e}" for r, e in enumerate(errors) if e]
        results[name] = CaseResult(name, not failed, value, "\n".join(failed), seconds)
    return results


def _call(target: str, args: Sequence[Any]) -> Any:
    module_name, _, func_name = target.partition(":")
    if not func_name:
        raise SystemExit(f"target must look like module:function, got {target!r}")
    func = getattr(importlib.import_module(module_name), func_name)
    return func(*args)


def _report(rank: int, result: Any) -> int:
    """For runs by hand: print case outcomes on rank 0; exit code 1 when a case failed."""
    if not isinstance(result, dict) or not all(isinstance(v, CaseResult) for v in result.values()):
        if rank == 0:
            print(f"result: {result!r}")
        return 0
    failed = [c for c in result.values() if not c.ok]
    if rank == 0:
        for c in result.values():
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.name} ({c.seconds:.2f} s)")
            if not c.ok:
                print(c.error)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Per-rank entry: ``harness.py module:function [args...] [--args-file F] [--out DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("target")
    parser.add_argument("args", nargs="*")
    parser.add_argument("--args-file")
    parser.add_argument("--out")
    ns = parser.parse_args(argv)
    sys.path[:0] = [str(REPO), str(HERE)]
    rank = int(os.environ.get("RANK", "0"))
    out = Path(ns.out) if ns.out else None
    args: Sequence[Any] = ns.args
    if ns.args_file:
        args = pickle.loads(Path(ns.args_file).read_bytes())
    import torch.distributed as dist

    try:
        timeout_s = float(os.environ.get("UNICKPT_TEST_PG_TIMEOUT_S", "90"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        result = _call(ns.target, args)
        if out is None:
            return _report(rank, result)
        else:
            tmp = out / f"rank{rank}.pkl.tmp"
            tmp.write_bytes(pickle.dumps(result))
            tmp.replace(out / f"rank{rank}.pkl")
    except BaseException:
        tb = traceback.format_exc()
        if out is not None:
            (out / f"rank{rank}.err").write_text(tb)
        print(f"[rank {rank}] failed:\n{tb}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
