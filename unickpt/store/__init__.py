"""Where checkpoints live and how they are published: the store layer (format's level: it imports
``unickpt.format`` and ``unickpt.errors``, never torch).

- ``store/publish.py``: the one publish protocol (staged names, the commit point last, cleanup
  after) of a checkpoint, a manager step and a tool's output, locally and on object stores,
  and the one small-file writer;
- ``store/lock.py``: the one fenced save lock (``flock`` locally; a lock object whose
  heartbeat, release and pre-commit check are conditional on its ETag on a store).
"""
