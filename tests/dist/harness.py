"""Launch real multi-process worlds (gloo on CPU) for tests, and the per-rank entry point.

From a test (parent process)::

    results = run_world(2, "test_plugins_train:train_worker", 2, timeout=120)
    # results[r] is what train_worker(2) returned on rank r

    with World(4) as world:                     # or the session fixture `world_pool`
        world.run("test_reshard_matrix:save_phase", root, 4, timeout=300)
        world.run("test_reshard_matrix:load_phase", root, 4, timeout=300)

A :class:`World` starts ``nprocs`` Python processes with the environment torchrun would
give them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT, OMP_NUM_THREADS=1). Each runs this file with ``--serve``: it initialises the
gloo process group once (collective timeout ``UNICKPT_TEST_PG_TIMEOUT_S``, default 90 s), then
runs jobs as they arrive: import the worker module (found on ``tests/dist``), call the
function, pickle the return value or the traceback into the world's directory. Starting a
process costs seconds (importing torch) on a small machine, so worlds stay up across jobs
and test modules (:class:`WorldPool`), and each job runs many cases (:func:`run_cases`).

Failures never stall: when a rank fails, the others get ``FAIL_GRACE_S`` to finish or fail
(a peer blocked in a collective with the failed rank never finishes) and the world is then
killed; a job that overruns its timeout kills the world and raises :class:`WorldTimeout`.
Each process gets its own session, so killing reaches its children too.

By hand, the same workers run under torchrun (arguments are passed as strings); case
outcomes are printed by rank 0 and a failed case makes the exit code 1::

    cd /work/main
    OMP_NUM_THREADS=1 PYTHONPATH=.:tests/dist .venv/bin/torchrun --nproc_per_node 2 \\
        tests/dist/harness.py test_plugins_train:train_worker 2

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


class World:
    """``nprocs`` live rank processes that run jobs one after another (a persistent world).

    Every rank imports torch and joins the process group once; each :meth:`run` then costs
    only the job itself. The parent (one thread) creates, uses and closes a world. After a
    timeout, or a rank failure that leaves other ranks unresponsive, the world is killed
    and :attr:`alive` turns false.
    """

    def __init__(
        self,
        nprocs: int,
        env: dict[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        fail_grace_s: float = FAIL_GRACE_S,
    ) -> None:
        self.nprocs = nprocs
        self.fail_grace_s = fail_grace_s
        self._tmp = tempfile.TemporaryDirectory(prefix="unickpt-world-", dir=workdir)
        self.dir = Path(self._tmp.name)
        self._next_job = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        base_env = dict(os.environ)
        base_env.update(env or {})
        pythonpath = [str(REPO), str(HERE)]
        if base_env.get("PYTHONPATH"):
            pythonpath.append(base_env["PYTHONPATH"])
        port = free_port()
        cmd = [sys.executable, str(HERE / "harness.py"), "--serve", str(self.dir)]
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
                log = self.dir / f"rank{rank}.log"
                self.logs.append(log)
                with open(log, "wb") as fh:
                    self.procs.append(
                        subprocess.Popen(
                            cmd,
                            env=rank_env,
                            cwd=str(REPO),
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def run(self, target: str, *args: Any, timeout: float = 180.0) -> list[Any]:
        """Run ``target`` ("module:function") with ``args`` on every rank; return per-rank results.

        ``timeout`` covers this job (and the world's start-up, for its first job). Raises
        :class:`WorldError` with every failed rank's traceback, or :class:`WorldTimeout` after
        killing the world.
        """
        if not self.alive:
            raise WorldError(f"world of {self.nprocs} is not running\n{self._tails()}", {})
        k = self._next_job
        self._next_job += 1
        tmp = self.dir / f"job{k}.pkl.tmp"
        tmp.write_bytes(pickle.dumps((target, args)))
        tmp.replace(self.dir / f"job{k}.pkl")
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        errors: dict[int, str] = {}
        while True:
            done = {r for r in range(self.nprocs) if self._result_path(k, r, "pkl").exists()}
            for r in range(self.nprocs):
                err = self._result_path(k, r, "err")
                if r not in errors and err.exists():
                    errors[r] = err.read_text()
                elif r not in errors and r not in done and self.procs[r].poll() is not None:
                    errors[r] = f"exit code {self.procs[r].returncode}; output tail:\n{_tail(self.logs[r])}"
            if len(done | set(errors)) == self.nprocs:
                break
            now = time.monotonic()
            if errors and first_failure is None:
                first_failure = now
            if now > deadline:
                tails = self._tails()
                self.close(graceful=False)
                raise WorldTimeout(
                    f"world of {self.nprocs} running {target} exceeded {timeout:.0f} s and was killed\n{tails}",
                    errors,
                )
            if first_failure is not None and now - first_failure > self.fail_grace_s:
                # The other ranks are most likely blocked in a collective with a failed peer.
                for r in range(self.nprocs):
                    if r not in done and r not in errors:
                        errors[r] = f"no result {self.fail_grace_s:.0f} s after a peer failed (killed)"
                self.close(graceful=False)
                break
            time.sleep(0.02)
        if errors:
            parts = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise WorldError(
                f"{len(errors)} of {self.nprocs} ranks failed running {target}:\n{parts}", errors
            )
        return [pickle.loads(self._result_path(k, r, "pkl").read_bytes()) for r in range(self.nprocs)]

    def close(self, graceful: bool = True) -> None:
        """Ask the ranks to stop, then kill whatever is left (only the processes this world started)."""
        with contextlib.suppress(OSError):
            (self.dir / "stop").write_bytes(b"")
        deadline = time.monotonic() + (5 if graceful else 0)
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in self.procs:
            _kill(p)
        with contextlib.suppress(OSError):
            self._tmp.cleanup()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _result_path(self, k: int, rank: int, ext: str) -> Path:
        return self.dir / f"job{k}.rank{rank}.{ext}"

    def _tails(self) -> str:
        return "\n".join(
            f"--- rank {r} output tail ---\n{_tail(log, 2000)}" for r, log in enumerate(self.logs)
        )


class WorldPool:
    """One persistent :class:`World` per size, started on first use and restarted if it died."""

    def __init__(self) -> None:
        self.worlds: dict[int, World] = {}

    def run(self, nprocs: int, target: str, *args: Any, timeout: float = 180.0) -> list[Any]:
        world = self.worlds.get(nprocs)
        if world is None or not world.alive:
            if world is not None:
                world.close()
            world = self.worlds[nprocs] = World(nprocs)
        return world.run(target, *args, timeout=timeout)

    def close(self) -> None:
        # Tell every world to stop first, so they shut down in parallel.
        for world in self.worlds.values():
            with contextlib.suppress(OSError):
                (world.dir / "stop").write_bytes(b"")
        for world in self.worlds.values():
            world.close()
        self.worlds.clear()


def run_world(
    nprocs: int,
    target: str,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    fail_grace_s: float = FAIL_GRACE_S,
) -> list[Any]:
    """Start a world of ``nprocs`` ranks, run one job on it, stop it; see :meth:`World.run`."""
    with World(nprocs, env=env, workdir=workdir, fail_grace_s=fail_grace_s) as world:
        return world.run(target, *args, timeout=timeout)


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


def _serve(directory: Path, rank: int) -> int:
    """Rank loop of a :class:`World`: run ``job{k}.pkl`` for k = 0, 1, ... until ``stop`` appears."""
    parent = os.getppid()
    k = 0
    while True:
        job = directory / f"job{k}.pkl"
        if job.exists():
            target, args = pickle.loads(job.read_bytes())
            try:
                result = _call(target, args)
                tmp = directory / f"job{k}.rank{rank}.pkl.tmp"
                tmp.write_bytes(pickle.dumps(result))
                tmp.replace(directory / f"job{k}.rank{rank}.pkl")
            except BaseException:
                tb = traceback.format_exc()
                (directory / f"job{k}.rank{rank}.err").write_text(tb)
                print(f"[rank {rank}] job {k} ({target}) failed:\n{tb}", file=sys.stderr, flush=True)
            k += 1
        elif (directory / "stop").exists() or os.getppid() != parent:
            return 0
        else:
            time.sleep(0.01)


def main(argv: Sequence[str] | None = None) -> int:
    """Per-rank entry: ``harness.py module:function [args...]`` (by hand) or ``harness.py --serve DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("target", nargs="?", help="module:function, run once (under torchrun)")
    parser.add_argument("args", nargs="*", help="string arguments for the function")
    parser.add_argument("--serve", help="run jobs from this directory until told to stop (used by World)")
    ns = parser.parse_args(argv)
    if not ns.serve and not ns.target:
        parser.error("give module:function or --serve DIR")
    sys.path[:0] = [str(REPO), str(HERE)]
    rank = int(os.environ.get("RANK", "0"))
    import torch.distributed as dist

    try:
        timeout_s = float(os.environ.get("UNICKPT_TEST_PG_TIMEOUT_S", "90"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        if ns.serve:
            return _serve(Path(ns.serve), rank)
        return _report(rank, _call(ns.target, ns.args))
    except BaseException:
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    # Run the copy imported as ``harness``, the one worker modules import, so that the
    # CaseResult class they return is the one _report knows.
    import harness

    sys.exit(harness.main())
