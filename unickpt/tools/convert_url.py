"""``unickpt convert`` with a URL source or destination.

The importers read foreign formats with torch's own loaders (``torch.load`` of ``.bin`` files,
DCP's file reader), which need local files; the writers stage a gathered checkpoint. So:

- a **URL source** of ``--from dcp`` or ``--from bin`` is downloaded into a local temporary
  directory first (the whole source: a torchtitan folder's latest step only), then converted;
  ``--from unickpt`` (``--to dcp``) reads the URL in place through the storage layer;
  ``--from colossalai`` / ``--from deepspeed`` on a URL are refused (``UnsupportedError``);
- a **URL destination** is written into a local temporary directory, then uploaded with the
  object-store commit (``tools/_store_out.py``: data files first, the index or ``.metadata``
  last; the prefix must hold nothing; a failure leaves nothing); ``--to run`` on a URL is
  refused (a ``CheckpointManager`` writes its own runs on a store).
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from collections.abc import Callable
from typing import Any

from unickpt.errors import UnsupportedError
from unickpt.format.storage import FsspecStorage, is_url, open_storage
from unickpt.tools._store_out import StoreOutput, store_output, upload_tree

__all__ = ["convert_with_urls"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _download(url: str, dest: str, source: str) -> str:
    """The DCP / .bin source at ``url`` as a local directory (or file) under ``dest``."""
    storage, root = open_storage(url)
    if not isinstance(storage, FsspecStorage):  # never: only URLs come here
        raise UnsupportedError(f"{url}: not a URL")
    fs = storage.fs
    if not fs.isdir(root):  # one .bin file
        local = os.path.join(dest, posixpath.basename(root))
        fs.get_file(root, local)
        return local
    names = storage.listdir(root)
    if source == "dcp" and ".metadata" not in names:  # a torchtitan folder: its latest step only
        steps = [(int(m.group(1)), n) for n in names if (m := _STEP_DIR.match(n))]
        if steps:
            root = f"{root}/{max(steps)[1]}"
    local = os.path.join(dest, "src")
    fs.get(f"{root}/", local + "/", recursive=True)
    return local


def convert_with_urls(
    convert: Callable[..., str], src: str, out: str, *, source: str, target: str, **kw: Any
) -> str:
    """Run ``convert`` (``convert_checkpoint``) with local stand-ins for the URLs in ``src`` / ``out``."""
    if is_url(src) and source in ("colossalai", "deepspeed"):
        raise UnsupportedError(
            f"convert --from {source}: {src} is a URL; this importer reads local directories only "
            "(copy the checkpoint to local disk first)"
        )
    if is_url(out) and target == "run":
        raise UnsupportedError(
            f"convert --to run: {out} is a URL; a run directory is written locally (a CheckpointManager "
            "given the URL writes its own runs on the store)"
        )
    with tempfile.TemporaryDirectory(prefix="unickpt-convert-") as tmp:
        local_src = _download(src, tmp, source) if is_url(src) and source != "unickpt" else src
        if not is_url(out):
            return convert(local_src, out, source=source, target=target, **kw)
        StoreOutput.check(out)  # refuse a used prefix before converting anything
        staged = os.path.join(tmp, "out")
        convert(local_src, staged, source=source, target=target, **kw)
        with store_output(out) as dest:
            upload_tree(staged, dest)
    return out.rstrip("/")
