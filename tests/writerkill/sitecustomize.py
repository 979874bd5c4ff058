"""Test-only: SIGKILL an async save's writer process at its k-th file-system step.

The kill search (tests/unit/io/test_writer_process_kills.py) puts this directory first on
``sys.path``; the writer process's ``PYTHONPATH`` is built from it, so the writer imports this
module at start-up. It does nothing unless ``UNICKPT_TEST_WRITER_CONTROL`` names a control file.

Every os-level file-system call under ``UNICKPT_TEST_WRITER_ROOT`` (``os.open``/``write``/
``pwrite``/``pwritev``/``writev``/``ftruncate``/``fsync``/``fdatasync``/``rename``/``replace``/
``unlink``/``remove``/``mkdir``/``rmdir``/``link``/``symlink``/``copy_file_range``, ``open()`` for
writing, and ``renameat2(RENAME_EXCHANGE)`` through ``unickpt.store.publish.exchange``) is one
step. Before each step the control file is read: ``<k> <token>``. A new token restarts the count;
the step numbered ``k`` (from 1; 0 never) is logged and the process kills itself with SIGKILL
before making it. Every step is appended to ``UNICKPT_TEST_WRITER_OPLOG`` as
``<token> <n> <kind> <path>`` (``KILL`` in front of the step killed at).
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import threading
from typing import Any

_CONTROL = os.environ.get("UNICKPT_TEST_WRITER_CONTROL")


def _install(control: str) -> None:
    root = os.path.realpath(os.environ["UNICKPT_TEST_WRITER_ROOT"])
    oplog = os.environ["UNICKPT_TEST_WRITER_OPLOG"]
    real = {
        n: getattr(os, n)
        for n in (
            "open",
            "write",
            "pwrite",
            "pwritev",
            "writev",
            "ftruncate",
            "fsync",
            "fdatasync",
            "rename",
            "replace",
            "unlink",
            "remove",
            "mkdir",
            "rmdir",
            "link",
            "symlink",
            "copy_file_range",
            "close",
            "read",
        )
        if hasattr(os, n)
    }
    real_open = builtins.open
    lock = threading.Lock()
    state = {"token": "", "n": 0}

    def at_fd(fd: Any) -> str | None:
        """The file ``fd`` (a descriptor or a file object) names now, when it is under root."""
        try:
            n = fd if isinstance(fd, int) else fd.fileno()
            p = os.readlink(f"/proc/self/fd/{n}").removesuffix(" (deleted)")
        except (OSError, AttributeError, ValueError):
            return None
        return p if p == root or p.startswith(root + os.sep) else None

    def under(path: Any, dir_fd: Any = None) -> str | None:
        if isinstance(path, int):
            return at_fd(path)
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        full = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(p)), ""))
        full = os.path.join(full, os.path.basename(p))
        return full if full == root or full.startswith(root + os.sep) else None

    def log(line: str) -> None:
        fd = real["open"](oplog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            real["write"](fd, (line + "\n").encode())
        finally:
            real["close"](fd)

    def step(kind: str, path: str | None) -> None:
        if path is None:
            return
        with lock:
            fd = real["open"](control, os.O_RDONLY)
            try:
                k_s, token = real["read"](fd, 200).decode().split()
            finally:
                real["close"](fd)
            if token != state["token"]:
                state["token"], state["n"] = token, 0
            state["n"] += 1
            rel = os.path.relpath(path, root)
            if state["n"] == int(k_s):
                log(f"KILL {token} {state['n']} {kind} {rel}")
                os.kill(os.getpid(), signal.SIGKILL)
            log(f"{token} {state['n']} {kind} {rel}")

    def wrap_fd(name: str) -> None:
        fn = real[name]

        def w(fd: int, *a: Any, **k: Any) -> Any:
            step(name, at_fd(fd))
            return fn(fd, *a, **k)

        setattr(os, name, w)

    def os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        full = under(path, dir_fd)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            step("open", full)
        return real["open"](path, flags, mode, dir_fd=dir_fd)

    def wrap_path(name: str) -> None:
        fn = real[name]

        def w(path: Any, *a: Any, dir_fd: Any = None, **k: Any) -> Any:
            step(name, under(path, dir_fd))
            if dir_fd is not None:
                k["dir_fd"] = dir_fd
            return fn(path, *a, **k)

        setattr(os, name, w)

    def wrap_two(name: str) -> None:
        fn = real[name]

        def w(src: Any, dst: Any, *a: Any, src_dir_fd: Any = None, dst_dir_fd: Any = None, **k: Any) -> Any:
            step(name, under(dst, dst_dir_fd) or under(src, src_dir_fd))
            if src_dir_fd is not None:
                k["src_dir_fd"] = src_dir_fd
            if dst_dir_fd is not None:
                k["dst_dir_fd"] = dst_dir_fd
            return fn(src, dst, *a, **k)

        setattr(os, name, w)

    def opener(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if not isinstance(file, int) and any(c in mode for c in "wax+"):
            step("open()", under(file))
        return real_open(file, mode, *a, **k)

    for n in ("write", "pwrite", "pwritev", "writev", "ftruncate", "fsync", "fdatasync"):
        if n in real:
            wrap_fd(n)
    if "copy_file_range" in real:
        fn_cfr = real["copy_file_range"]

        def cfr(src: int, dst: int, *a: Any, **k: Any) -> Any:
            step("copy_file_range", at_fd(dst))
            return fn_cfr(src, dst, *a, **k)

        os.copy_file_range = cfr
    for n in ("unlink", "remove", "mkdir", "rmdir"):
        wrap_path(n)
    for n in ("rename", "replace", "link", "symlink"):
        wrap_two(n)
    os.open = os_open  # type: ignore[assignment]
    builtins.open = opener

    class _PatchExchange(importlib.abc.MetaPathFinder):
        """Wraps ``unickpt.store.publish.exchange`` once that module is loaded."""

        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "unickpt.store.publish":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            exec_module = loader.exec_module  # type: ignore[attr-defined]

            def run(module: Any) -> None:
                exec_module(module)
                real_exchange = module.exchange

                def exchange(a: str, b: str) -> bool:
                    step("exchange", under(b))
                    return bool(real_exchange(a, b))

                module.exchange = exchange

            loader.exec_module = run  # type: ignore[attr-defined]
            return spec

    sys.meta_path.insert(0, _PatchExchange())


if _CONTROL:
    _install(_CONTROL)
