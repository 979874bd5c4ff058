"""What a checkpoint file may make unickpt read: names confined to the checkpoint, objects bounded.

Every file name that comes from inside a checkpoint (a DCP ``.metadata``'s storage entries, a
DeepSpeed ``latest`` tag, a Colossal-AI or Hugging Face index's ``weight_map``, our own index's
slice files) becomes a path in one of two ways, both here:

- :func:`plain_name`: the name must be a plain file name (letters, digits, ``._+=-``, no ``/``
  or ``\\``, no ``..``, not absolute, not hidden, at most 255 characters), so joined to the
  checkpoint's directory or URL prefix it names an entry of that directory or prefix and
  nothing else (``../other_run/x``, ``/etc/x``, ``a/../../x`` and ``s3://bucket/other/x`` all
  fail);
- :func:`confined_path`: a local path so joined must also *resolve* inside the directory: a
  symbolic link to a file elsewhere is refused. The one exception is the Hugging Face cache
  (``<repo>/snapshots/<rev>/<file>`` linking to ``<repo>/blobs/<sha>``).

:func:`check_graph` bounds what an allowlisted unpickler (``weights_only`` loading, DCP's
metadata unpickler) may still build from allowed types: nesting deeper than ``MAX_DEPTH``
and objects that contain themselves are refused before any code walks them recursively.
The walk is iterative and visits each object once (shared references are not re-walked),
so its time and memory are linear in the objects the pickle built, which is at most the
number of its opcodes, so bounded by the file's size.
"""

from __future__ import annotations

import enum
import itertools
import os
import re
from typing import Any

from unickpt.errors import CheckpointFormatError, UnsafePathError

__all__ = ["MAX_DEPTH", "is_plain_name", "plain_name", "confined_path", "check_graph", "show"]

_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]*$")
#: Deepest nesting of containers/objects accepted from a foreign pickle (real checkpoints: < 12).
MAX_DEPTH = 64

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), enum.Enum, type, range, slice)
_ATOM_TYPES = frozenset({str, bytes, int, float, bool, type(None)})  # the common leaves, by exact type


def show(value: object, limit: int = 200) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters; never raises (an unpickled
    integer too long for ``repr``, a self-containing or very deep object)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError, MemoryError):
        return f"<a {type(value).__name__} too large to show>"
    except Exception:  # a stand-in's repr on hostile attributes
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a plain file name (see the module docstring)."""
    return isinstance(name, str) and len(name) <= 255 and ".." not in name and _PLAIN.match(name) is not None


def plain_name(name: object, where: str, entry: str, error: type[Exception] = UnsafePathError) -> str:
    """``name`` unchanged when it is a plain file name; else ``error`` naming the file ``where``
    it was read from and the ``entry`` that holds it."""
    if not is_plain_name(name):
        raise error(
            f"{where}: {entry} names {show(name)}, which is not a plain file name inside the checkpoint "
            "(no '/', '\\', '..', absolute paths or hidden files); refusing to read outside it"
        )
    return name  # type: ignore[return-value]


def _hf_cache_blob(base: str, real: str) -> bool:
    """``real`` is ``<repo>/blobs/<sha>`` and ``base`` is ``<repo>/snapshots/<rev>``."""
    snaps, _rev = os.path.split(base)
    repo, tail = os.path.split(snaps)
    return tail == "snapshots" and os.path.dirname(real) == os.path.join(repo, "blobs")


def confined_path(base: str, name: str, where: str, entry: str) -> str:
    """``base/name`` for a plain ``name`` (:func:`plain_name`) when that path, symbolic links
    followed, stays inside the directory ``base``; else :class:`UnsafePathError`."""
    path = os.path.join(base, plain_name(name, where, entry))
    if not os.path.islink(path):
        return path  # a plain name in base, not a link: inside by construction
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if real.startswith(real_base + os.sep) or _hf_cache_blob(real_base, real):
        return path
    raise UnsafePathError(
        f"{where}: {entry} {name!r} is a symbolic link to {real}, outside {real_base}; "
        "refusing to read outside the checkpoint"
    )


def _children(obj: Any) -> Any:
    """The objects ``obj`` holds: a container's items (a dict's keys and values), another
    object's attributes (its ``__dict__``); objects without either hold nothing walked here."""
    if isinstance(obj, dict):
        return itertools.chain.from_iterable(obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return iter(obj)
    d = getattr(obj, "__dict__", None)
    return iter(d.values()) if isinstance(d, dict) else iter(())


def check_graph(
    obj: Any,
    where: str,
    what: str = "object",
    error: type[Exception] = CheckpointFormatError,
    max_depth: int = MAX_DEPTH,
) -> None:
    """Refuse (``error`` naming ``where`` and ``what``) an unpickled ``obj`` that contains itself
    or whose longest chain of nested objects (shared ones counted on every path) is longer than
    ``max_depth``. Each object and each reference is visited once, without recursion."""
    if isinstance(obj, _ATOMS):
        return
    height: dict[int, int] = {}  # id -> longest chain from it down, once walked
    on_path = {id(obj)}
    frames: list[list[Any]] = [[obj, _children(obj), 1]]  # [object, its children, longest chain]
    while frames:
        top = frames[-1]
        for c in top[1]:
            if type(c) in _ATOM_TYPES or isinstance(c, _ATOMS):
                continue
            cid = id(c)
            h = height.get(cid)
            if h is not None:
                if h + 1 > top[2]:
                    top[2] = h + 1
                continue
            if cid in on_path:
                raise error(
                    f"{where}: the {what} contains itself (a {type(c).__name__} that refers back to itself)"
                )
            if len(frames) >= max_depth:
                raise error(f"{where}: the {what} is nested more than {max_depth} levels deep")
            on_path.add(cid)
            frames.append([c, _children(c), 1])
            break
        else:
            frames.pop()
            o, _, h = top
            if h > max_depth:
                raise error(f"{where}: the {what} is nested more than {max_depth} levels deep")
            height[id(o)] = h
            on_path.discard(id(o))
            if frames and h + 1 > frames[-1][2]:
                frames[-1][2] = h + 1
