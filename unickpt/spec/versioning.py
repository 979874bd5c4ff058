"""The format's one version, and how a reader refuses any other (docs/format.md section 7).

unickpt reads and writes ``format_version`` 5 only. The drafts 1 to 4 that came before it are
converted by ``unickpt upgrade`` (``unickpt/tools/upgrade.py``, the only code that knows them);
every reader refuses them, and any version it does not know, with an ``IndexFileError`` that
names the file, the version found and what to do.
"""

from __future__ import annotations

import posixpath
from typing import Any, Literal

from unickpt.errors import IndexFileError

__all__ = ["FORMAT_VERSION", "OtherFormatVersion", "check_version", "version_error"]

#: The version every writer stamps and the only one readers accept.
FORMAT_VERSION: Literal[5] = 5
#: The drafts before version 5, which ``unickpt upgrade`` converts.
_DRAFTS = range(1, FORMAT_VERSION)


class OtherFormatVersion(ValueError):
    """A block stamped with an integer ``format_version`` other than :data:`FORMAT_VERSION`
    (raised inside the models' validation; readers turn it into :func:`version_error`)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"format_version {version} is not the version {FORMAT_VERSION} this unickpt reads")
        self.version = version


def check_version(block: Any) -> None:
    """Raise :class:`OtherFormatVersion` for a block (a JSON object) of another integer version.

    A block without ``format_version`` is version 5 (every writer writes it); a value that is no
    integer is left to the schema, which refuses it."""
    if type(block) is dict:
        v = block.get("format_version", FORMAT_VERSION)
        if type(v) is int and v != FORMAT_VERSION:
            raise OtherFormatVersion(v)


def version_error(path: str, version: int) -> IndexFileError:
    """The error for a checkpoint at ``path`` (its index, or a single file) of ``version``."""
    index = path.endswith(".index.json")
    target = (posixpath.dirname(path) or ".") if index else path
    if version in _DRAFTS:
        return IndexFileError(
            f"{path}: format_version {version}, a draft this unickpt no longer reads (it reads "
            f"version {FORMAT_VERSION} only); convert the checkpoint once with "
            f"`unickpt upgrade {target}` (in place; `unickpt upgrade {target} "
            f"{'NEW_DIR' if index else 'NEW_FILE'}` writes a copy)"
        )
    if version > FORMAT_VERSION:
        return IndexFileError(
            f"{path}: format_version {version} is not a version this unickpt reads (it reads "
            f"version {FORMAT_VERSION} only): a newer unickpt wrote it; read it with that one"
        )
    return IndexFileError(
        f"{path}: format_version {version} is no format version (unickpt reads version {FORMAT_VERSION})"
    )
