"""Where bytes live and how they are published (no torch; imports ``unickpt.spec`` and ``unickpt.errors``).

- ``storage.py``: ``Storage``, with what a store can do asked of it (``range_write``,
  ``atomic_rename``, ``exclusive_put``, ``conditional_put``, ``kernel_copy``, ``durable_sync``,
  ``fetch_ahead``, ``local_path``); ``LocalStorage`` (POSIX files: its read handles' vectored
  ``preadv`` and its writes' write-behind hints with them) and ``FsspecStorage`` (any fsspec URL,
  behind ``storage_guard.py``'s deadlines and error mapping); ``storage_parts.py`` and
  ``storage_s3.py`` (shared multipart uploads);
- ``publish.py``: the one publish protocol (staged names, the commit point last, cleanup
  after) of a checkpoint, a manager step and a tool's output, locally and on object stores,
  and the one small-file writer;
- ``lock.py``: the one fenced save lock (``flock`` locally; a lock object whose heartbeat,
  release and pre-commit check are conditional on its ETag on a store).
"""
