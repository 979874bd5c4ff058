"""``GeneralCheckpointIO``: the single-process case of the same machinery."""

from __future__ import annotations

from unickpt.io.checkpoint_io import CheckpointIO

__all__ = ["GeneralCheckpointIO"]


class GeneralCheckpointIO(CheckpointIO):
    """Checkpoint IO for a model on one process (no parallelism).

    It is ``CheckpointIO`` with no mesh: the same planner, writer, hashes and commit as the
    distributed plugins, so its checkpoints load under any of them and the reverse.
    """

    plugin_name = "general"
