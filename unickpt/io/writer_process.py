"""The writer process of async saves: one child process per ``AsyncSaves``, fed from shared memory.

An async save copies this rank's bytes into CPU buffers in the foreground (``SavePayload.snapshot``)
and then hashes, writes, fsyncs and commits them in the background. Done in a thread of the
training process, that background work competes with training for the GIL: a Python-bound
training loop slows down, and the save itself crawls while the loop runs. Here it runs in a
separate process (in the spirit of ``torch.distributed.checkpoint``'s process-based
``async_save``):

- the process is started once (the first async save of an ``AsyncSaves``, or a
  ``CheckpointManager(async_save=True)``'s construction) and reused by every later save; it is
  closed by ``close()``, at interpreter exit, or when the training process dies (a watchdog
  ends it within a second, mid-save too: nothing is committed after the training process died);
- the staging buffers live in shared memory (moved there once, then reused: later snapshots copy
  straight into them); each buffer's file descriptor is sent to the writer once
  (``SCM_RIGHTS``), and a save's job names the buffers it uses by number, so a save pickles only
  its metadata, never tensor bytes;
- the writer processes of the ranks form their own gloo world (a ``TCPStore`` served by rank 0's
  training process, on ``MASTER_ADDR``): the collectives of a save (listing, plan, the agreement
  that every rank wrote, the commit and its last agreement) run between the writers, exactly the
  code a synchronous save runs, and the commit happens as soon as the last rank's bytes are
  durable, whatever the training does meanwhile;
- a job's error is pickled back with its type and message (or, when the error cannot be pickled,
  a ``UnickptError`` naming its type, message and traceback); a writer that dies mid-save (killed,
  out of memory) is reported by every rank's ``wait()``: the dead rank's own driver sees the end of
  its connection and names the signal, the others' writers fail in their next collective with the
  dead peer. Nothing half-written is committed (the commit is the last step of the save, after the
  agreement); a writer may die after the commit, before it answered: ``wait()`` then checks the
  store and says whether this save's checkpoint was committed (complete) or not (the previous
  one untouched). The next save finds a writer missing or broken on some rank (one exchange over the
  training's group, :meth:`WriterProcess.ensure`) and starts a new world of writers; an error
  that every rank agreed on (the save engine's agreements) leaves the world in step, reused;
- the writer runs at the training process's own scheduling priority (no ``nice``): it needs
  little CPU (a 241 MB save: about 0.2 s, the rest is the disk), and in the training's
  scheduling group (Linux autogroups: one per session) a writer at ``nice`` +10 gets a tenth of
  a core the training keeps busy, so the save waited on the run queue for 10 to 20 times its
  running time (``/proc/<pid>/schedstat``) and took 7x its idle duration, while the training
  lost as much time to it as at equal priority, only spread over longer (docs/performance.md,
  the async section).

The training process still runs one thread per save in flight (``io/async_save.py``): it sends
the job and blocks on the reply (the GIL released), then runs the little that must stay in the
training process (releasing the save lock, rank 0's ``after`` callback).

A store that lives only in this process (``memory://``, or an fsspec protocol registered at run
time by this process) cannot be reached from another process: :func:`~unickpt.store.storage.process_reachable` says so,
and such a save is written by a thread of this process, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import recvfds, sendfds
from typing import Any

import torch

from unickpt import _dist, _faults
from unickpt._logging import get_logger
from unickpt.errors import UnickptError

__all__ = ["WriterProcess", "WriterDiedError", "share_buffers"]

logger = get_logger(__name__)

# SCM_RIGHTS carries at most 253 descriptors per message (SCM_MAX_FD).
_FDS_PER_MESSAGE = 200
# How long a writer waits for the other ranks' writers to join its world.
_JOIN_TIMEOUT = datetime.timedelta(minutes=10)


class WriterDiedError(UnickptError):
    """The writer process of an async save ended before it answered (killed, out of memory...)."""


# ---------------------------------------------------------------------------- shared buffers
def _pin(t: torch.Tensor) -> None:
    from torch.cuda import _pin_memory_utils

    ptr, n = t.data_ptr(), t.untyped_storage().nbytes()
    _pin_memory_utils.pin_memory(ptr, n)
    weakref.finalize(t.untyped_storage(), _pin_memory_utils.unpin_memory, ptr)


def share_buffers(staging: dict[Any, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Move every staging buffer not yet in shared memory there; returns {id(old): new}.

    A buffer in ordinary memory moves in place (the tensors viewing it follow). A pinned
    buffer (a snapshot of CUDA tensors) is replaced by a shared one registered with CUDA
    (``cudaHostRegister``, as ``torch.distributed.checkpoint`` pins its shared staging), under
    the same key: the caller swaps it into the payload it just snapshotted. Later snapshots
    copy straight into the shared buffers.
    """
    moved: dict[int, torch.Tensor] = {}
    for key, buf in list(staging.items()):
        if buf.device.type != "cpu" or buf.untyped_storage().is_shared():
            continue
        if buf.is_pinned():
            new = torch.empty_like(buf, pin_memory=False)
            new.untyped_storage()._share_fd_cpu_()
            _pin(new)
            new.copy_(buf)
            staging[key] = new
            moved[id(buf)] = new
        else:
            buf.untyped_storage()._share_fd_cpu_()
    return moved


class _Sender(pickle.Pickler):
    """Pickles a job; a tensor viewing a staging buffer goes by reference to it (sent once, by
    number), a placeholder (a ``meta`` tensor: a slice another rank writes, a live tensor known by
    its shape and dtype) by its shape, strides and dtype; any other tensor by value (a copy taken
    now: the writer never reads live memory).

    A ``reducer_override``, not a ``persistent_id``: the pickler asks it of the objects it does
    not pickle itself only (not of every int, string and tuple of a payload's slices), which
    halves the time a save's job takes to pickle."""

    def __init__(self, file: io.BytesIO, registry: _Registry, buffers: set[int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.registry = registry
        self.buffers = buffers

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return NotImplemented
        if obj.device.type == "meta" and type(obj) is torch.Tensor and not obj.requires_grad:
            return _meta_tensor, (tuple(obj.shape), tuple(obj.stride()), str(obj.dtype))
        if obj.device.type != "cpu" or obj.untyped_storage().data_ptr() not in self.buffers:
            return NotImplemented
        token = self.registry.token(obj.untyped_storage())
        return _shared_tensor, (
            token,
            obj.storage_offset(),
            tuple(obj.shape),
            tuple(obj.stride()),
            str(obj.dtype),
        )


@dataclasses.dataclass
class _Prepared:
    """A job pickled for the writer, and the shared buffers it is the first to use."""

    data: bytes
    new: list[tuple[int, torch.UntypedStorage]]


class _Registry:
    """The training side's shared buffers known to the writer, by number; those new in this job."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[int, torch.UntypedStorage]] = {}  # data_ptr -> (token, storage)
        self.next = 0
        self.used: set[int] = set()
        self.new: list[tuple[int, torch.UntypedStorage]] = []

    def token(self, st: torch.UntypedStorage) -> int:
        key = st.data_ptr()
        hit = self.known.get(key)
        if hit is None or hit[1].nbytes() != st.nbytes():
            hit = (self.next, st)
            self.next += 1
            self.known[key] = hit
            self.new.append(hit)
        self.used.add(hit[0])
        return hit[0]

    def end_job(self) -> None:
        """Forget the buffers this job did not use (the writer does the same)."""
        self.known = {k: v for k, v in self.known.items() if v[0] in self.used}
        self.used = set()
        self.new = []


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."))
    if not isinstance(dt, torch.dtype):  # pragma: no cover - the sender wrote str(a dtype)
        raise UnickptError(f"internal: {name!r} is not a torch dtype")
    return dt


class _Receiver(pickle.Unpickler):
    """Unpickles a job in the writer: its tensors viewing staging buffers view the shared
    storages received (``cache``, by number); :attr:`used` says which numbers it used."""

    def __init__(self, file: io.BytesIO, cache: dict[int, torch.UntypedStorage]) -> None:
        super().__init__(file)
        self.cache = cache
        self.used: set[int] = set()

    def load(self) -> Any:
        _RECEIVING.append(self)
        try:
            return super().load()
        finally:
            _RECEIVING.pop()


# The receiver loading now (the writer's one thread): where ``_shared_tensor`` finds the storages.
_RECEIVING: list[_Receiver] = []


def _meta_tensor(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> torch.Tensor:
    """A placeholder, rebuilt in the writer."""
    return torch.empty_strided(shape, stride, dtype=_dtype(dtype), device="meta")


def _shared_tensor(
    token: int, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: str
) -> torch.Tensor:
    """A tensor viewing the staging buffer numbered ``token``, rebuilt in the writer."""
    if not _RECEIVING:
        raise UnickptError("internal: a tensor viewing a staging buffer unpickled outside a writer's job")
    receiver = _RECEIVING[-1]
    receiver.used.add(token)
    t = torch.empty(0, dtype=_dtype(dtype))
    t.set_(receiver.cache[token], offset, shape, stride)
    return t


# ---------------------------------------------------------------------------- training side
class WriterProcess:
    """This rank's writer process: started once, reused by every save, closed by :meth:`close`."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._store: Any = None  # rank 0: the TCPStore the writers meet through
        self._registry = _Registry()
        self._broken = False
        self._generation = 0
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not self._broken

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def ensure(self, group: Any) -> None:
        """Collective over ``group``: every rank has a live writer, all in one world.

        One exchange (every rank's health) per call; when some rank's writer is missing or
        broken (never started, killed, its world broken by a failed save), every rank starts a
        new one and the new writers form a new world.
        """
        if self._exchange(group, None, "starting the async save writers"):
            self._restart(group)

    def prepare(
        self, group: Any, job: Callable[[Any], Any], what: str, buffers: Iterable[torch.Tensor]
    ) -> _Prepared:
        """Collective over ``group``, in the foreground of a save: ``job`` pickled for the writer.

        ``buffers``: the staging buffers (in shared memory, :func:`share_buffers`) the job's
        tensors may view: those go by reference, every other tensor by value.

        One exchange: a rank whose job cannot be pickled makes every rank raise (no writer is
        left waiting in a collective for a job that never comes), and writers are (re)started
        as :meth:`ensure` does. Pickling takes the job's metadata only: shared buffers go by
        number.
        """
        err: BaseException | None = None
        prepared: _Prepared | None = None
        shared = {st.data_ptr() for st in (t.untyped_storage() for t in buffers) if st.is_shared()}
        try:
            prepared = self._pickle(job, shared)
        except BaseException as e:
            err = e
        if self._exchange(group, err, what):
            self._restart(group)
            prepared = self._pickle(job, shared)
        if prepared is None:  # pragma: no cover - the exchange raised
            raise RuntimeError("internal: no job after a successful exchange")
        return prepared

    def _pickle(self, job: Callable[[Any], Any], buffers: set[int]) -> _Prepared:
        buf = io.BytesIO()
        _Sender(buf, self._registry, buffers).dump((job, _faults.armed()))
        new = self._registry.new
        self._registry.end_job()
        return _Prepared(buf.getvalue(), new)

    def _exchange(self, group: Any, err: BaseException | None, what: str) -> bool:
        """Collective: agree on ``err``; whether the writers must be restarted (on every rank alike)."""
        states = _dist.agree_gather(err, (self.alive, self._generation), what, group)
        return not (all(h for h, _ in states) and len({g for _, g in states}) == 1)

    def _restart(self, group: Any) -> None:
        """Collective over ``group``: stop this rank's writer, start a new one in a new world."""
        generation = max(_dist.all_gather_object(self._generation, group)) + 1
        self.close()
        rank, world = _dist.rank(group), _dist.world_size(group)
        host, port = "", 0
        if _dist.is_distributed(group):
            if rank == 0:
                from torch.distributed import TCPStore  # type: ignore[attr-defined]

                host = os.environ.get("MASTER_ADDR", "127.0.0.1")
                self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_JOIN_TIMEOUT)
                port = int(self._store.port)
            host, port = _dist.all_gather_object((host, port), group)[0]
        self._spawn(rank, world, host, port, generation)

    def _spawn(self, rank: int, world: int, host: str, port: int, generation: int) -> None:
        parent, child = Pipe(duplex=True)
        cmd = [
            sys.executable,
            "-c",
            "from unickpt.io.writer_process import _main; _main()",
            str(child.fileno()),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._conn = parent
        self._registry = _Registry()
        self._broken = False
        self._generation = generation
        parent.send(("init", rank, world, host, port, generation, os.getpid()))
        logger.debug("started the writer process %d (rank %d of %d)", self._proc.pid, rank, world)

    def run(self, job: _Prepared, what: str, outcome: Callable[[], str]) -> Any:
        """Run a prepared job in the writer; its result, or its error raised.

        Called by the thread of a save in flight; blocks (the GIL released) until the writer answers.
        ``outcome()``: what the store holds where this save commits, asked when the writer died
        before answering (it may die after the commit): ``"committed"`` (this save's checkpoint),
        ``"untouched"`` (what was there before the save) or ``"removed"`` (a save in place had
        removed the previous commit point, not yet put its own); the error says which.
        """
        with self._lock:
            conn, proc = self._conn, self._proc
            if conn is None or proc is None:
                raise WriterDiedError(f"{what}: no writer process (closed before the save started)")
            try:
                fds = [st._share_fd_cpu_()[0] for _, st in job.new]
                conn.send(("buffers", [(tok, st.nbytes()) for tok, st in job.new]))
                if fds:
                    sock = socket.socket(fileno=os.dup(conn.fileno()))
                    try:
                        for i in range(0, len(fds), _FDS_PER_MESSAGE):
                            sendfds(sock, fds[i : i + _FDS_PER_MESSAGE])
                    finally:
                        sock.close()
                conn.send_bytes(job.data)
                reply = conn.recv()
            except (EOFError, OSError) as e:
                self._broken = True
                raise WriterDiedError(f"{what}: {self._death(proc, outcome)}") from e
        status, payload, broken, hits, trace = reply
        _faults.count(hits, trace)
        if status == "ok":
            return payload
        if broken:
            # A collective between the writers failed (a peer died or timed out): their world
            # may be out of step, the next save starts a new one. Any other error was agreed
            # by every rank at the same collective (the save engine's protocol): the world is
            # in step and is reused.
            self._broken = True
        raise payload

    def _death(self, proc: subprocess.Popen[bytes], outcome: Callable[[], str]) -> str:
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"killed by {name}"
        else:
            how = f"exited with status {code}"
        head = f"the writer process (pid {proc.pid}) {how}"
        tail = "and the next async save starts a new writer"
        try:
            state = outcome()
        except Exception as e:  # the store cannot be read now: say so, do not guess
            return (
                f"{head} before it answered; whether this save was committed could not be checked "
                f"({type(e).__name__}: {e}), {tail}"
            )
        if state == "committed":
            return (
                f"{head} after the save was committed; this save's checkpoint was committed before the "
                f"writer died (complete: it loads), {tail}"
            )
        if state == "removed":
            return (
                f"{head} before the save was committed; nothing of this save was committed, and the "
                "previous checkpoint there is no longer committed either (the save was replacing it in "
                f"place and had removed its index: the location loads as no checkpoint), {tail}"
            )
        return (
            f"{head} before the save was committed; nothing of this save was committed (the previous "
            f"checkpoint is untouched), {tail}"
        )

    def close(self) -> None:
        """Stop the writer (after the job it is running, if any); idempotent."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("close",))
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._store = None


# ---------------------------------------------------------------------------- writer side
def _die_with_parent(parent: int) -> None:
    """End this process within a second of the training process's death, even mid-save.

    A save whose training process died must not commit later: the save lock was that
    process's, and a restarted job may be saving into the same directory. (Not
    ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the writer ends.)
    """

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="unickpt-writer-watchdog", daemon=True).start()


def _peer_failed(e: BaseException) -> bool:
    """Whether ``e`` comes from a collective that failed (a peer writer died or timed out), not
    from an error the ranks agreed on: torch's own ``RuntimeError``, or the ``DistributedError``
    that ``_dist`` makes of it (raised from it)."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if type(err) is RuntimeError:
            return True
        err = err.__cause__ or err.__context__
    return False


def _reply_error(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a ``UnickptError`` carrying its type, message and traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        text = "".join(traceback.format_exception(e))
        return UnickptError(f"{type(e).__name__}: {e} (in the writer process; traceback:\n{text})")


def _main() -> None:
    conn = Connection(int(sys.argv[1]))
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the training process, which finishes the save
    msg = conn.recv()
    _, rank, world, host, port, generation, parent = msg
    _die_with_parent(parent)
    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist

        store = dist.PrefixStore(  # type: ignore[attr-defined]
            f"unickpt-writers-{generation}",
            dist.TCPStore(host, port, is_master=False, timeout=_JOIN_TIMEOUT),  # type: ignore[attr-defined]
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_JOIN_TIMEOUT)
    cache: dict[int, torch.UntypedStorage] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "close":
            break
        _, new = msg  # ("buffers", [(token, nbytes)])
        if new:
            sock = socket.socket(fileno=os.dup(conn.fileno()))
            fds: list[int] = []
            try:
                while len(fds) < len(new):
                    fds.extend(recvfds(sock, min(_FDS_PER_MESSAGE, len(new) - len(fds))))
            finally:
                sock.close()
            for (token, nbytes), fd in zip(new, fds, strict=True):
                try:
                    cache[token] = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
                finally:
                    os.close(fd)
        data = conn.recv_bytes()
        before = dict(_faults.hits)
        _faults.take_trace()
        try:
            receiver = _Receiver(io.BytesIO(data), cache)
            fn, armed = receiver.load()
            for token in [t for t in cache if t not in receiver.used]:  # as the training side forgets them
                del cache[token]
            with _faults.armed_as(armed):
                result = fn(None)
            reply: tuple[Any, ...] = ("ok", result, False)
        except BaseException as e:  # reported to the training process's wait()
            reply = ("err", _reply_error(e), _peer_failed(e))
        hits = {k: v - before.get(k, 0) for k, v in _faults.hits.items() if v != before.get(k, 0)}
        reply = (*reply, hits, _faults.take_trace())
        try:
            conn.send(reply)
        except (OSError, EOFError):
            break
    conn.close()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
