"""``unickpt convert --from colossalai|deepspeed`` with a URL destination.

Those importers assemble their output from several local files of the source (DeepSpeed's
per-rank optimizer partitions, Colossal-AI's id-to-name map) and write it with local renames,
so their output is written into a local temporary directory, then uploaded with the
object-store commit (``store/publish.py``: data files first, the indexes last; the prefix
must hold nothing; a failure leaves nothing). Every other conversion streams to and from URLs
(``store/publish.py``, ``tools/convert_src.py``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from unickpt.store.publish import store_output, upload_tree

__all__ = ["convert_with_urls"]


def convert_with_urls(
    convert: Callable[..., str], src: str, out: str, *, source: str, target: str, **kw: Any
) -> str:
    """Run ``convert`` (``convert_checkpoint``) into a local stand-in for the URL ``out``, then upload it."""
    from unickpt.store.publish import StoreOutput

    StoreOutput.check(out)  # refuse a used prefix before converting anything
    with tempfile.TemporaryDirectory(prefix="unickpt-convert-") as tmp:
        staged = os.path.join(tmp, "out")
        convert(src, staged, source=source, target=target, **kw)
        with store_output(out) as dest:
            upload_tree(staged, dest)
    return out.rstrip("/")
