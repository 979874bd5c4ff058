"""The step prefixes of a ``CheckpointManager`` under an fsspec URL (object stores: no rename).

A step N is committed iff ``step-<N>/COMMIT`` exists, or (recovery rule) ``step-<N>`` has no
``COMMIT`` and a replacement copy ``.step-<N>.replacing-<id>/COMMIT`` does. Nothing is ever
renamed or moved: every rank writes its files of a step straight into the step's prefix through
the storage layer (``format/storage.py``: streamed multipart uploads, no local copy), and rank 0
then writes ``COMMIT`` last with an exclusive put: of two writers committing one step, the
second gets ``CheckpointBusyError``. A step is deleted ``COMMIT`` first.

Saving a step that is already committed never deletes the old copy before the new one is
committed: the new copy is uploaded under ``.step-<N>.replacing-<id>/`` and committed there
(``COMMIT`` last: two committed copies, ``step-<N>`` wins), then ``step-<N>`` is deleted
(``COMMIT`` first: the replacement copy is now step N), copied object by object into
``step-<N>/`` (``COMMIT`` last) and deleted (``COMMIT`` first). A save killed anywhere in
between leaves a committed copy of step N, old or new; the next save finishes or undoes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
from collections.abc import Callable
from typing import Any

from unickpt._logging import get_logger
from unickpt.errors import CheckpointBusyError, IncompleteCheckpointError, UnsupportedError
from unickpt.format.commit_store import abort_dead_uploads
from unickpt.format.run_layout import (
    COMMIT_NAME,
    HF_DIR,
    LATEST_NAME,
    REPLACING_RE,
    STEP_RE,
    TRAIN_STATE_DIR,
    work_name,
)
from unickpt.format.storage import FsspecStorage, open_storage

__all__ = ["RemoteStore"]

logger = get_logger("unickpt.manager")


class RemoteStore:
    """``step-<N>/`` prefixes under an fsspec URL; see the module docstring."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        storage, root = open_storage(url, storage_options)
        if not isinstance(storage, FsspecStorage):  # pragma: no cover - callers pass URLs only
            raise UnsupportedError(f"checkpoint_dir {url!r} is not an fsspec URL")
        self.storage = storage
        self.url = url.rstrip("/")
        self.fs: Any = storage.fs
        self.root: str = root

    def url_of(self, rel: str) -> str:
        """The URL of ``rel`` below the checkpoint directory (what the saves write to)."""
        return f"{self.url}/{rel}"

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    def _prefixes(self) -> tuple[dict[int, str], dict[int, list[str]]]:
        """({N: ``step-<N>`` rel}, {N: [``.step-<N>.replacing-<id>`` rels]}), committed or not."""
        self.fs.invalidate_cache()  # listings may be cached (s3fs, gcsfs); we need the current state
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}, {}
        steps: dict[int, str] = {}
        replacing: dict[int, list[str]] = {}
        for n in names:
            base = posixpath.basename(str(n).rstrip("/"))
            m = STEP_RE.match(base)
            if m:
                steps[int(m.group(1))] = base
            r = REPLACING_RE.match(base)
            if r:
                replacing.setdefault(int(r.group(1)), []).append(base)
        for v in replacing.values():
            v.sort()
        return steps, replacing

    def _committed(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(f"{rel}/{COMMIT_NAME}")))

    def committed_prefixes(self) -> dict[int, str]:
        """{N: the prefix holding committed step N}: ``step-<N>``, else a committed replacement copy."""
        steps, replacing = self._prefixes()
        out = {s: rel for s, rel in steps.items() if self._committed(rel)}
        for s, rels in replacing.items():
            if s not in out:
                for rel in rels:
                    if self._committed(rel):
                        out[s] = rel
                        break
        return out

    def committed_steps(self) -> list[int]:
        return sorted(self.committed_prefixes())

    def read_latest(self) -> int | None:
        try:
            obj = json.loads(self.fs.cat_file(self.path(LATEST_NAME)))
            return int(obj["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write ``rel`` whole; with ``exclusive`` return False (nothing written) if it exists."""
        path = self.path(rel)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        return self.storage.put(path, data, exclusive=exclusive)

    def _delete(self, rel: str) -> None:
        """Un-commit (delete ``COMMIT``), then delete the rest: a half-deleted copy is never committed."""
        path = self.path(rel)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(posixpath.join(path, COMMIT_NAME))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def remove_step(self, step: int) -> None:
        """Delete every copy of ``step`` (``step-<N>`` and replacement copies), each ``COMMIT`` first."""
        steps, replacing = self._prefixes()
        for rel in [*replacing.get(step, []), *([steps[step]] if step in steps else [])]:
            self._delete(rel)
        logger.info("removed %s", f"{self.url}/step-{step}")

    def _promote(self, step: int, src: str) -> None:
        """Make the committed replacement copy ``src`` the directory ``step-<N>``; then delete ``src``.

        ``src`` stays committed until ``step-<N>/COMMIT`` is copied (last), so step N is committed
        at every instant.
        """
        dst = f"step-{step}"
        self._delete(dst)  # from here until its COMMIT is copied, ``src`` is step N
        base = self.path(src)
        rels = sorted(posixpath.relpath(str(p), base) for p in self.fs.find(base))
        if COMMIT_NAME not in rels:
            raise IncompleteCheckpointError(f"{self.url}/{src}: lost its COMMIT while being promoted")
        made: set[str] = set()
        for rel in [r for r in rels if r != COMMIT_NAME] + [COMMIT_NAME]:
            target = self.path(f"{dst}/{rel}")
            parent = posixpath.dirname(target)
            if parent not in made:
                self.fs.makedirs(parent, exist_ok=True)
                made.add(parent)
            self.fs.cp_file(posixpath.join(base, rel), target)
        self._delete(src)

    def prepare(self, step: int) -> str:
        """Rank 0, before uploading ``step``: tidy the store; returns the prefix to upload into.

        Finishes an interrupted replacement (a committed ``.step-<M>.replacing-*`` whose ``step-<M>``
        is not committed is promoted), deletes replacement copies made obsolete and every prefix
        without ``COMMIT``. Returns ``step-<N>``, or a new ``.step-<N>.replacing-<id>`` when step N
        is committed (it stays so until the new copy is committed).
        """
        steps, replacing = self._prefixes()
        for s, rels in replacing.items():
            keep = None
            if not (s in steps and self._committed(steps[s])):
                keep = next((rel for rel in rels if self._committed(rel)), None)
            for rel in rels:
                if rel != keep:
                    self._delete(rel)
            if keep is not None:
                logger.warning(
                    "%s/step-%s: finishing its replacement by %s (a save was interrupted)", self.url, s, keep
                )
                self._promote(s, keep)
        steps, _ = self._prefixes()
        target = f"step-{step}"
        for s, rel in steps.items():
            if self._committed(rel):
                if s == step:
                    target = work_name(step, "replacing")
                continue
            logger.info("removing %s/%s left by an interrupted save", self.url, rel)
            self._delete(rel)
        return target

    def commit(self, step: int, target: str, commit: bytes) -> None:
        """Rank 0, once every file is written to ``target``: ``COMMIT`` last, exclusively; promote
        a replacement copy; abort multipart uploads of killed saves begun before this commit."""
        if not self.put_bytes(f"{target}/{COMMIT_NAME}", commit, exclusive=True):
            raise CheckpointBusyError(
                f"{self.url}/{target}: another save committed step {step} first (its {COMMIT_NAME} "
                "exists); this save's files are left for the next save's cleanup"
            )
        if target != f"step-{step}":
            self._promote(step, target)
        with contextlib.suppress(OSError, ValueError):
            abort_dead_uploads(self.storage, self.root, self.path(f"{target}/{COMMIT_NAME}"))

    def _download(self, prefix: str, dest: str, keep: Callable[[str], bool]) -> list[str]:
        base = self.path(prefix)
        got = []
        for remote in sorted(self.fs.find(base)):
            rel = posixpath.relpath(str(remote), base)
            if rel.startswith("..") or not keep(rel):
                continue
            local = os.path.join(dest, *rel.split("/"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self.fs.get_file(remote, local)
            got.append(rel)
        return got

    def download_step(self, step: int, dest: str, rank: int) -> None:
        """Fetch what ``load`` reads on ``rank``: all but ``hf/`` and other ranks' train states."""
        own = {f"rank-{rank:05d}", "rank-00000"}

        def keep(rel: str) -> bool:
            if rel.startswith(HF_DIR + "/"):
                return False
            if rel.startswith(TRAIN_STATE_DIR + "/"):
                return posixpath.basename(rel).split(".")[0] in own
            return True

        prefix = self.committed_prefixes().get(step)
        got = self._download(prefix, dest, keep) if prefix is not None else []
        if COMMIT_NAME not in got:  # deleted by retention or a replacing save since it was listed
            raise IncompleteCheckpointError(f"{self.url}/step-{step} is no longer committed")

    def download(self, target: str, sub: str, dest: str) -> None:
        """Download ``target/<sub>/`` (a save in progress: not checked for ``COMMIT``) into ``dest``."""
        self._download(target, dest, lambda rel: rel.startswith(sub + "/"))
