"""``CheckpointManager``: periodic saves, exact resume, async save, atomic commit, retention.

Modules: ``checkpoint_manager`` (the collective save and load), ``policy`` (when to save, which
step to load, retention), ``train_state`` (RNG, dataloader, extra states, their hashes),
``snapshot`` (what a save captures in the foreground), ``storage`` (a local directory or an
fsspec URL behind one interface). The layout's names are defined in ``ckpt/run_layout.py``.

Layout of ``checkpoint_dir``::

    step-<N>/                      one committed checkpoint (COMMIT marker inside)
        model/                     model checkpoint, every rank writing its own blocks: sliced, or
                                   Hugging Face files with save_hf=True
        optimizer/                 sliced optimizer checkpoint
        lr_scheduler.json          rank 0
        train_state/rank-<r>.json  per rank: step, RNG (Python, numpy), dataloader position, extra states
        train_state/rank-<r>.safetensors   per rank: torch RNG byte tensors, tensors of extra states
        train_state/rank-<r>.hashes.json   per rank: xxh3-64 of the two files above (rank 0: and
                                           lr_scheduler.json), checked by `unickpt verify`
        hf/                        Hugging Face copy (save_hf=True): copies of model/'s files (own inodes)
        COMMIT                     written last, before the directory is renamed into place
    latest                         {"step": N}: moved only after step-<N> is committed
    .step-<N>.staging-<id>/        a save in progress (or killed): never loaded, removed by a later save
    .step-<N>.old-<id>/            a replaced step N kept until its replacement is committed

A save is staged under ``.step-<N>.staging-<id>``; every rank fsyncs what it wrote; rank 0
writes ``COMMIT``, fsyncs, puts the directory in place as ``step-<N>``, fsyncs
``checkpoint_dir``, then replaces ``latest`` atomically and only then applies ``keep_last``.
Putting in place is one atomic rename for a new step. A step already committed (a resumed run
saving it again) is swapped with the stage atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
where the filesystem cannot swap, it is first renamed to ``.step-<N>.old-<id>``, which stays
committed (readers take it for step N while ``step-<N>`` is not committed, the next save moves
it back) and is deleted only once the new ``step-<N>`` is committed. A process killed at any
moment therefore leaves a committed copy of every committed step (``store/publish.py``;
``unickpt convert --to run`` writes a step in the same order, ``COMMIT`` then ``latest``, into
its one output: ``ckpt/run_layout.write_step``).

Saves into one directory are serialised by the kernel lock of ``.unickpt.lock`` (``flock``;
``CheckpointBusyError`` for a second manager, released by the kernel when a holder dies). A
cleanup removes only work directories whose owner is dead (each owner holds a ``flock`` on
its directory). ``load`` never silently starts from 0 when ``latest`` records a save and no
committed step is left (``IncompleteCheckpointError``), and does not fall back to an older
step when the chosen one is damaged: it raises, naming the other committed steps.

Every public method is collective: every rank calls it, in the same order, with its own
objects. Rank 0 does the directory work; every rank writes its own tensor blocks and state.

Async saves (``async_save=True``): ``save`` runs the cross-rank planning and copies this
rank's tensor blocks to CPU memory (shared memory) in the foreground, then this rank's writer
process writes, fsyncs and commits (``io/writer_process.py``: started when the manager is
built, reused by every save, closed by ``close()`` or at exit), without the training
process's GIL. The writers of the ranks form a gloo world of their own, never the training's
group, so they cannot interleave with the training's collectives. A store only this process
reaches (``memory://``) is written by a thread over a second gloo group instead. One save is in
flight at most; its error is raised by the next ``save`` or ``wait``.

Remote storage (``checkpoint_dir`` an fsspec URL other than ``file://``): object stores have no
atomic rename, so nothing is ever renamed or moved there, and nothing is staged on local disk.
Rank 0 first deletes ``step-*`` prefixes without ``COMMIT``; every rank then writes its files
straight into ``<url>/step-<N>/`` through the storage layer (the CheckpointIO saves on URLs:
streamed multipart uploads, the index of each checkpoint last); once every rank is done, rank 0
writes ``COMMIT`` last with an exclusive put (a second writer committing the same step gets
``CheckpointBusyError``), then ``latest``, then applies ``keep_last`` (deleting ``COMMIT``
first). A step is committed iff its ``COMMIT`` object exists; readers ignore the others. A
committed step saved again is written to ``.step-<N>.replacing-<id>/``, committed there, then
copied over ``step-<N>`` (see ``store/publish.py``): step N stays committed throughout.
Guarantees rest on whole-object PUTs and consistent listings (S3, GCS); limits: one writer per
URL, and each rank downloads the step (but ``hf/`` and other ranks' states) to load it. See
docs/guide.md, "Storage".
"""

from __future__ import annotations

from unickpt.ckpt.run_layout import COMMIT_NAME as COMMIT_NAME
from unickpt.ckpt.run_layout import HF_DIR as HF_DIR
from unickpt.ckpt.run_layout import LATEST_NAME as LATEST_NAME
from unickpt.ckpt.run_layout import TRAIN_STATE_DIR as TRAIN_STATE_DIR
from unickpt.manager.checkpoint_manager import CheckpointManager
from unickpt.manager.checkpoint_manager import RetentionWarning as RetentionWarning
from unickpt.manager.train_state import STATE_VERSION
from unickpt.store.publish import RemoteStore

__all__ = ["CheckpointManager"]

_STATE_VERSION = STATE_VERSION
_RemoteStore = RemoteStore  # (its former name here)
