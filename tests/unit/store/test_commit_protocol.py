"""A model-based test of the commit protocol (docs/format.md, section 6).

A hypothesis state machine drives one directory through random sequences of saves of both kinds
(model, optimizer) in every layout (single file, gathered sharded, sliced one file, sliced sharded)
with varying tensor and shard-file counts, re-saves, deletions, saves SIGKILLed at their k-th
file-system event (a forked child, as in test_crash_safety), and readers that open the checkpoint
at one file-system event of a save and read its data at a later one. After every step, for each
kind, every reader must find the same single committed checkpoint:

- unickpt's reader (``open_checkpoint(pin=True)``, all bytes read and hash-verified);
- the Hugging Face rule (a single ``<kind>.safetensors`` first, else the index's ``weight_map``),
  read with safetensors, which must load the same tensors where the layout is Hugging Face
  loadable, fail where it is sliced, and find nothing (or fail) when nothing is committed;

and that checkpoint must be the last completed save, or, after a kill, the previous one, the killed
one, or none (``IncompleteCheckpointError``); never a mix, never a stale one, and the other kind's
committed checkpoint is never touched. A completed save leaves no staging file of any earlier
killed save and no data file of the kind that its index does not name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _reliability import run_child
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from safetensors import safe_open

from unickpt.ckpt.reader import CheckpointReader, open_checkpoint
from unickpt.ckpt.safetensors_io import SafetensorsWriter
from unickpt.errors import CheckpointChangedError, IncompleteCheckpointError, UnickptError
from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import local_slices
from unickpt.spec.index import LayoutInfo
from unickpt.spec.naming import SLICED_SENTINEL, index_name, is_own_data_file, single_name
from unickpt.store.lock import LOCK_NAME
from unickpt.store.publish import parse_temp_name

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

KINDS = ("model", "optimizer")
# fsync changes nothing a reader or a SIGKILL sees (only a power loss); the fast runs skip it,
# the slow runs keep it (its steps are then interleaving and kill points too).
FSYNC = {"on": False}
LAYOUTS = ("single", "gathered", "sliced", "sliced-sharded")
Content = dict[str, bytes]  # tensor name -> raw bytes
# One committed checkpoint as the test knows it: (content, layout), or None for "nothing committed".
Known = tuple[Content, str] | None
STATS: dict[str, int] = {
    "steps": 0,
    "saves": 0,
    "kills": 0,
    "kills_old": 0,
    "kills_new": 0,
    "kills_none": 0,
    "races": 0,
    "race_old": 0,
    "race_new": 0,
    "race_error": 0,
    "reader_checks": 0,
}


def tensors_for(kind: str, seed: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` small tensors (one fp32 of varying shape per index, a bf16 one, an int64 one)."""
    g = torch.Generator().manual_seed(seed * 2 + (kind == "optimizer"))
    prefix = "w" if kind == "model" else "state.w"
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        out[f"{prefix}{i}"] = torch.randn(3 + i, 5, generator=g)
    out[f"{prefix}.half"] = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    out[f"{prefix}.steps"] = torch.arange(3, dtype=torch.int64) + seed
    return out


def content_of(tensors: dict[str, torch.Tensor]) -> Content:
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


def save(directory: str, kind: str, layout: str, seed: int, n: int, shard_bytes: int) -> None:
    opts = SaveOptions(
        kind=kind,
        shard=layout in ("gathered", "sliced-sharded"),
        gather=layout in ("single", "gathered"),
        size_per_shard_mb=shard_bytes / (1024 * 1024),
        layout=LayoutInfo(),
        fsync=FSYNC["on"],
    )
    save_tensors(tensors_for(kind, seed, n), directory, opts, local_slices)


ERR = "error"  # a reader raised (the accepted UnickptError classes)


def read_all(r: CheckpointReader) -> Content:
    out: Content = {}
    for name, t in r.tensors.items():
        assert len(t.slices) == 1  # one process saves: one slice per tensor
        out[name] = bytes(r.read_key(t.table.file(0), t.table.key(0)))
    assert r.verify() == []
    return out


def read_unickpt(directory: str, kind: str) -> Content | str | None:
    """The committed ``kind`` checkpoint as unickpt reads it; None when there is none."""
    try:
        with open_checkpoint(directory, kind, pin=True) as r:
            return read_all(r)
    except IncompleteCheckpointError:
        return None


def read_hf(directory: str, kind: str) -> Content | str | None:
    """transformers' rule: ``<kind>.safetensors`` first, else the index; read with safetensors."""
    single = os.path.join(directory, single_name(kind))
    idx = os.path.join(directory, index_name(kind))
    out: Content = {}
    if os.path.isfile(single):
        files = {single: None}
    elif os.path.isfile(idx):
        with open(idx) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = {}
        for name, fname in weight_map.items():
            p = os.path.join(directory, fname)
            if not os.path.isfile(p):
                assert fname == SLICED_SENTINEL, f"weight_map names a missing {fname}"
                return ERR
            files.setdefault(p, [])
            files[p].append(name)  # type: ignore[union-attr]
    else:
        return None
    for p, names in files.items():
        with safe_open(p, framework="pt") as h:
            for k in names if names is not None else h.keys():
                out[k] = h.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


@contextlib.contextmanager
def fs_events(callback: Callable[[str], None]) -> Iterator[None]:
    """Call ``callback`` before and after every file-system step of a save in this process."""
    saved: dict[str, Any] = {}
    busy = [False]

    def tick(what: str) -> None:
        if not busy[0]:
            busy[0] = True
            try:
                callback(what)
            finally:
                busy[0] = False

    def around(name: str) -> None:
        orig = saved[name] = getattr(os, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            tick(f"before {name}")
            out = orig(*a, **k)
            tick(f"after {name}")
            return out

        setattr(os, name, wrapped)

    orig_write = SafetensorsWriter.write

    def write(self: SafetensorsWriter, key: str, data: Any) -> None:
        tick("before write")
        orig_write(self, key, data)
        tick("after write")

    # pwrite: gathered saves write headers and data in place (io/hf_save.py).
    for name in ("fsync", "replace", "unlink", "rename", "pwrite"):
        around(name)
    SafetensorsWriter.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        SafetensorsWriter.write = orig_write  # type: ignore[method-assign]
        for name, fn in saved.items():
            setattr(os, name, fn)


layouts = st.sampled_from(LAYOUTS)
kinds = st.sampled_from(KINDS)
seeds = st.integers(0, 10**6)
counts = st.integers(1, 4)
shard_sizes = st.sampled_from([60, 100, 400, 10**6])  # bytes per shard file: 1 to ~6 files


class CommitProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="unickpt-commit-")
        self.dir = os.path.join(self.root, "ck")
        self.known: dict[str, list[Known]] = {k: [None] for k in KINDS}  # possible committed states
        self.clean = True  # the last step was a completed save: no staging file, no lock
        # Kinds whose every data file is named by their committed checkpoint: a completed save of a
        # kind removes its superseded files; a killed one may leave them until the next save of it.
        self.tidy: set[str] = set(KINDS)

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ steps
    @rule(kind=kinds, layout=layouts, seed=seeds, n=counts, shard=shard_sizes)
    def save(self, kind: str, layout: str, seed: int, n: int, shard: int) -> None:
        save(self.dir, kind, layout, seed, n, shard)
        self.known[kind] = [(content_of(tensors_for(kind, seed, n)), layout)]
        self.clean = True
        self._completed(kind)
        STATS["saves"] += 1

    @rule(kind=kinds, layout=layouts, seed=seeds, n=counts, shard=shard_sizes, k=st.integers(1, 45))
    def killed_save(self, kind: str, layout: str, seed: int, n: int, shard: int, k: int) -> None:
        os.makedirs(self.dir, exist_ok=True)
        sig = run_child(
            k,
            lambda: save(self.dir, kind, layout, seed, n, shard),
            os.path.join(self.root, "events.json"),
        )
        new: Known = (content_of(tensors_for(kind, seed, n)), layout)
        if sig == signal.SIGKILL:
            self.known[kind] = [*self.known[kind], new, None]
            self.clean = False
            self.tidy.discard(kind)
            STATS["kills"] += 1
        else:
            assert sig == 0, f"the save failed in the child ({sig})"
            self.known[kind] = [new]
            self.clean = True
            self._completed(kind)

    @rule(
        rkind=kinds,
        kind=kinds,
        layout=layouts,
        seed=seeds,
        n=counts,
        shard=shard_sizes,
        at=st.integers(0, 90),
        then=st.integers(0, 90),
        pin=st.booleans(),
    )
    def read_during_save(
        self, rkind: str, kind: str, layout: str, seed: int, n: int, shard: int, at: int, then: int, pin: bool
    ) -> None:
        """A reader opens the ``rkind`` checkpoint at the ``at``-th event of a save and reads its data at
        the ``at + then``-th (or once the save has finished)."""
        old = list(self.known[rkind])
        new: Known = (content_of(tensors_for(kind, seed, n)), layout)
        events = [0]
        reader: list[CheckpointReader | str | None] = []
        got: list[Content | str | None] = []

        def open_reader() -> None:
            try:
                reader.append(open_checkpoint(self.dir, rkind, pin=pin))
            except IncompleteCheckpointError:
                reader.append(None)
            except UnickptError:
                reader.append(ERR)

        def read_data() -> None:
            r = reader[0]
            if not isinstance(r, CheckpointReader):
                got.append(r)
                return
            try:
                got.append(read_all(r))
            except (CheckpointChangedError, IncompleteCheckpointError):
                got.append(ERR)
            finally:
                r.close()

        def on_event(what: str) -> None:
            del what
            events[0] += 1
            if events[0] == at:
                open_reader()
            if events[0] == at + then and reader and not got:
                read_data()

        os.makedirs(self.dir, exist_ok=True)
        if at == 0:
            open_reader()
        with fs_events(on_event):
            save(self.dir, kind, layout, seed, n, shard)
        if not reader:
            open_reader()
        if not got:
            read_data()
        (result,) = got
        STATS["races"] += 1
        allowed = old + ([new] if rkind == kind else [])  # a save of the other kind changes nothing here
        self.known[kind] = [new]
        self.clean = True
        self._completed(kind)
        if result == ERR or result is None:
            # Nothing committed at that instant, or the checkpoint changed under the reader.
            assert rkind == kind or None in allowed, f"a save of the other kind disturbed a {rkind} reader"
            STATS["race_error"] += 1
            return
        matches = [kn for kn in allowed if kn is not None and kn[0] == result]
        assert matches, f"{rkind}: a racing reader read a checkpoint that was never committed (a mix)"
        STATS["race_new" if rkind == kind and matches[-1] == new else "race_old"] += 1

    @rule()
    def delete_directory(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.known = {k: [None] for k in KINDS}
        self.clean = True
        self.tidy = set(KINDS)

    def _completed(self, kind: str) -> None:
        """A save of ``kind`` completed: its superseded files are gone, and the other kind's shard
        files too when that kind has no committed index."""
        self.tidy.add(kind)
        for other in KINDS:
            if not os.path.exists(os.path.join(self.dir, index_name(other))):
                self.tidy.add(other)

    # ------------------------------------------------------------------ what every reader sees
    @invariant()
    def every_reader_sees_one_committed_checkpoint(self) -> None:
        STATS["steps"] += 1
        for kind in KINDS:
            # Never both commit markers: readers preferring either (transformers: the single file;
            # unickpt, huggingface_hub: the index) find the same checkpoint.
            assert not (
                os.path.exists(os.path.join(self.dir, single_name(kind)))
                and os.path.exists(os.path.join(self.dir, index_name(kind)))
            ), f"{kind}: both a single file and an index are committed"
            u = read_unickpt(self.dir, kind)
            h = read_hf(self.dir, kind)
            STATS["reader_checks"] += 2
            possible = self.known[kind]
            if u is None:
                assert None in possible, f"{kind}: a completed save's checkpoint is not committed"
                assert h in (None, ERR), f"{kind}: Hugging Face loads a stale checkpoint unickpt does not see"
                observed: Known = None
            else:
                assert isinstance(u, dict)
                matches = [kn for kn in possible if kn is not None and kn[0] == u]
                assert matches, (
                    f"{kind}: unickpt reads a checkpoint that is neither the last completed save nor the killed one"
                )
                observed = matches[-1]
                if observed[1] in ("single", "gathered"):
                    assert h == u, f"{kind}: Hugging Face loaders read another checkpoint than unickpt"
                else:
                    assert h == ERR, f"{kind}: Hugging Face loaders read a sliced checkpoint as if whole"
            if len(possible) > 1:
                new = possible[-2]
                if observed is None:
                    STATS["kills_none"] += 1
                elif new is not None and observed[0] == new[0]:
                    STATS["kills_new"] += 1
                else:
                    STATS["kills_old"] += 1
            self.known[kind] = [observed]
        if self.clean and os.path.isdir(self.dir):
            self._no_leftovers()

    def _no_leftovers(self) -> None:
        entries = os.listdir(self.dir)
        assert LOCK_NAME not in entries
        assert not [e for e in entries if parse_temp_name(e) is not None], entries
        for kind in self.tidy:
            kn = self.known[kind][0]
            own = sorted(e for e in entries if is_own_data_file(kind, e))
            if kn is None:
                assert own == [], f"{kind}: data files with no committed checkpoint: {own}"
                continue
            with open_checkpoint(self.dir, kind) as r:
                assert own == r.files, (
                    f"{kind}: files no committed checkpoint names: {set(own) - set(r.files)}"
                )


def _run(examples: int, steps: int) -> None:
    for k in STATS:
        STATS[k] = 0
    run_state_machine_as_test(
        CommitProtocol,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print("commit protocol:", json.dumps(STATS, sort_keys=True))
    assert STATS["kills"] > 0 and STATS["races"] > 0 and STATS["saves"] > 0


def test_commit_protocol_state_machine() -> None:
    _run(examples=16, steps=15)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_commit_protocol_state_machine_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FSYNC, "on", True)
    _run(examples=80, steps=25)


def _race_every_step(root: str, transitions: list[tuple[str, str]]) -> dict[str, int]:
    """For each layout change (from, to): a reader opens the committed ``from`` checkpoint (index or
    header only), then a ``to`` save runs, and the reader reads all data at its k-th file-system event,
    for every k. The reader gets the old tensors, the new ones, or CheckpointChangedError /
    IncompleteCheckpointError: never a mix."""
    outcomes = {"old": 0, "new": 0, "error": 0, "cases": 0}
    for i, (a, b) in enumerate(transitions):
        old = content_of(tensors_for("model", 1, 3))
        # Even cases: the same file names as the old save (files renamed over the old ones);
        # odd cases: fewer tensors and bigger shards (other names, old files removed after).
        n_new, shard_new = (3, 100) if i % 2 == 0 else (2, 400)
        new = content_of(tensors_for("model", 2, n_new))
        k = 0
        while True:
            k += 1
            d = os.path.join(root, f"race-{i}-{k}")
            save(d, "model", a, 1, 3, 100)
            r = open_checkpoint(d, "model")
            got: list[Content | str] = []
            events = [0]

            def on_event(
                what: str,
                r: CheckpointReader = r,
                k: int = k,
                got: list[Content | str] = got,
                events: list[int] = events,
            ) -> None:
                del what
                events[0] += 1
                if events[0] == k:
                    try:
                        got.append(read_all(r))
                    except (CheckpointChangedError, IncompleteCheckpointError):
                        got.append(ERR)

            with fs_events(on_event):
                save(d, "model", b, 2, n_new, shard_new)
            r.close()
            shutil.rmtree(d)
            if not got:
                break  # k is past the save's last event
            outcomes["cases"] += 1
            if got[0] == ERR:
                outcomes["error"] += 1
            else:
                assert got[0] in (old, new), f"{a} -> {b}: a reader read a mix of two saves at event {k}"
                outcomes["old" if got[0] == old else "new"] += 1
    return outcomes


def test_a_reader_racing_a_save_at_every_step(tmp_path: Any) -> None:
    transitions = [("gathered", "gathered"), ("sliced-sharded", "single")]
    outcomes = _race_every_step(str(tmp_path), transitions)
    print("race at every step:", outcomes)
    # Data files opened before the new ones are renamed in are the old save's: old bytes. After,
    # the reader finds another save's file and refuses it. The old index never names new data.
    assert outcomes["old"] > 0 and outcomes["error"] > 0 and outcomes["cases"] > 40


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_reader_racing_a_save_at_every_step_all_layouts(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(FSYNC, "on", True)
    outcomes = _race_every_step(str(tmp_path), [(a, b) for a in LAYOUTS for b in LAYOUTS])
    print("race at every step, all layout pairs:", outcomes)
    assert outcomes["old"] > 0 and outcomes["error"] > 0
