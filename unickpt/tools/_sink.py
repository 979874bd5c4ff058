"""Where an offline tool writes its output: a local directory being staged, or a URL prefix.

``output_sink(out)`` yields a :data:`Sink`: for a local ``out`` the hidden staging directory of
``staged_output`` (published by one rename when the block ends), for a URL the
:class:`~unickpt.tools._store_out.StoreOutput` of the prefix (the prefix must hold nothing; data
and side files are streamed under their final names, indexes written last with an exclusive
PUT; on failure everything this run wrote is removed). Writers take the sink as it is
(``_write.write_checkpoint`` streams its data files to either) and small files go through
:func:`put_bytes`, so no tool stages a URL output on local disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from unickpt.tools._store_out import StoreOutput, store_output

__all__ = ["Sink", "output_sink", "put_bytes"]

Sink = str | StoreOutput


@contextmanager
def output_sink(out: str, storage_options: dict[str, Any] | None = None) -> Iterator[Sink]:
    """The sink of the output ``out`` (see the module docstring), committed when the block ends."""
    from unickpt.format.storage import is_url
    from unickpt.tools._common import staged_output

    if is_url(out):
        with store_output(out, storage_options) as store:
            yield store
        return
    with staged_output(out) as tmp:
        yield tmp


def put_bytes(sink: Sink, name: str, data: bytes) -> None:
    """A small side file ``name`` (``lr_scheduler.json``, ``config.json``, ...) of the output, whole."""
    if isinstance(sink, StoreOutput):
        sink.put(name, data)
        return
    from unickpt.tools._common import write_durably

    write_durably(os.path.join(sink, name), data)
