"""``unickpt verify``: validate a checkpoint's structure and rehash every stored slice. No torch."""

from __future__ import annotations

import math
import os

from unickpt._logging import get_logger
from unickpt.errors import IntegrityFailure
from unickpt.format.dtypes import itemsize
from unickpt.tools._common import open_auto

__all__ = ["verify_checkpoint"]

logger = get_logger(__name__)


def verify_checkpoint(
    path: str | os.PathLike[str], *, kind: str | None = None, progress: bool = False
) -> list[IntegrityFailure]:
    """Check the checkpoint at ``path``; return every slice whose bytes do not match its hash.

    First the structure is validated (index schema, safe file names, exact coverage of every
    tensor, every slice present in its file with the recorded dtype and shape); a problem
    there raises (``IndexFileError``, ``HeaderError``, ``IncompleteCheckpointError`` ...),
    since the input is then not a usable checkpoint at all. Then every stored slice is
    rehashed (xxh3-64); mismatches are returned, each naming the tensor and the file. An
    empty list means every hashed slice is intact (plain Hugging Face files carry no hashes:
    see ``unhashed`` in ``inspect``). ``progress`` shows a tqdm bar on stderr.
    """
    with open_auto(path, kind) as r:
        r.validate_structure()
        total = sum(
            math.prod(s.shape) * itemsize(t.dtype)
            for t in r.block.tensors.values()
            for s in t.slices
            if s.xxh3
        )
        if not progress:
            failures = r.verify()
        else:
            from tqdm.auto import tqdm

            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="verify",
                leave=False,
                disable=None,
            ) as bar:
                failures = r.verify(progress=bar.update)
        for f in failures:
            logger.info("integrity failure: %s", f)
        return failures
