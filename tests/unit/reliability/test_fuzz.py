"""Fuzzing with hypothesis: random mutations of valid headers and indexes, and random bytes, give either
success or a UnickptError from read_header / parse_index / open_checkpoint + validate_structure /
load_model, never another exception, and never change the model when they fail.

A few hundred cases per test by default; ``make fuzz`` sets UNICKPT_FUZZ_EXAMPLES=10000.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from pathlib import Path

import torch
from _reliability import INDEX, Tiny, same_state, save_checkpoint, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.safetensors_io import parse_header, read_header
from unickpt.errors import UnickptError
from unickpt.spec.index import parse_index

N = int(os.environ.get("UNICKPT_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), derandomize=N < 1000)

_BASE = Path(tempfile.mkdtemp(prefix="unickpt-fuzz-"))
_CK = _BASE / "ck"
save_checkpoint(_CK, 1)
_INDEX_BYTES = (_CK / INDEX).read_bytes()
_FILES = {f: (_CK / f).read_bytes() for f in os.listdir(_CK) if f.endswith(".safetensors")}
_FIRST = sorted(_FILES)[0]
_SINGLE = _BASE / "model.safetensors"
GeneralCheckpointIO().save_model(Tiny(1), str(_SINGLE))
_SINGLE_BYTES = _SINGLE.read_bytes()


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """edits: (kind, position, value). kind 0: set a byte, 1: delete a byte, 2: insert a byte, 3: truncate."""
    b = bytearray(data)
    for kind, pos, val in edits:
        if not b:
            break
        i = pos % len(b)
        if kind == 0:
            b[i] = val
        elif kind == 1:
            del b[i]
        elif kind == 2:
            b.insert(i, val)
        else:
            del b[i:]
    return bytes(b)


EDITS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6
)

# JSON values an attacker might splice in.
JSON_ATOMS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    # Any code point, lone surrogates and controls included (json.dumps escapes them as \uXXXX).
    st.text(st.characters(blacklist_categories=()), max_size=6),
)
JSON_VALUES = st.recursive(
    JSON_ATOMS,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:  # type: ignore[type-arg]
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _replace(obj: object, path: tuple, value: object) -> object:  # type: ignore[type-arg]
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {k: (_replace(v, rest, value) if k == head else v) for k, v in obj.items()}
    assert isinstance(obj, list)
    return [(_replace(v, rest, value) if i == head else v) for i, v in enumerate(obj)]


_INDEX_OBJ = json.loads(_INDEX_BYTES)
_INDEX_PATHS = _paths(_INDEX_OBJ)
_HEADER_OBJ = json.loads(_FILES[_FIRST][8 : 8 + struct.unpack("<Q", _FILES[_FIRST][:8])[0]])
_HEADER_PATHS = _paths(_HEADER_OBJ)


def _only_unickpt(fn) -> None:  # type: ignore[no-untyped-def]
    with contextlib.suppress(UnickptError):
        fn()


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_as_header(data: bytes) -> None:
    _only_unickpt(lambda: parse_header(data, len(data), "fuzz"))
    _only_unickpt(lambda: parse_index(data, "fuzz"))


@FUZZ
@given(EDITS)
def test_byte_mutations_of_safetensors_file(edits: list[tuple[int, int, int]]) -> None:
    with tempfile.TemporaryDirectory(dir=_BASE) as d:
        p = Path(d) / "model.safetensors"
        p.write_bytes(_mutate(_SINGLE_BYTES, edits))
        _only_unickpt(lambda: read_header(p))
        m = Tiny(9)
        snap = snapshot(m)
        try:
            GeneralCheckpointIO().load_model(m, p, verify=True)
        except UnickptError:
            assert same_state(m, snap)


@FUZZ
@given(st.integers(0, len(_HEADER_PATHS) - 1), JSON_VALUES)
def test_structured_header_mutations(which: int, value: object) -> None:
    obj = _replace(_HEADER_OBJ, _HEADER_PATHS[which], value)
    raw = json.dumps(obj).encode()
    data = _FILES[_FIRST][8 + struct.unpack("<Q", _FILES[_FIRST][:8])[0] :]
    _only_unickpt(lambda: parse_header(raw, len(data), "fuzz"))


def _load_dir(index_bytes: bytes, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(dir=_BASE) as d:
        dd = Path(d)
        for f, b in files.items():
            (dd / f).write_bytes(b)
        (dd / INDEX).write_bytes(index_bytes)
        before = sorted(os.listdir(dd))
        _only_unickpt(lambda: open_checkpoint(dd).validate_structure())
        m = Tiny(9)
        snap = snapshot(m)
        try:
            GeneralCheckpointIO().load_model(m, dd, verify=True)
        except UnickptError:
            assert same_state(m, snap)
        assert sorted(os.listdir(dd)) == before  # loading never writes


@FUZZ
@given(EDITS)
def test_byte_mutations_of_index(edits: list[tuple[int, int, int]]) -> None:
    _load_dir(_mutate(_INDEX_BYTES, edits), _FILES)


@FUZZ
@given(st.integers(0, len(_INDEX_PATHS) - 1), JSON_VALUES)
def test_structured_index_mutations(which: int, value: object) -> None:
    obj = _replace(_INDEX_OBJ, _INDEX_PATHS[which], value)
    try:
        raw = json.dumps(obj).encode()
    except ValueError:
        return
    _load_dir(raw, _FILES)


@FUZZ
@given(st.sampled_from(sorted(_FILES)), EDITS)
def test_byte_mutations_of_shard_file(name: str, edits: list[tuple[int, int, int]]) -> None:
    _load_dir(_INDEX_BYTES, {**_FILES, name: _mutate(_FILES[name], edits)})


# ------------------------------------------------------------------ the tools and JSON state
def _tools_on(path: Path, out_root: Path) -> None:
    """Every offline tool on one (possibly hostile) checkpoint: success or UnickptError only, and
    a refused merge leaves no output."""
    from unickpt.tools.diff import diff_checkpoints
    from unickpt.tools.inspect import format_report, inspect_checkpoint
    from unickpt.tools.merge import merge_checkpoint
    from unickpt.tools.verify import verify_checkpoint

    _only_unickpt(
        lambda: format_report(inspect_checkpoint(path), verbose=True).encode("utf-8", "backslashreplace")
    )
    _only_unickpt(lambda: verify_checkpoint(path))
    _only_unickpt(lambda: diff_checkpoints(path, path, deep=True))
    out = out_root / "merged"
    try:
        merge_checkpoint(path, out)
    except UnickptError:
        assert not out.exists()


_SINGLE_META = json.loads(read_header(_SINGLE).metadata["unickpt"])
_SINGLE_PATHS = _paths(_SINGLE_META)


@FUZZ
@given(st.integers(0, len(_SINGLE_PATHS) - 1), JSON_VALUES)
def test_structured_single_file_block_mutations(which: int, value: object) -> None:
    """The unickpt block inside a single file's header metadata, mutated, through every tool."""
    from unickpt.ckpt.safetensors_io import encode_header

    block = _replace(_SINGLE_META, _SINGLE_PATHS[which], value)
    h = read_header(_SINGLE)
    meta = {**h.metadata, "unickpt": json.dumps(block)}
    specs = [(k, e.dtype, e.shape) for k, e in sorted(h.entries.items(), key=lambda kv: kv[1].begin)]
    header, _ = encode_header(specs, meta)
    with tempfile.TemporaryDirectory(dir=_BASE) as d:
        p = Path(d) / "renamed by user.safetensors"
        p.write_bytes(header + _SINGLE_BYTES[h.data_start :])
        m = Tiny(9)
        snap = snapshot(m)
        try:
            GeneralCheckpointIO().load_model(m, p, verify=True)
        except UnickptError:
            assert same_state(m, snap)
        _tools_on(p, Path(d))


@FUZZ
@given(EDITS)
def test_byte_mutations_of_index_through_the_tools(edits: list[tuple[int, int, int]]) -> None:
    with tempfile.TemporaryDirectory(dir=_BASE) as d:
        dd = Path(d) / "ck"
        dd.mkdir()
        for f, b in _FILES.items():
            (dd / f).write_bytes(b)
        (dd / INDEX).write_bytes(_mutate(_INDEX_BYTES, edits))
        _tools_on(dd, Path(d))


_TENSOR_SPECS = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(
            st.sampled_from(["F32", "I8", "BOOL", "U64", "BF16", "F8_E4M3", "Q4"]), JSON_ATOMS
        ),
        "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), JSON_VALUES),
        "data": st.one_of(st.lists(JSON_ATOMS, max_size=8), JSON_VALUES),
    },
)


@FUZZ
@given(
    st.one_of(
        JSON_VALUES,
        st.builds(lambda t: {"__tensor__": t}, _TENSOR_SPECS),
        st.builds(lambda v: {"x": [{"__tensor__": v}]}, JSON_VALUES),
    )
)
def test_json_state_values(value: object) -> None:
    """JSON state (param_groups, param_state, LR schedulers) from untrusted JSON: a value or IndexFileError."""
    from unickpt.errors import IndexFileError, UnsupportedError
    from unickpt.io.jsonstate import from_json_value

    with contextlib.suppress(IndexFileError, UnsupportedError):
        from_json_value(value)


def test_fuzz_settings() -> None:
    assert N >= 100 and torch.get_num_threads() >= 1
