"""One guard around a store's client: a deadline on every operation, its errors as ``StorageError``.

:class:`FsspecStorage` (``store/storage.py``) never hands out its fsspec file system bare:
``storage.fs`` is a :class:`GuardedFs`, so every call into the client, from the storage's own
methods or from the modules that talk to the store directly (the commit protocol, the save lock,
the manager's steps, multipart uploads), goes through :meth:`GuardedFs._call`:

- **a deadline.** On an async file system (s3fs, gcsfs, adlfs) each call runs under a deadline of
  ``timeout`` seconds (``UNICKPT_STORE_TIMEOUT``, or the storage option ``unickpt_timeout``;
  default ``DEFAULT_TIMEOUT``; 0 turns it off), the client's own retries included; past it the call
  is cancelled and a ``StorageError`` names the URL, the operation and the deadline. Ranged reads
  (``cat_ranges``) give every range request its own deadline; a download (``get_file``) fails once
  no bytes arrived for ``timeout`` seconds; a server-side copy gets ``timeout`` per started GiB.
  After a call ran past its deadline, the calls that follow on the same storage within ``timeout``
  seconds (a failed save's cleanup, mostly) get ``QUIET_TIMEOUT`` seconds at most, until one of
  them succeeds, so that a store that stopped answering fails a save in about one deadline, not
  one per cleanup step.
- **errors mapped.** Whatever the client raises (botocore's ``NoCredentialsError`` or
  ``EndpointConnectionError``, aiohttp's errors, a ``TypeError`` for a storage option the file
  system does not take, an ``OSError`` the store answered with) becomes a ``StorageError`` naming the
  URL, the operation, the object and the cause, with every credential (access and secret keys,
  session tokens, passwords, in the storage options, the AWS environment or the URL) replaced by
  ``***``. The store's answers pass through unchanged: ``FileNotFoundError`` (no such object),
  ``FileExistsError`` and a failed precondition (a conditional write that lost), which the callers
  act on.

No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from unickpt.errors import ConfigError, StorageError, UnickptError, UnsupportedError

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENV",
    "OPTION",
    "QUIET_TIMEOUT",
    "GuardedFs",
    "Redactor",
    "fs_from_url",
    "guarded",
    "redactor",
    "shown_url",
    "store_timeout",
]

#: The environment variable setting the deadline (seconds) of every operation on a store.
ENV = "UNICKPT_STORE_TIMEOUT"
#: The storage option setting it for one storage (taken out before the options reach fsspec).
OPTION = "unickpt_timeout"
#: Seconds an operation on a store may take, the client's retries included, when nothing says.
DEFAULT_TIMEOUT = 120.0
#: The deadline of the calls that follow a call that ran past its deadline (within ``timeout``).
QUIET_TIMEOUT = 1.0

# Names of storage options whose values are credentials (matched in the lowercased name).
_SECRET_NAMES = ("key", "secret", "token", "password", "passwd", "credential", "sas", "signature", "auth")
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<pw>[^/@\s]*)@")
_PRECONDITION = ("PreconditionFailed", "pre-conditions", "412", "ConditionalRequestConflict")
_UNKNOWN_KW = re.compile(r"unexpected keyword argument '([^']+)'")


def store_timeout(value: Any = None) -> float | None:
    """The deadline in seconds: ``value`` (a storage option) if given, else ``$UNICKPT_STORE_TIMEOUT``,
    else ``DEFAULT_TIMEOUT``; None (no deadline) for 0. ``ConfigError`` for anything but a number >= 0."""
    where, raw = (f"storage option {OPTION}", value) if value is not None else (ENV, os.environ.get(ENV))
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{where}: expected seconds (a number >= 0, 0 for no deadline), got {raw!r}")
    return seconds or None


def shown_url(url: str) -> str:
    """``url`` with the password of its user part (``scheme://user:password@host``) as ``***``."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)


def _secrets(options: Any, out: set[str], secret: bool = False) -> None:
    if isinstance(options, dict):
        for k, v in options.items():
            _secrets(v, out, secret or any(w in str(k).lower() for w in _SECRET_NAMES))
    elif isinstance(options, (list, tuple)):
        for v in options:
            _secrets(v, out, secret)
    elif secret and options is not None and not isinstance(options, bool) and len(str(options)) >= 3:
        out.add(str(options))


def redactor(url: str, *options: Any) -> Callable[[str], str]:
    """A function replacing every credential in a text with ``***``: the values of the credential
    options in ``options`` (dicts, searched to any depth), the AWS credentials in the environment,
    and passwords in URLs (``url``'s and any other)."""
    found: set[str] = set()
    for o in options:
        _secrets(o, found)
    found |= {os.environ[k] for k in _SECRET_ENV if len(os.environ.get(k, "")) >= 3}
    m = _USERINFO.search(url)
    if m and len(m["pw"]) >= 3:
        found.add(m["pw"])
    return Redactor(tuple(sorted(found, key=len, reverse=True)))  # a secret inside another goes after it


@dataclasses.dataclass(frozen=True)
class Redactor:
    """Replaces each of ``secrets`` in a text with ``***``, longest first, then any URL password.

    A value, not a closure, so that a storage travels to an async save's writer process."""

    secrets: tuple[str, ...]

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return shown_url(text)

    def __repr__(self) -> str:
        return f"Redactor({len(self.secrets)} secrets)"


def fs_from_url(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str, float, dict[str, Any]]:
    """``(fs, root, timeout, options)`` for an fsspec URL: the storage option ``unickpt_timeout``
    taken out of ``options`` (``timeout`` 0 for none). fsspec's ``ValueError`` is an
    ``UnsupportedError``, any other failure to make the file system (an option it does not take...)
    a ``StorageError``; an ``ImportError`` (no backend) is the caller's to word."""
    options = dict(storage_options or {})
    timeout = store_timeout(options.pop(OPTION, None)) or 0.0
    redact = redactor(url, options)
    try:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(url, **options)
    except ImportError:
        raise
    except ValueError as e:
        raise UnsupportedError(f"{shown_url(url)}: fsspec cannot open it ({redact(str(e))})") from e
    except Exception as e:  # the backend refused its options: a TypeError, its own errors
        cause = redact(" ".join(f"{type(e).__name__}: {e}".split())[:600])
        protocol = url.split("://", 1)[0]
        raise StorageError(
            f"{shown_url(url)}: the {protocol}:// file system cannot be made from its storage options ({cause})"
        ) from e
    return fs, str(root), timeout, options


def guarded(fs: Any, url: str, timeout: float | None = None, options: Any = None) -> GuardedFs:
    """``fs`` guarded for ``url`` (see the module docstring): ``timeout`` seconds a call (0: none;
    None: :func:`store_timeout`), the credentials in ``options`` and in ``fs``'s own storage options
    kept out of messages. A guarded ``fs`` is guarded again around its raw file system."""
    raw = fs.raw if isinstance(fs, GuardedFs) else fs
    seconds = store_timeout() if timeout is None else (timeout or None)
    return GuardedFs(raw, url, seconds, redactor(url, options, getattr(raw, "storage_options", None)))


class _Expired(Exception):
    """A call ran past its deadline (raised inside the guard only)."""


class _Progress:
    """An fsspec callback remembering when the last bytes arrived (for :meth:`GuardedFs.get_file`)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def set_size(self, size: int) -> None:
        self.last = time.monotonic()

    def relative_update(self, inc: int = 1) -> None:
        self.last = time.monotonic()

    def absolute_update(self, value: int) -> None:
        self.last = time.monotonic()

    def branched(self, *a: Any, **k: Any) -> _Progress:
        return self

    def call(self, *a: Any, **k: Any) -> None:
        self.last = time.monotonic()


class GuardedFs:
    """An fsspec file system whose every method call is guarded (see the module docstring).

    Attributes read through; methods come back wrapped. ``raw`` is the file system itself.
    """

    def __init__(self, fs: Any, url: str, timeout: float | None, redact: Callable[[str], str]) -> None:
        self.raw = fs
        self.url = shown_url(url)
        self.timeout = timeout
        self.redact = redact
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self._protocol = str(protocol)
        self._async = bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None
        self._quiet_until = 0.0
        self._mu = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # fsspec file systems pickle by their arguments; the lock and the quiet period stay here.
        return {"raw": self.raw, "url": self.url, "timeout": self.timeout, "redact": self.redact}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["raw"], state["url"], state["timeout"], state["redact"])  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.raw, name)
        if name.startswith("__") or not callable(attr) or inspect.isclass(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, attr, args, kwargs)

        call.__name__ = name
        return call

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        """The file system's file object, its methods' errors mapped like the calls' (a stream's
        reads and writes have the client's own timeouts, not the guard's deadline)."""
        return _GuardedFile(self._call("open", self.raw.open, (path, mode), kwargs), self, str(path))

    # ---------------------------------------------------------------- the guard
    def _deadline(self) -> float | None:
        if self.timeout is None:
            return None
        with self._mu:
            quiet = time.monotonic() < self._quiet_until
        return min(self.timeout, QUIET_TIMEOUT) if quiet else self.timeout

    def _expired(self) -> None:
        if self.timeout is not None:
            with self._mu:
                self._quiet_until = time.monotonic() + self.timeout

    def _call(
        self, name: str, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: str | None = None
    ) -> Any:
        deadline = self._deadline()
        coro_fn = self._coroutine_of(name, method)
        try:
            if coro_fn is None or deadline is None:
                return method(*args, **kwargs)
            if name == "cat_ranges":
                out = self._sync(self._cat_ranges(deadline, *args, **kwargs))
            elif name == "get_file":
                out = self._sync(self._get_file(deadline, *args, **kwargs))
            elif name == "cp_file":
                out = self._sync(self._cp_file(deadline, *args, **kwargs))
            else:
                out = self._sync(_bounded(coro_fn(*args, **kwargs), deadline))
            if deadline != self.timeout:  # the store answers again: full deadlines from now on
                with self._mu:
                    self._quiet_until = 0.0
            return out
        except _Expired as e:
            self._expired()
            raise StorageError(
                f"{self.url}: {self._what(name, args, kwargs, where)} did not finish within {e.args[0]:g} s "
                f"(the deadline of a store operation, {ENV} or the storage option {OPTION}); "
                "the store is not answering"
            ) from None
        except (UnickptError, FileNotFoundError, FileExistsError, NotImplementedError):
            raise
        except Exception as e:
            if isinstance(e, OSError) and _precondition(e):
                raise
            raise StorageError(self._message(name, args, kwargs, e, where)) from e

    def _coroutine_of(self, name: str, method: Any) -> Callable[..., Any] | None:
        """The coroutine behind a blocking method of an async file system (fsspec mirrors each
        ``_name`` coroutine as ``name``), or None."""
        if not self._async or not inspect.iscoroutinefunction(getattr(method, "__wrapped__", None)):
            return None
        coro_fn = getattr(self.raw, f"_{name}", None)
        return coro_fn if inspect.iscoroutinefunction(coro_fn) else None

    def _sync(self, coro: Any) -> Any:
        from fsspec.asyn import sync

        async def run() -> Any:
            return await coro

        return sync(self.raw.loop, run)

    async def _cat_ranges(
        self, deadline: float, paths: list[str], starts: Iterable[int], ends: Iterable[int], **kw: Any
    ) -> list[Any]:
        """fsspec's ``cat_ranges`` with a deadline per range request; a missing object is the
        range's answer (as fsspec's ``on_error="return"``), any other failure fails the call."""
        kw.pop("on_error", None)
        slots = asyncio.Semaphore(int(getattr(self.raw, "batch_size", None) or 128))

        async def one(p: str, s: int, e: int) -> Any:
            async with slots:
                try:
                    return await _bounded(self.raw._cat_file(p, start=s, end=e, **kw), deadline)
                except FileNotFoundError as err:
                    return err

        return await _all([one(p, s, e) for p, s, e in zip(paths, starts, ends, strict=True)])

    async def _get_file(self, deadline: float, rpath: str, lpath: str, **kw: Any) -> Any:
        """A download that fails once no bytes arrived for ``deadline`` seconds."""
        progress = _Progress()
        kw["callback"] = progress
        task = asyncio.ensure_future(self.raw._get_file(rpath, lpath, **kw))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(deadline, 0.25))
                if done:
                    return task.result()
                if time.monotonic() - progress.last > deadline:
                    raise _Expired(deadline)
        finally:
            await _cancel(task)

    async def _cp_file(self, deadline: float, path1: str, path2: str, **kw: Any) -> Any:
        """A copy inside the store: ``deadline`` per started GiB of the object (and one for its size)."""
        info = await _bounded(self.raw._info(path1), deadline)
        gib = max(1, math.ceil(int(info.get("size") or 0) / (1 << 30)))
        return await _bounded(self.raw._cp_file(path1, path2, **kw), deadline * gib)

    # ---------------------------------------------------------------- messages
    def _what(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], at: str | None = None) -> str:
        """``op of object`` for a message: the S3 API name for ``call_s3``, the object it names."""
        if at is not None:
            op, where = name, at
        elif name == "call_s3" and args:
            op = str(args[0])
            where = "/".join(str(kwargs[k]) for k in ("Bucket", "Key") if kwargs.get(k))
        else:
            op = name
            first = args[0] if args else kwargs.get("path", kwargs.get("rpath"))
            if isinstance(first, (list, tuple)):
                where = (
                    f"{first[0]} (and {len(first) - 1} more)"
                    if len(first) > 1
                    else str(first[0] if first else "")
                )
            else:
                where = str(first) if first is not None else ""
        if where and "://" not in where:
            where = f"{self._protocol}://{where}"
        return self.redact(f"{op} of {where}" if where else op)

    def _message(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        e: BaseException,
        at: str | None = None,
    ) -> str:
        cause = " ".join(f"{type(e).__name__}: {e}".split())[:600]
        kind = type(e).__name__
        m = _UNKNOWN_KW.search(str(e)) if isinstance(e, TypeError) else None
        if m:
            hint = (
                f"the storage option {m.group(1)!r} is not one the {self._protocol}:// file system "
                "takes (see its documentation for the options it accepts)"
            )
        elif kind in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            hint = (
                "no usable credentials: set them in the environment (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or a profile), or in the storage options (key, secret), "
                "or pass anon=true for a public bucket"
            )
        elif kind in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or isinstance(
            e, ConnectionError
        ):
            hint = "the store's endpoint cannot be reached (check endpoint_url / AWS_ENDPOINT_URL and the network)"
        elif isinstance(e, PermissionError):
            hint = "the store refused access (check the credentials and their permissions on the bucket)"
        else:
            hint = "the store's client failed"
        return self.redact(f"{self.url}: {self._what(name, args, kwargs, at)} failed: {hint} ({cause})")


class _GuardedFile:
    """A file object of a guarded file system: its methods' errors are ``StorageError``s."""

    def __init__(self, f: Any, guard: GuardedFs, path: str) -> None:
        object.__setattr__(self, "_f", f)
        object.__setattr__(self, "_guard", guard)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._f, name)
        if name.startswith("__") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._guard._call(name, attr, args, kwargs, self._path)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._f, name, value)

    def __enter__(self) -> _GuardedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Any:
        return iter(self.readline, b"")


def _precondition(e: OSError) -> bool:
    said = f"{e} {e.__cause__!r}"
    return any(w in said for w in _PRECONDITION)


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=1.0)


async def _bounded(coro: Any, deadline: float) -> Any:
    """``await coro`` within ``deadline`` seconds; ``_Expired`` past it (the coroutine cancelled)."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=deadline)
        if not done:
            raise _Expired(deadline)
        return task.result()
    finally:
        await _cancel(task)


async def _all(coros: list[Any]) -> list[Any]:
    """Every coroutine's result in order; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            await _cancel(t)
