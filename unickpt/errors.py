"""The exception tree of unickpt.

Every failure unickpt reports on purpose is an ``UnickptError``. Leaves also inherit the
matching built-in so that existing ``except ValueError`` / ``except FileNotFoundError``
handlers keep working::

    UnickptError (Exception)
    +-- CheckpointFormatError (ValueError)       the files do not follow the format spec
    |   +-- IndexFileError                       index JSON malformed or inconsistent
    |   +-- HeaderError                          safetensors header malformed or hostile
    |   +-- UnsafePathError                      a file name leaves the checkpoint directory
    +-- IncompleteCheckpointError (FileNotFoundError)  no committed index / missing data file
    +-- IntegrityError                           stored bytes do not match their recorded hash
    +-- StateMismatchError (ValueError)          checkpoint and model/optimizer disagree
    +-- UnsupportedError (TypeError)             a dtype, object or option unickpt cannot handle
    +-- DistributedError (RuntimeError)          ranks disagree, or a peer failed
    +-- CheckpointBusyError (RuntimeError)       another save holds the directory lock
    +-- CheckpointChangedError (RuntimeError)    a save replaced the checkpoint while it was read
    +-- OutputExistsError (FileExistsError)      merge/convert output path already holds something
    +-- ConfigError (ValueError)                 an argument or setting unickpt was given is invalid
    +-- StorageError                             the store failed, refused or did not answer in time

Messages say where (file, tensor, rank), what was expected, what was found and, where
there is one, what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "UnickptError",
    "CheckpointFormatError",
    "IndexFileError",
    "HeaderError",
    "UnsafePathError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "IntegrityFailure",
    "StateMismatchError",
    "UnsupportedError",
    "DistributedError",
    "CheckpointBusyError",
    "CheckpointChangedError",
    "OutputExistsError",
    "ConfigError",
    "StorageError",
]


class UnickptError(Exception):
    """Root of every error unickpt raises on purpose."""


class CheckpointFormatError(UnickptError, ValueError):
    """A checkpoint file does not follow ``docs/format.md``."""


class IndexFileError(CheckpointFormatError):
    """An index file is malformed, fails its schema, or contradicts itself."""


class HeaderError(CheckpointFormatError):
    """A safetensors header is malformed, inconsistent or hostile."""


class UnsafePathError(CheckpointFormatError):
    """A file name in an index would read or write outside the checkpoint directory."""


class IncompleteCheckpointError(UnickptError, FileNotFoundError):
    """The path holds no committed checkpoint (no index written), or a data file is missing."""


class IntegrityFailure:
    """One stored slice whose bytes do not hash to the recorded value."""

    __slots__ = ("expected", "file", "found", "key", "tensor")

    def __init__(self, tensor: str, file: str, key: str, expected: str, found: str) -> None:
        self.tensor = tensor
        self.file = file
        self.key = key
        self.expected = expected
        self.found = found

    def __str__(self) -> str:
        return (
            f"tensor {self.tensor!r} in file {self.file!r} (stored as {self.key!r}): "
            f"expected xxh3-64 {self.expected}, found {self.found}"
        )

    def __repr__(self) -> str:
        return f"IntegrityFailure({self})"


class IntegrityError(UnickptError):
    """Stored bytes do not match the hash recorded when they were written.

    ``failures`` lists every bad slice found; ``tensor`` and ``file`` name the first one.
    """

    def __init__(self, failures: Sequence[IntegrityFailure], checkpoint: str = "") -> None:
        self.failures = list(failures)
        self.checkpoint = checkpoint
        first = self.failures[0] if self.failures else None
        self.tensor = first.tensor if first else ""
        self.file = first.file if first else ""
        lines = "\n  ".join(str(f) for f in self.failures[:20])
        more = f"\n  ... and {len(self.failures) - 20} more" if len(self.failures) > 20 else ""
        where = f" in {checkpoint}" if checkpoint else ""
        super().__init__(
            f"{len(self.failures)} stored slice(s) failed their hash check{where}:\n  {lines}{more}\n"
            "The data files are corrupted or were partly written; restore them from a good copy."
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its failures (not its message) when sent between ranks.
        return (type(self), (self.failures, self.checkpoint), self.__dict__)


class StateMismatchError(UnickptError, ValueError):
    """The checkpoint does not match the model or optimizer it is loaded into.

    ``missing``, ``unexpected`` and ``mismatched`` list every problem found, not just the first.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class UnsupportedError(UnickptError, TypeError):
    """A dtype, object or combination of options that unickpt does not handle."""


class DistributedError(UnickptError, RuntimeError):
    """Ranks disagree about a checkpoint, or a peer rank failed during a collective step."""


class CheckpointBusyError(UnickptError, RuntimeError):
    """Another save is writing to the same checkpoint directory."""


class CheckpointChangedError(UnickptError, RuntimeError):
    """A save committed a new checkpoint (or started replacing it) while this one was being read.

    Data files carry the save id of the index that names them; a reader that finds a data file
    of another save, or finds it gone, raises this instead of mixing two checkpoints. Reading
    again reads the newly committed checkpoint.
    """


class OutputExistsError(UnickptError, FileExistsError):
    """The output path of merge/convert already holds something; nothing is overwritten."""


class ConfigError(UnickptError, ValueError):
    """An argument, option or environment setting passed to unickpt is invalid.

    Raised before anything is read or written; the message names the setting, the accepted
    values and the value given.
    """


class StorageError(UnickptError):
    """An operation on a store (an fsspec URL: ``s3://``, ``gs://``...) failed in its client.

    Missing or refused credentials, an endpoint that refuses connections, a storage option the
    file system does not take, an error the store answered with, or an operation that did not
    finish within its deadline (``UNICKPT_STORE_TIMEOUT`` seconds, see ``store/storage_guard.py``).
    The message names the URL, the operation and the cause, never a credential; the client's own
    exception is ``__cause__``. A missing object is not a ``StorageError`` (it is the store's
    answer: ``FileNotFoundError`` or ``IncompleteCheckpointError``). Deliberately not an
    ``OSError``: a store that cannot be reached is never mistaken for a missing or unreadable file.
    """
