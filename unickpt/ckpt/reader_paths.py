"""What the reader says about a local path that holds no checkpoint (for its error messages)."""

from __future__ import annotations

import errno
import os
import stat

from unickpt.ckpt.foreign import foreign_dir

__all__ = ["hint_foreign", "hint_other_files", "not_regular", "regular_size"]


def regular_size(path: str) -> int | None:
    """The size of the regular file at ``path`` (links followed); None when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def not_regular(path: str) -> str:
    """What stands at ``path`` instead of a regular file (for messages)."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if os.path.islink(path):
            return "a dangling symbolic link"
        return f"unreadable ({e.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return "a device"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket"
    return "not a regular file"


def hint_other_files(directory: str) -> str:
    """For a directory without a committed checkpoint: name the .safetensors files it does hold.

    A directory is never guessed from its data files (they may be those of an interrupted
    save); a single file of another name is loaded by passing its path.
    """
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    except OSError:
        return ""
    if not names:
        return ""
    shown = ", ".join(ascii(n) if not n.isprintable() else repr(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"; it holds {len(names)} other .safetensors file(s) ({shown}{more}): to load a single-file "
        "checkpoint of another name, pass the path of the file itself"
    )


def hint_foreign(directory: str) -> str:
    """For a directory without a committed checkpoint: what other tool's checkpoint it holds, if
    any, and the ``convert`` command that reads it (``ckpt/foreign.py``'s rules)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return ""
    other = foreign_dir(names, lambda n: os.listdir(os.path.join(directory, n)))
    return "" if other is None else f"; {other.hint(directory)}"
