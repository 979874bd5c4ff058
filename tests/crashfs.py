"""Crash states of a local file system, ALICE / CrashMonkey style: record, then enumerate.

:class:`Recorder` wraps the os-level calls unickpt makes (``os.open``/``write``/``pwrite``/
``pwritev``/``ftruncate``/``fsync``/``fdatasync``/``rename``/``replace``/``unlink``/``mkdir``/
``rmdir``/``link``/``symlink``/``copy_file_range``, ``open()`` for writing and the file object's
writes, flushes and truncates, ``renameat2(RENAME_EXCHANGE)`` through
``store.publish.exchange``) while one save runs in this process, and keeps a log of logical
operations on a shadow model of the tree under ``root``: inodes (identified by the real inode
numbers, fresh ids when a number is reused) with their data, directories with their entries.
At the end the model's volatile state is compared with the real tree byte for byte, so a call
the recorder missed fails the test instead of going unseen.

The file-system model (weaker than ext4 ``data=ordered``, as POSIX allows):

- a file's data is durable up to its last ``fsync``/``fdatasync``; the data operations after it
  (writes, truncates) may persist as any prefix, a prefix whose next write is torn (its first
  half persisted), or all of them but one (a dropped write: a hole of zeros where it extended
  the file);
- bytes written through a buffered file object reach the kernel on ``flush``/``close`` only: an
  ``fsync`` without a flush does not make them durable;
- a directory's entries (create, link, unlink, rmdir, rename, exchange) are durable up to the
  last ``fsync`` of that directory; later entry operations persist as any prefix of them, or as
  a prefix with one of its operations dropped; a file's ``fsync`` does not persist its name;
- directories are independent of each other and of file data (no ordering between them);
- a rename or an exchange within one directory is atomic (old names or new names).

A crash state after the first ``k`` operations picks one of those outcomes for every file and
directory with operations not yet durable. :func:`crash_states` enumerates them: the product
of the choices when it is at most ``cap``, otherwise every state that varies one object with
the others all lost or all persisted, plus ``cap`` random combinations.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import itertools
import os
import random
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------------------- the log

# A data op: ("w", offset, bytes) or ("t", size). An entry op on one directory: a tuple of
# (name, inode id or None) assignments applied together (None removes the name).
DataOp = tuple[Any, ...]
EntryOp = tuple[tuple[str, int | None], ...]


@dataclass
class Inode:
    kind: str  # "f", "d" or "l"
    data: bytes = b""  # file: durable data at the start; symlink: target
    entries: dict[str, int] = field(default_factory=dict)  # directory: durable entries at the start


@dataclass
class Op:
    what: str  # "data", "entry", "fsync", "dsync", "new"
    ino: int
    arg: Any = None
    label: str = ""
    link: int | None = None  # a rename across directories: its two halves share this id


def _apply_data(buf: bytearray, op: DataOp, torn: bool = False) -> None:
    if op[0] == "t":
        size = op[1]
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(bytes(size - len(buf)))
        return
    _, off, data = op
    if torn:
        data = data[: len(data) // 2]
    if len(buf) < off:
        buf.extend(bytes(off - len(buf)))
    buf[off : off + len(data)] = data


def _apply_entries(ents: dict[str, int], op: EntryOp) -> None:
    for name, ino in op:
        if ino is None:
            ents.pop(name, None)
        else:
            ents[name] = ino


class Recorder:
    """Records the file-system operations of the code run inside :meth:`recording` under ``root``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.inodes: dict[int, Inode] = {}
        self.paths: dict[int, str] = {}
        self.log: list[Op] = []
        self._ids: dict[int, int] = {}  # real st_ino -> model id
        self._next = 0
        self._fds: dict[int, int] = {}  # fd -> model id (files and directories under root)
        self.root_id = self._snapshot_tree()
        self.missed_flushes: list[str] = []
        self.cross_dir_renames: list[str] = []
        self._links = 0

    # -- the initial tree: durable
    def _new_id(self, st_ino: int, inode: Inode, path: str = "") -> int:
        self._next += 1
        self.paths[self._next] = os.path.relpath(path, self.root) if path else "?"
        self._ids[st_ino] = self._next
        self.inodes[self._next] = inode
        return self._next

    def _snapshot_tree(self) -> int:
        def walk(path: str) -> int:
            st = os.lstat(path)
            if st.st_ino in self._ids:  # a hard link
                return self._ids[st.st_ino]
            if stat.S_ISLNK(st.st_mode):
                return self._new_id(st.st_ino, Inode("l", os.readlink(path).encode()), path)
            if stat.S_ISDIR(st.st_mode):
                ino = self._new_id(st.st_ino, Inode("d"), path)
                ents = {n: walk(os.path.join(path, n)) for n in sorted(os.listdir(path))}
                self.inodes[ino].entries = ents
                return ino
            with _real_open(path, "rb") as f:
                return self._new_id(st.st_ino, Inode("f", f.read()), path)

        return walk(self.root)

    # -- helpers
    def _under(self, path: str) -> str | None:
        if os.path.realpath(path) == self.root:
            return self.root
        p = os.path.realpath(os.path.dirname(os.path.abspath(path)))
        if p == self.root or p.startswith(self.root + os.sep):
            return os.path.join(p, os.path.basename(os.path.abspath(path)))
        return None

    def _path(self, path: Any, dir_fd: int | None) -> str:
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        return p

    def _dir_id(self, path: str) -> int:
        st = os.lstat(os.path.dirname(path))
        return self._ids[st.st_ino]

    def _id_of(self, path: str) -> int | None:
        try:
            return self._ids.get(os.lstat(path).st_ino)
        except FileNotFoundError:
            return None

    def _entry(self, path: str, ino: int | None, label: str) -> None:
        self.log.append(Op("entry", self._dir_id(path), ((os.path.basename(path), ino),), label))

    def _created(self, path: str, kind: str, data: bytes = b"") -> int:
        st = os.lstat(path)
        ino = self._new_id(st.st_ino, Inode(kind, data), path)
        self.log.append(Op("new", ino, kind, f"new {kind} {self.rel(path)}"))
        self._entry(path, ino, f"create {self.rel(path)}")
        return ino

    def inodes_label(self, ino: int) -> str:
        """The path under which the inode was first seen (for messages)."""
        return self.paths.get(ino, f"inode {ino}")

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def data(self, ino: int, op: DataOp, label: str) -> None:
        self.log.append(Op("data", ino, op, label))

    # -- the wrappers
    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorder]:
        saved: list[tuple[Any, str, Any]] = []

        def patch(mod: Any, name: str, fn: Callable[..., Any]) -> None:
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, fn)

        rec = self
        real = {n: getattr(os, n) for n in _OS_NAMES if hasattr(os, n)}

        def os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            p = rec._path(path, dir_fd)
            full = rec._under(p) if isinstance(path, (str, bytes, os.PathLike)) else None
            existed = full is not None and os.path.lexists(full)
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if full is None:
                return fd
            if not existed and flags & os.O_CREAT:
                rec._fds[fd] = rec._created(full, "f")
            else:
                ino = rec._ids.get(os.fstat(fd).st_ino)
                if ino is not None:
                    rec._fds[fd] = ino
                    if flags & os.O_TRUNC and rec.inodes[ino].kind == "f":
                        rec.data(ino, ("t", 0), f"truncate {rec.rel(full)}")
            return fd

        def os_write(fd: int, data: Any) -> int:
            pos = os.lseek(fd, 0, os.SEEK_CUR) if fd in rec._fds else 0
            n: int = real["write"](fd, data)
            if fd in rec._fds:
                if os.fstat(fd).st_size == pos + n and _fd_flags(fd) & os.O_APPEND:
                    pos = os.fstat(fd).st_size - n
                rec.data(rec._fds[fd], ("w", pos, bytes(memoryview(data).cast("B")[:n])), f"write fd{fd}")
            return n

        def os_pwrite(fd: int, data: Any, offset: int) -> int:
            n: int = real["pwrite"](fd, data, offset)
            if fd in rec._fds:
                rec.data(rec._fds[fd], ("w", offset, bytes(memoryview(data).cast("B")[:n])), f"pwrite fd{fd}")
            return n

        def os_pwritev(fd: int, buffers: Any, offset: int, *a: Any) -> int:
            n: int = real["pwritev"](fd, buffers, offset, *a)
            if fd in rec._fds:
                blob = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:n]
                rec.data(rec._fds[fd], ("w", offset, blob), f"pwritev fd{fd}")
            return n

        def os_writev(fd: int, buffers: Any) -> int:
            pos = os.lseek(fd, 0, os.SEEK_CUR) if fd in rec._fds else 0
            n: int = real["writev"](fd, buffers)
            if fd in rec._fds:
                blob = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:n]
                rec.data(rec._fds[fd], ("w", pos, blob), f"writev fd{fd}")
            return n

        def os_copy_file_range(
            src: int, dst: int, count: int, offset_src: Any = None, offset_dst: Any = None
        ) -> int:
            pos = offset_dst if offset_dst is not None else os.lseek(dst, 0, os.SEEK_CUR)
            n: int = real["copy_file_range"](src, dst, count, offset_src, offset_dst)
            if dst in rec._fds and n > 0:
                rec.data(rec._fds[dst], ("w", pos, os.pread(dst, n, pos)), f"copy_file_range fd{dst}")
            return n

        def os_ftruncate(fd: int, length: int) -> None:
            real["ftruncate"](fd, length)
            if fd in rec._fds:
                rec.data(rec._fds[fd], ("t", length), f"ftruncate fd{fd}")

        def os_truncate(path: Any, length: int) -> None:
            if isinstance(path, int):
                return os_ftruncate(path, length)
            real["truncate"](path, length)
            full = rec._under(os.fsdecode(path))
            if full is not None and (ino := rec._id_of(full)) is not None:
                rec.data(ino, ("t", length), f"truncate {rec.rel(full)}")
            return None

        def os_fsync(fd: Any) -> None:
            if not isinstance(fd, int):
                fd = fd.fileno()
            real["fsync"](fd)
            ino = rec._fds.get(fd)
            if ino is None:
                return
            pending = _PENDING.get(fd)
            if pending:  # a buffered file object's writes not flushed yet: not in the kernel
                rec.missed_flushes.append(f"fsync of fd {fd} with {len(pending)} unflushed writes")
            rec.log.append(
                Op("dsync" if rec.inodes[ino].kind == "d" else "fsync", ino, None, f"fsync fd{fd}")
            )

        def os_close(fd: int) -> None:
            real["close"](fd)
            rec._fds.pop(fd, None)

        def os_rename(src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None) -> None:
            s, d = rec._path(src, src_dir_fd), rec._path(dst, dst_dir_fd)
            fs, fd_ = rec._under(s), rec._under(d)
            ino = rec._id_of(fs) if fs else None
            real["rename"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            if fs is None and fd_ is None:
                return
            assert fs is not None and fd_ is not None, f"rename across the recorded root: {s} -> {d}"
            if os.path.dirname(fs) == os.path.dirname(fd_):
                op = ((os.path.basename(fs), None), (os.path.basename(fd_), ino))
                rec.log.append(Op("entry", rec._dir_id(fd_), op, f"rename {rec.rel(fs)} -> {rec.rel(fd_)}"))
            else:  # one operation on two directories: both halves persist together
                rec.cross_dir_renames.append(f"{rec.rel(fs)} -> {rec.rel(fd_)}")
                rec._links += 1
                for half, target, lab in ((fd_, ino, "rename-in"), (fs, None, "rename-out")):
                    op = ((os.path.basename(half), target),)
                    rec.log.append(Op("entry", rec._dir_id(half), op, f"{lab} {rec.rel(half)}", rec._links))

        def os_unlink(path: Any, *, dir_fd: Any = None) -> None:
            p = rec._path(path, dir_fd)
            full = rec._under(p)
            real["unlink"](path, dir_fd=dir_fd)
            if full is not None:
                rec._entry(full, None, f"unlink {rec.rel(full)}")

        def os_rmdir(path: Any, *, dir_fd: Any = None) -> None:
            p = rec._path(path, dir_fd)
            full = rec._under(p)
            real["rmdir"](path, dir_fd=dir_fd)
            if full is not None:
                rec._entry(full, None, f"rmdir {rec.rel(full)}")

        def os_mkdir(path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
            p = rec._path(path, dir_fd)
            full = rec._under(p)
            real["mkdir"](path, mode, dir_fd=dir_fd)
            if full is not None:
                rec._created(full, "d")

        def os_link(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            real["link"](src, dst, *a, **k)
            full = rec._under(os.fsdecode(dst))
            if full is not None:
                rec._entry(full, rec._id_of(full), f"link {rec.rel(full)}")

        def os_symlink(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            real["symlink"](src, dst, *a, **k)
            full = rec._under(os.fsdecode(dst))
            if full is not None:
                rec._created(full, "l", os.fsencode(src))

        for n, fn in (
            ("open", os_open),
            ("write", os_write),
            ("pwrite", os_pwrite),
            ("pwritev", os_pwritev),
            ("writev", os_writev),
            ("copy_file_range", os_copy_file_range),
            ("ftruncate", os_ftruncate),
            ("truncate", os_truncate),
            ("fsync", os_fsync),
            ("fdatasync", os_fsync),
            ("close", os_close),
            ("rename", os_rename),
            ("replace", os_rename),
            ("unlink", os_unlink),
            ("remove", os_unlink),
            ("rmdir", os_rmdir),
            ("mkdir", os_mkdir),
            ("link", os_link),
            ("symlink", os_symlink),
        ):
            if n in real:
                patch(os, n, fn)
        # os.makedirs and shutil call the os functions above through the module.
        for n in ("sendfile", "posix_fallocate", "fchmod"):
            if n in real:

                def refuse(*a: Any, _n: str = n, **k: Any) -> Any:
                    raise AssertionError(f"the crash recorder does not model os.{_n}")

                if n != "fchmod":
                    patch(os, n, refuse)

        def opener(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
            writing = any(c in mode for c in "wax+")
            if isinstance(file, int) or not writing:
                return _real_open(file, mode, *a, **k)
            full = rec._under(os.fsdecode(file))
            if full is None:
                return _real_open(file, mode, *a, **k)
            existed = os.path.lexists(full)
            f = _real_open(file, mode, *a, **k)
            if not existed:
                ino = rec._created(full, "f")
            else:
                ino = rec._ids[os.fstat(f.fileno()).st_ino]
                if "w" in mode:
                    rec.data(ino, ("t", 0), f"truncate {rec.rel(full)}")
            rec._fds[f.fileno()] = ino
            return _RecFile(f, rec, ino, rec.rel(full))

        patch(builtins, "open", opener)
        patch(io, "open", opener)

        import unickpt.store.publish as commit_steps

        real_exchange = commit_steps.exchange

        def exchange(a: str, b: str) -> bool:
            fa, fb = rec._under(a), rec._under(b)
            ia, ib = (rec._id_of(fa) if fa else None), (rec._id_of(fb) if fb else None)
            if not real_exchange(a, b):
                return False
            assert fa and fb and os.path.dirname(fa) == os.path.dirname(fb), (a, b)
            op = ((os.path.basename(fa), ib), (os.path.basename(fb), ia))
            rec.log.append(Op("entry", rec._dir_id(fa), op, f"exchange {rec.rel(fa)} <-> {rec.rel(fb)}"))
            return True

        patch(commit_steps, "exchange", exchange)
        try:
            yield self
        finally:
            for mod, name, orig in reversed(saved):
                setattr(mod, name, orig)

    # -- replay
    def replay(self, upto: int) -> Model:
        m = Model(self)
        for op in self.log[:upto]:
            m.step(op)
        return m

    def check_against_disk(self) -> None:
        """The model's volatile tree after the whole log equals the real tree under ``root``."""
        model = materialised_tree(self.replay(len(self.log)).volatile_choice())
        disk = read_tree(self.root)
        if model != disk:
            diff = sorted(k for k in set(model) | set(disk) if model.get(k) != disk.get(k))
            raise AssertionError(f"the recorder missed operations: paths differ {diff[:10]}")


_OS_NAMES = [
    "open",
    "write",
    "pwrite",
    "pwritev",
    "writev",
    "copy_file_range",
    "ftruncate",
    "truncate",
    "fsync",
    "fdatasync",
    "close",
    "rename",
    "replace",
    "unlink",
    "remove",
    "rmdir",
    "mkdir",
    "link",
    "symlink",
    "sendfile",
    "posix_fallocate",
    "fchmod",
]
_real_open = builtins.open
_PENDING: dict[int, list[DataOp]] = {}  # fd -> writes of a buffered file object not flushed yet


def _fd_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


class _RecFile:
    """A file object opened for writing: its writes reach the model's kernel on flush/close."""

    def __init__(self, f: Any, rec: Recorder, ino: int, rel: str) -> None:
        self._f, self._rec, self._ino, self._rel = f, rec, ino, rel
        self._fd = f.fileno()
        _PENDING[self._fd] = []

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B") if not isinstance(data, str) else None
        pos = self._f.tell()
        n: int = self._f.write(data)
        self._f.flush()  # the real file holds what the model's kernel will: see _flush_model
        blob = bytes(mv[:n]) if mv is not None else data[:n].encode()
        if "a" in self._f.mode:
            pos = os.fstat(self._fd).st_size - len(blob)
        _PENDING[self._fd].append(("w", pos, blob))
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def _flush_model(self) -> None:
        for op in _PENDING.get(self._fd, []):
            self._rec.data(self._ino, op, f"write {self._rel}")
        if self._fd in _PENDING:
            _PENDING[self._fd] = []

    def flush(self) -> None:
        self._f.flush()
        self._flush_model()

    def truncate(self, size: int | None = None) -> int:
        self._flush_model()
        n: int = self._f.truncate(size)
        self._rec.data(self._ino, ("t", n), f"truncate {self._rel}")
        return n

    def close(self) -> None:
        if not self._f.closed:
            self._flush_model()
            _PENDING.pop(self._fd, None)
            self._rec._fds.pop(self._fd, None)
        self._f.close()

    def __enter__(self) -> _RecFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __iter__(self) -> Any:
        return iter(self._f)


# ----------------------------------------------------------------------------- the states
class Model:
    """The file system after a prefix of the log: durable state and what is not durable yet."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.kind = {i: n.kind for i, n in rec.inodes.items()}
        self.durable_data = {i: n.data for i, n in rec.inodes.items() if n.kind != "d"}
        self.pending_data: dict[int, list[DataOp]] = {}
        self.durable_ents = {i: dict(n.entries) for i, n in rec.inodes.items() if n.kind == "d"}
        self.pending_ents: dict[int, list[tuple[EntryOp, int | None]]] = {}
        self.link_dirs: dict[int, list[int]] = {}  # link id -> the directories holding its halves
        self.last = ""
        self._ev: dict[int, list[tuple[dict[str, int], frozenset[int]]]] = {}
        self._dv: dict[int, list[bytes]] = {}

    def step(self, op: Op) -> None:
        self.last = op.label
        self._ev.clear()
        self._dv.clear()
        if op.what == "new":
            if op.arg == "d":
                self.durable_ents[op.ino] = {}
            elif op.arg == "f":
                self.durable_data[op.ino] = b""
            # a symlink's target is written with its inode (Inode.data)
        elif op.what == "data":
            self.pending_data.setdefault(op.ino, []).append(op.arg)
        elif op.what == "entry":
            self.pending_ents.setdefault(op.ino, []).append((op.arg, op.link))
            if op.link is not None:
                self.link_dirs.setdefault(op.link, []).append(op.ino)
        elif op.what == "fsync":
            buf = bytearray(self.durable_data[op.ino])
            for d in self.pending_data.pop(op.ino, []):
                _apply_data(buf, d)
            self.durable_data[op.ino] = bytes(buf)
        elif op.what == "dsync":
            ents = self.durable_ents[op.ino]
            for e, link in self.pending_ents.pop(op.ino, []):
                _apply_entries(ents, e)
                # the other half of a cross-directory rename is in the same transaction
                for other in self.link_dirs.pop(link, []) if link is not None else []:
                    if other != op.ino and other in self.pending_ents:
                        q = self.pending_ents[other]
                        for i, (e2, l2) in enumerate(q):
                            if l2 == link:
                                _apply_entries(self.durable_ents[other], e2)
                                del q[i]
                                break
                        if not q:
                            del self.pending_ents[other]

    # A choice: {dir id: entry variant index, file id: data variant index}; absent = all persisted.
    def entry_variants(self, d: int) -> list[dict[str, int]]:
        return [e for e, _ in self.entry_variants_links(d)]

    def entry_variants_links(self, d: int) -> list[tuple[dict[str, int], frozenset[int]]]:
        """(entries, ids of the cross-directory renames persisted in them) of each variant."""
        if d not in self._ev:
            self._ev[d] = self._entry_variants(d)
        return self._ev[d]

    def data_variants(self, f: int) -> list[bytes]:
        if f not in self._dv:
            self._dv[f] = self._data_variants(f)
        return self._dv[f]

    def reachable_files(self) -> list[int]:
        """Files with data not durable yet that some crash state names."""
        named: set[int] = set()
        for d, ents in self.durable_ents.items():
            named.update(ents.values())
            if d in self.pending_ents:
                for e in self.entry_variants(d):
                    named.update(e.values())
        return sorted(f for f in self.pending_data if f in named and self.kind.get(f) == "f")

    def _entry_variants(self, d: int) -> list[tuple[dict[str, int], frozenset[int]]]:
        ops = self.pending_ents.get(d, [])
        out: list[tuple[dict[str, int], frozenset[int]]] = []
        seen: set[tuple[Any, ...]] = set()

        def add(sel: list[tuple[EntryOp, int | None]]) -> None:
            e = dict(self.durable_ents[d])
            for o, _ in sel:
                _apply_entries(e, o)
            links = frozenset(link for _, link in sel if link is not None)
            key = (tuple(sorted(e.items())), links)
            if key not in seen:
                seen.add(key)
                out.append((e, links))

        for k in range(len(ops), -1, -1):  # index 0: all persisted
            add(ops[:k])
        for k in range(len(ops), 1, -1):
            for j in range(k - 1):
                add(ops[:j] + ops[j + 1 : k])
        return out

    def _data_variants(self, f: int) -> list[bytes]:
        ops = self.pending_data.get(f, [])
        base = self.durable_data[f]
        out: list[bytes] = []
        seen: set[bytes] = set()

        def add(sel: list[tuple[DataOp, bool]]) -> None:
            buf = bytearray(base)
            for o, torn in sel:
                _apply_data(buf, o, torn)
            b = bytes(buf)
            if b not in seen:
                seen.add(b)
                out.append(b)

        for k in range(len(ops), -1, -1):  # index 0: all persisted
            add([(o, False) for o in ops[:k]])
            if k < len(ops) and ops[k][0] == "w":
                add([(o, False) for o in ops[:k]] + [(ops[k], True)])
        for j in range(len(ops) - 1):
            add([(o, False) for i, o in enumerate(ops) if i != j])
        return out

    def volatile_choice(self) -> State:
        return State(self, {}, {})


@dataclass
class State:
    model: Model
    ents: dict[int, int]  # dir id -> entry variant index (absent: 0, all persisted)
    data: dict[int, int]  # file id -> data variant index

    def entries(self, d: int) -> dict[str, int]:
        if d not in self.model.pending_ents:
            return self.model.durable_ents[d]
        return self.model.entry_variants(d)[self.ents.get(d, 0)]

    def content(self, f: int) -> bytes:
        if f not in self.model.pending_data:
            return self.model.durable_data[f]
        return self.model.data_variants(f)[self.data.get(f, 0)]


Tree = dict[str, tuple[str, bytes]]


def materialised_tree(state: State) -> Tree:
    """{relative path: (kind, bytes)} of a crash state, from the root down."""
    m = state.model
    out: Tree = {}

    def walk(d: int, rel: str) -> None:
        for name, ino in sorted(state.entries(d).items()):
            p = f"{rel}/{name}" if rel else name
            kind = m.kind[ino]
            if kind == "d":
                out[p] = ("d", b"")
                walk(ino, p)
            elif kind == "l":
                out[p] = ("l", m.rec.inodes[ino].data)
            else:
                out[p] = ("f", state.content(ino))

    walk(m.rec.root_id, "")
    return out


def read_tree(root: str) -> Tree:
    out: Tree = {}
    for dp, dns, fns in os.walk(root):
        for n in dns + fns:
            p = os.path.join(dp, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("l", os.fsencode(os.readlink(p)))
            elif os.path.isdir(p):
                out[rel] = ("d", b"")
            else:
                with _real_open(p, "rb") as f:
                    out[rel] = ("f", f.read())
    return out


def write_tree(tree: Tree, dest: str) -> None:
    os.makedirs(dest)
    for rel, (kind, blob) in sorted(tree.items()):
        p = os.path.join(dest, rel)
        if kind == "d":
            os.mkdir(p)
        elif kind == "l":
            os.symlink(os.fsdecode(blob), p)
        else:
            with _real_open(p, "wb") as f:
                f.write(blob)


def tree_key(tree: Tree) -> tuple[tuple[str, tuple[str, bytes]], ...]:
    """The tree itself, as a dict key (compared exactly; bytes hash once)."""
    return tuple(sorted(tree.items()))


def _children(tree: Tree) -> dict[str, list[tuple[str, str]]]:
    kids: dict[str, list[tuple[str, str]]] = {}
    for k, v in tree.items():
        parent, _, name = k.rpartition("/")
        kids.setdefault(parent or ".", []).append((name, v[0]))
    return kids


def crash_states(model: Model, cap: int, rng: random.Random) -> Iterator[State]:
    """The crash states of ``model`` (see the module docstring); yields each choice once."""
    dirs = sorted(model.pending_ents)
    # Files with data not durable that some entry variant can reach (only those matter).
    files = model.reachable_files()
    nvar = {("e", d): len(model.entry_variants(d)) for d in dirs}
    nvar.update({("d", f): len(model.data_variants(f)) for f in files})
    axes = [k for k, n in nvar.items() if n > 1]
    total = 1
    for k in axes:
        total *= nvar[k]
    seen: set[tuple[int, ...]] = set()

    def make(vec: tuple[int, ...]) -> State | None:
        if vec in seen:
            return None
        seen.add(vec)
        ents = {k[1]: v for k, v in zip(axes, vec, strict=True) if k[0] == "e"}
        data = {k[1]: v for k, v in zip(axes, vec, strict=True) if k[0] == "d"}
        if model.link_dirs and not _links_agree(model, ents):
            return None
        return State(model, ents, data)

    if total <= cap:
        for vec in itertools.product(*(range(nvar[k]) for k in axes)):
            if (s := make(vec)) is not None:
                yield s
        return
    lost = tuple(_lost_index(model, k) for k in axes)  # nothing of the pending operations persisted
    persisted = tuple(0 for _ in axes)
    for base in (persisted, lost):
        if (s := make(base)) is not None:
            yield s
        for i, k in enumerate(axes):
            for v in range(nvar[k]):
                vec = (*base[:i], v, *base[i + 1 :])
                if (s := make(vec)) is not None:
                    yield s
    for _ in range(cap):
        vec = tuple(rng.randrange(nvar[k]) for k in axes)
        if (s := make(vec)) is not None:
            yield s


def _lost_index(model: Model, axis: tuple[str, int]) -> int:
    kind, i = axis
    if kind == "d":
        return model.data_variants(i).index(model.durable_data[i])
    return [e for e, links in model.entry_variants_links(i)].index(model.durable_ents[i])


def _links_agree(model: Model, ents: dict[int, int]) -> bool:
    """Both halves of every pending cross-directory rename persisted, or neither."""
    chosen = {d: model.entry_variants_links(d)[ents.get(d, 0)][1] for d in model.pending_ents}
    for link, dirs in model.link_dirs.items():
        have = {link in chosen[d] for d in dirs if d in chosen}
        if len(have) > 1:
            return False
    return True


def product_size(model: Model) -> int:
    total = 1
    for d in model.pending_ents:
        total *= len(model.entry_variants(d))
    for f in model.reachable_files():
        total *= len(model.data_variants(f))
    return total


# ----------------------------------------------------------------------------- reading a state
class Observer:
    """Memoises a reader's verdict on a crash state by what the reader looked at.

    While the checker runs on a materialised state, every ``open``, ``stat``, ``lstat``,
    ``listdir`` and ``scandir`` of a path under the state's directory is noted (relative
    path -> what it saw: the file's bytes, its type and size, the names listed). A later state
    that shows the reader the same things gets the same verdict without running it (the reader
    is deterministic). Every ``recheck``-th hit is run anyway and must agree.
    """

    def __init__(self, recheck: int = 25) -> None:
        self.entries: list[tuple[dict[tuple[str, str], Any], str]] = []
        self.runs = 0
        self.hits = 0
        self.rechecks = 0
        self.recheck = recheck

    @staticmethod
    def _look(tree: Tree, what: str, rel: str, kids: dict[str, list[tuple[str, str]]] | None = None) -> Any:
        rel = os.path.normpath(rel)
        got = ("d", b"") if rel == "." else tree.get(rel)
        if what == "list":
            if got is None or got[0] != "d":
                return None
            if kids is None:
                kids = _children(tree)
            return tuple(sorted(kids.get(rel, [])))
        if got is None:
            return None
        if what == "open":
            return got  # the bytes themselves: compared exactly
        return (got[0], len(got[1]))

    def lookup(self, tree: Tree) -> str | None:
        kids = _children(tree)
        for seen, verdict in self.entries:
            if all(self._look(tree, w, r, kids) == v for (w, r), v in seen.items()):
                return verdict
        return None

    def run(self, tree: Tree, base: str, check: Callable[[str], str]) -> str:
        cached = self.lookup(tree)
        if cached is not None:
            self.hits += 1
            if self.hits % self.recheck != 0:
                return cached
            self.rechecks += 1
        write_tree(tree, base)
        seen: dict[tuple[str, str], Any] = {}
        real_base = os.path.realpath(base)
        real_stat, real_lstat, real_listdir, real_scandir = os.stat, os.lstat, os.listdir, os.scandir

        def note(what: str, path: Any) -> None:
            if isinstance(path, int):
                return
            p = os.path.abspath(os.fsdecode(path))
            if p in (real_base, base) or p.startswith(real_base + os.sep) or p.startswith(base + os.sep):
                rel = os.path.relpath(p, real_base if p.startswith(real_base) else base)
                seen.setdefault((what, rel), self._look(tree, what, rel))

        def audit(event: str, args: tuple[Any, ...]) -> None:
            if not _ACTIVE:
                return
            if event == "open" and args and args[0] is not None:
                note("open", args[0])
            elif event in ("os.listdir", "os.scandir") and args:
                note("list", args[0] if args[0] is not None else ".")

        def stat_(path: Any, *a: Any, **k: Any) -> Any:
            note("stat", path)
            return real_stat(path, *a, **k)

        def lstat_(path: Any, *a: Any, **k: Any) -> Any:
            note("stat", path)
            return real_lstat(path, *a, **k)

        _install_audit(audit)
        os.stat, os.lstat = stat_, lstat_  # type: ignore[assignment]
        _set_active(True)
        try:
            verdict = check(base)
        finally:
            _set_active(False)
            os.stat, os.lstat, os.listdir, os.scandir = real_stat, real_lstat, real_listdir, real_scandir  # type: ignore[assignment]
            shutil.rmtree(base, ignore_errors=True)
        self.runs += 1
        if cached is not None:
            assert verdict == cached, f"memoised verdict {cached!r} but the reader now says {verdict!r}"
            return verdict
        self.entries.append((seen, verdict))
        return verdict


_ACTIVE = False
_AUDIT: list[Callable[[str, tuple[Any, ...]], None]] = []


def _set_active(on: bool) -> None:
    global _ACTIVE
    _ACTIVE = on


def _install_audit(fn: Callable[[str, tuple[Any, ...]], None]) -> None:
    """One process-wide audit hook (they cannot be removed) dispatching to the current observer."""
    if not _AUDIT:

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if _ACTIVE and _AUDIT:
                _AUDIT[-1](event, args)

        sys.addaudithook(hook)
        _AUDIT.append(fn)
    _AUDIT[-1] = fn


# ----------------------------------------------------------------------------- the search
@dataclass
class Search:
    """What :func:`explore` saw: counts, and every verdict with one state that gave it."""

    name: str
    ops: int = 0
    states: int = 0  # crash states enumerated (all prefixes)
    distinct: int = 0  # distinct trees among them
    sampled_prefixes: int = 0  # prefixes whose product exceeded the cap (structured + random states)
    verdicts: dict[str, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)  # the first 20 failing states, described
    failing: dict[tuple[bool, str], int] = field(default_factory=dict)  # (save returned, verdict) -> states
    reader_runs: int = 0
    memo_hits: int = 0
    rechecks: int = 0

    def summary(self) -> str:
        return (
            f"{self.name}: {self.ops} ops, {self.states} crash states ({self.distinct} distinct trees, "
            f"{self.reader_runs} reader runs, {self.memo_hits} memo hits of which {self.rechecks} rerun and "
            f"agreed, {self.sampled_prefixes} sampled "
            f"prefixes): {dict(sorted(self.verdicts.items()))}"
        )


def explore(
    rec: Recorder,
    name: str,
    check: Callable[[str], str],
    allowed: Callable[[int, bool, str], bool],
    scratch: str,
    *,
    cap: int,
    seed: int = 0,
    recheck: int = 25,
) -> Search:
    """Every crash state after every prefix of ``rec``'s log, read by ``check(directory)``.

    ``allowed(k, final, verdict)``: whether ``verdict`` is acceptable after the first ``k``
    operations (``final``: the whole log, the save returned). Failing states are listed in
    ``Search.bad`` with the last operation before the crash.
    """
    rng = random.Random(seed)
    out = Search(name, ops=len(rec.log))
    obs = Observer(recheck)
    model = Model(rec)
    done: dict[tuple[Any, ...], str] = {}
    n = 0
    for k in range(len(rec.log) + 1):
        if k:
            model.step(rec.log[k - 1])
        if product_size(model) > cap:
            out.sampled_prefixes += 1
        for st in crash_states(model, cap, rng):
            out.states += 1
            tree = materialised_tree(st)
            key = tree_key(tree)
            verdict = done.get(key)
            if verdict is None:
                n += 1
                verdict = obs.run(tree, os.path.join(scratch, f"s{n}"), check)
                done[key] = verdict
            out.verdicts[verdict] = out.verdicts.get(verdict, 0) + 1
            final = k == len(rec.log)
            if not allowed(k, final, verdict):
                out.failing[(final, verdict)] = out.failing.get((final, verdict), 0) + 1
            if not allowed(k, final, verdict) and len(out.bad) < 20:
                desc = {rec.inodes_label(d): v for d, v in st.ents.items() if v}
                out.bad.append(
                    f"after op {k} ({model.last!r}){' [save returned]' if final else ''}: {verdict}; "
                    f"entry variants {desc}; files {sorted(st.data.items())}"
                )
    out.distinct = len(done)
    out.reader_runs, out.memo_hits, out.rechecks = obs.runs, obs.hits, obs.rechecks
    return out
