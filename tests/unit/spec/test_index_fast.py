"""``parse_index`` (the one index validator, ``index.IndexParser``) on hostile input.

Random valid indexes and random single mutations of them (wrong types, values pydantic's lax
mode would coerce, negative and huge integers, bad hex, unknown and missing keys, key orders,
out-of-bounds slices, unsafe file names, dangling aliases, duplicate keys, escaped colons):
``parse_index`` accepts exactly what the schema declared by the models of ``index``
accepts (the declaration ``docs/index.schema.json`` is exported from; the test asks the models
directly, no parse goes through them), builds the same objects, and refuses everything else
with the same exception type and a message that names the file and the field.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from unickpt.errors import IndexFileError, UnsafePathError
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.index import (
    SCHEMA_MISMATCH,
    ByteRange,
    IndexFile,
    IndexMetadata,
    LayoutInfo,
    OtherFormatVersion,
    SliceEntry,
    TensorEntry,
    UnickptBlock,
    hex_to_b64,
    index_to_json,
    parse_index,
    version_error,
)
from unickpt.spec.naming import SLICED_SENTINEL
from unickpt.spec.untrusted import check_unicode, colon_budget, count_pairs_and_colons, strict_loads


def _schema_validate(raw: bytes) -> IndexFile:
    """What the schema's declaration (the pydantic models) says of ``raw``: the index it builds,
    or an exception of the type ``parse_index`` must raise (the test's reference; the library
    never validates an index this way)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise IndexFileError("not UTF-8") from None
    check_unicode(text, IndexFileError, "index")
    obj = strict_loads(text, IndexFileError, "index")
    if not isinstance(obj, dict):
        raise IndexFileError("not an object")
    try:
        return IndexFile.model_validate(obj)
    except ValidationError as e:
        for err in e.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, UnsafePathError):
                raise cause from None
            if isinstance(cause, OtherFormatVersion):
                raise version_error("idx.json", cause.version) from None
        raise IndexFileError(str(e)) from None


N = int(os.environ.get("UNICKPT_FUZZ_EXAMPLES", "300"))
PROPS = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), derandomize=N < 1000)

FILES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "m.bin", SLICED_SENTINEL]
BAD_FILES = [
    "../x.safetensors",
    "/abs.safetensors",
    "a/b.safetensors",
    "a\\b.safetensors",
    ".hidden.safetensors",
    "x.txt",
    "",
    "C:x.safetensors",
    "x:y.safetensors",
    "a..b.safetensors",
    "x" * 300 + ".safetensors",
]
# Values a mutation puts anywhere: each one is wrong for some fields, right or coercible for others.
REPLACEMENTS: list[Any] = [
    -1,
    0,
    1,
    2,
    2**62 - 1,
    2**62,
    2**70,
    1.5,
    2.0,
    1.0,
    -0.0,
    1e300,
    True,
    False,
    None,
    "3",
    " 7 ",
    "1_0",
    "abc",
    "true",
    "model",
    "F32",
    "",
    [],
    {},
    [1],
    [-1],
    ["1"],
    {"a": 1},
    "0123456789abcdef",
    "0123456789ABCDEF",
    "0123456789abcde",
    "0123456789abcdef0",
    "0123456789abcdef\n",
    "\uff10123456789abcdef",  # a full-width digit zero
    "012345678,abcdef",
    FILES[0],
    BAD_FILES[0],
]

_names = st.one_of(
    st.text(min_size=1, max_size=8),
    st.sampled_from(["model.layers.0.mlp.up_proj.weight", "a:b", "x::y", "@0", "é", "state.w.exp_avg"]),
)
_hex = st.integers(0, 2**64 - 1).map(lambda v: f"{v:016x}")
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
_json_values = st.recursive(
    _json_scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)


@st.composite
def _slice(draw: st.DrawFn, shape: list[int], k: int, name: str) -> dict[str, Any]:
    offsets, dims = [], []
    for g in shape:
        o = draw(st.integers(0, g))
        offsets.append(o)
        dims.append(draw(st.integers(0, g - o)))
    s: dict[str, Any] = {
        "file": draw(st.sampled_from(FILES[:3])),
        "key": draw(st.sampled_from([f"{name}@{k}", name])) if draw(st.booleans()) else draw(_names),
        "offsets": offsets,
        "shape": dims,
    }
    xx = draw(st.sampled_from(["hex", "hex", "hex", "absent", "null"]))
    if xx == "hex":
        s["xxh3"] = draw(_hex)
    elif xx == "null":
        s["xxh3"] = None
    return s


@st.composite
def _tensor(draw: st.DrawFn, name: str) -> dict[str, Any]:
    nd = draw(st.integers(0, 3))
    dims = st.integers(0, 7) | st.sampled_from([2**20, 2**40])
    shape = draw(st.lists(dims, min_size=nd, max_size=nd).filter(lambda s: math.prod(s) < 2**62))
    t: dict[str, Any] = {"dtype": draw(st.sampled_from(sorted(DTYPE_ITEMSIZE))), "shape": shape}
    if draw(st.booleans()):
        t["fingerprint"] = draw(st.none() | _hex.map(hex_to_b64))
    t["slices"] = [draw(_slice(shape, k, name)) for k in range(draw(st.integers(0, 4)))]
    for opt in ("param", "state"):
        if draw(st.integers(0, 3)) == 0:
            t[opt] = draw(st.none() | _names)
    return t


@st.composite
def _index(draw: st.DrawFn) -> dict[str, Any]:
    """A valid index, keys in model order (the form unickpt writes)."""
    names = draw(st.lists(_names, min_size=0, max_size=4, unique=True))
    obj: dict[str, Any] = {}
    if draw(st.booleans()):
        meta: dict[str, Any] = {}
        if draw(st.booleans()):
            meta["total_size"] = draw(st.integers(0, 2**62 - 1))
        meta.update(draw(st.dictionaries(st.sampled_from(["format", "a:b", "x"]), _json_values, max_size=2)))
        obj["metadata"] = meta
    obj["weight_map"] = {n: draw(st.sampled_from(FILES)) for n in names}
    if draw(st.integers(0, 5)) > 0:
        block: dict[str, Any] = {}
        if draw(st.booleans()):
            block["format_version"] = 5
        block["kind"] = draw(st.sampled_from(["model", "optimizer"]))
        if draw(st.booleans()):
            block["created_by"] = draw(st.sampled_from(["unickpt 0.1.0", "a:b"]))
        if draw(st.booleans()):
            layout: dict[str, Any] = {}
            for k, strat in (
                ("plugin", st.sampled_from(["fsdp2", "ddp:x"])),
                ("world_size", st.integers(1, 1024)),
                (
                    "mesh",
                    st.dictionaries(st.sampled_from(["dp", "tp", "a:b"]), st.integers(1, 8), max_size=2),
                ),
                ("gathered", st.booleans()),
            ):
                if draw(st.booleans()):
                    layout[k] = draw(strat)
            block["layout"] = layout
        block["tensors"] = {n: draw(_tensor(n)) for n in names}
        if names and draw(st.booleans()):
            extra_names = draw(st.lists(_names, max_size=2, unique=True))
            block["aliases"] = {a: draw(st.sampled_from(names)) for a in extra_names if a not in names}
        if draw(st.integers(0, 3)) == 0:
            block["param_groups"] = draw(
                st.none()
                | st.lists(
                    st.dictionaries(st.sampled_from(["lr", "params", "a:b"]), _json_values), max_size=2
                )
            )
        if draw(st.integers(0, 3)) == 0:
            block["param_state"] = draw(
                st.dictionaries(
                    _names, st.dictionaries(st.sampled_from(["step", "x:y"]), _json_values), max_size=2
                )
            )
        obj["unickpt"] = block
    elif draw(st.booleans()):
        obj["unickpt"] = None
    obj.update(
        draw(
            st.dictionaries(st.sampled_from(["extra", "_x", "_fields_set", "k:v"]), _json_values, max_size=2)
        )
    )
    return obj


# ----------------------------------------------------------------------------------------- mutations
def _paths(v: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON value (root excluded)."""
    out = []
    if isinstance(v, dict):
        for k, x in v.items():
            out.append((*at, k))
            out += _paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out.append((*at, i))
            out += _paths(x, (*at, i))
    return out


def _containers(v: Any, kind: type, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if isinstance(v, kind) else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _containers(x, kind, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _containers(x, kind, (*at, i))
    return out


def _get(v: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        v = v[p]
    return v


def _slices_of(obj: dict[str, Any]) -> list[dict[str, Any]]:
    u = obj.get("unickpt")
    if not isinstance(u, dict):
        return []
    return [s for t in u["tensors"].values() for s in t["slices"]]


def _dumps(v: Any, ascii_only: bool, dup: tuple[int, int, int, bool] | None, counter: list[int]) -> str:
    """Compact JSON, with one duplicated member in the dup[0]-th object (pre-order) when asked."""
    if isinstance(v, dict):
        index = counter[0]
        counter[0] += 1
        items = [
            f"{json.dumps(k, ensure_ascii=ascii_only)}:{_dumps(x, ascii_only, dup, counter)}"
            for k, x in v.items()
        ]
        if dup is not None and index == dup[0] and v:
            k = list(v)[dup[1] % len(v)]
            again = _dumps(v[k], ascii_only, None, [0]) if dup[3] else "0"
            items.insert(dup[2] % (len(items) + 1), f"{json.dumps(k, ensure_ascii=ascii_only)}:{again}")
        return "{" + ",".join(items) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_dumps(x, ascii_only, dup, counter) for x in v) + "]"
    return json.dumps(v, ensure_ascii=ascii_only)


@st.composite
def _case(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(index bytes, whether the fast path must take it without falling back when it is valid)."""
    obj = draw(_index())
    canonical = True
    dup = None
    escape = False
    kind = draw(
        st.sampled_from(
            [
                "none",
                "replace",
                "replace",
                "replace",
                "extra",
                "delete",
                "order",
                "file",
                "alias",
                "bounds",
                "dims",
                "dup",
                "escape",
                "escaped_dup",
                "version",
                "hex",
            ]
        )
    )
    paths = _paths(obj)
    if kind == "replace" and paths:
        path = paths[draw(st.integers(0, len(paths) - 1))]
        _get(obj, path[:-1])[path[-1]] = copy.deepcopy(draw(st.sampled_from(REPLACEMENTS)))
        canonical = False  # pydantic's lax mode may take it: the fallback decides
    elif kind == "extra":
        dicts = _containers(obj, dict)
        d = _get(obj, dicts[draw(st.integers(0, len(dicts) - 1))])
        d[draw(st.sampled_from(["zz", "xxh3", "param", "a:b"]))] = draw(st.sampled_from([1, None, "x"]))
        canonical = False
    elif kind == "delete":
        dicts = [p for p in _containers(obj, dict) if _get(obj, p)]
        if dicts:
            d = _get(obj, dicts[draw(st.integers(0, len(dicts) - 1))])
            del d[draw(st.sampled_from(sorted(d)))]
    elif kind == "order":
        dicts = [p for p in _containers(obj, dict) if len(_get(obj, p)) > 1]
        if dicts:
            d = _get(obj, dicts[draw(st.integers(0, len(dicts) - 1))])
            items = list(d.items())
            order = draw(st.permutations(range(len(items))))
            d.clear()
            d.update(items[i] for i in order)
    elif kind == "file":
        slices = _slices_of(obj)
        bad = draw(st.sampled_from(BAD_FILES))
        if slices and draw(st.booleans()):
            slices[draw(st.integers(0, len(slices) - 1))]["file"] = bad
        elif obj["weight_map"]:
            obj["weight_map"][draw(st.sampled_from(sorted(obj["weight_map"])))] = bad
    elif kind == "alias" and isinstance(obj.get("unickpt"), dict):
        tensors = obj["unickpt"]["tensors"]
        aliases = obj["unickpt"].setdefault("aliases", {})
        if tensors and draw(st.booleans()):
            aliases[draw(st.sampled_from(sorted(tensors)))] = draw(st.sampled_from(sorted(tensors)))
        else:
            aliases["dangling.alias"] = "not.a.stored.tensor"
    elif kind in ("bounds", "dims"):
        slices = [s for s in _slices_of(obj) if s["offsets"]]
        if slices:
            s = slices[draw(st.integers(0, len(slices) - 1))]
            d = draw(st.integers(0, len(s["offsets"]) - 1))
            if kind == "bounds":
                s["offsets"][d] += draw(st.integers(1, 3))
            else:
                draw(st.sampled_from([s["offsets"], s["shape"]])).append(0)
    elif kind == "dup":
        ndicts = len(_containers(obj, dict))
        dup = (
            draw(st.integers(0, ndicts - 1)),
            draw(st.integers(0, 99)),
            draw(st.integers(0, 99)),
            draw(st.booleans()),
        )
    elif kind in ("escape", "escaped_dup"):
        obj["zz:esc"] = 1
        if kind == "escaped_dup":
            obj["zz\x00esc"] = 2  # becomes a second "zz:esc" once escaped in the text below
        escape = True
    elif kind == "version" and isinstance(obj.get("unickpt"), dict):
        obj["unickpt"]["format_version"] = draw(st.sampled_from([0, 2, True, 1.0, "1"]))
        canonical = False
    elif kind == "hex":
        slices = [s for s in _slices_of(obj) if s.get("xxh3")]
        if slices:
            slices[draw(st.integers(0, len(slices) - 1))]["xxh3"] = draw(
                st.sampled_from(
                    ["0123456789ABCDEF", "0123456789abcde", "g123456789abcdef", "0123456789abcdef "]
                )
            )
    ascii_only = draw(st.booleans())
    if dup is not None or escape or draw(st.booleans()):
        text = _dumps(obj, ascii_only, dup, [0])
    else:
        text = json.dumps(obj, indent=draw(st.sampled_from([None, 1, 2])), ensure_ascii=ascii_only)
    if escape:
        text = text.replace('"zz:esc"', '"zz\\u003aesc"').replace('"zz\\u0000esc"', '"zz:esc"')
        canonical = False
    return text.encode("utf-8", errors="surrogatepass"), canonical


# ----------------------------------------------------------------------------------------- comparison
def _state(v: Any) -> Any:
    """Everything that makes a model what it is, recursively, order- and type-sensitive."""
    if isinstance(v, BaseModel):
        return (
            type(v).__name__,
            [(k, _state(x)) for k, x in v.__dict__.items()],
            sorted(v.__pydantic_fields_set__),
            _state(v.__pydantic_extra__),
            v.__pydantic_private__,
        )
    if isinstance(v, dict):
        return ("dict", [(k, _state(x)) for k, x in v.items()])
    if isinstance(v, list):
        return ("list", [_state(x) for x in v])
    return (type(v).__name__, v)


def _outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as e:
        return ("error", type(e), str(e))


def _to_json(index: IndexFile) -> bytes | str:
    try:
        return index_to_json(index)
    except UnicodeEncodeError as e:  # a lone surrogate in a name: both paths must fail alike
        return f"UnicodeEncodeError: {e}"


def _check(raw: bytes, canonical: bool = False) -> None:
    ref = _outcome(lambda: _schema_validate(raw))
    got = _outcome(lambda: parse_index(raw, "idx.json"))
    assert got[0] == ref[0], (ref, got)
    if ref[0] == "ok":
        a, b = ref[1], got[1]
        assert a == b
        assert _state(a) == _state(b)
        assert _to_json(a) == _to_json(b)
    else:
        assert got[1] is ref[1], (ref, got)  # the same exception type
        assert got[2].startswith("idx.json: "), got
        if got[2].startswith(f"idx.json: {SCHEMA_MISMATCH}: "):
            # The field is named: a path of the index's keys and positions, then the finding.
            where = got[2].removeprefix(f"idx.json: {SCHEMA_MISMATCH}: ").split(": ")[0]
            assert where.split(".")[0] in ("metadata", "weight_map", "unickpt"), got


@PROPS
@given(_case())
def test_parse_accepts_exactly_what_the_schema_accepts(case: tuple[bytes, bool]) -> None:
    _check(*case)


@PROPS
@given(_index())
def test_valid_indexes_are_accepted(obj: dict[str, Any]) -> None:
    raw = index_to_json(IndexFile.model_validate(obj))
    _check(raw, True)
    assert index_to_json(parse_index(raw, "idx.json")) == raw


def _full_index() -> dict[str, Any]:
    """A small valid index with every optional field present."""
    obj = json.loads(_sliced(n_tensors=2, world=2))
    obj["metadata"]["format"] = "pt"
    block = obj["unickpt"]
    block.update(format_version=5, created_by="unickpt 0.1.0", aliases={"tied": "layers.0.weight"})
    block["layout"].update(mesh={"dp": 2}, gathered=False)
    block["param_groups"] = [{"lr": 0.1, "params": ["layers.0.weight"]}]
    block["param_state"] = {"layers.0.weight": {"step": 3}}
    t = block["tensors"]["layers.1.weight"]
    t.update(param="layers.1", state="exp_avg")
    t["slices"][1]["xxh3"] = None
    del t["slices"][0]["xxh3"]
    obj["weight_map"]["tied"] = SLICED_SENTINEL
    return obj


@pytest.mark.parametrize("value", REPLACEMENTS + BAD_FILES[1:], ids=repr)
def test_every_position_with_every_replacement(value: Any) -> None:
    """Each value put at each position of a full index, one at a time: refused exactly where the
    schema refuses, with the exception type it calls for and the field named."""
    base = _full_index()
    _check(index_to_json(IndexFile.model_validate(base)), True)
    for path in _paths(base):
        obj = copy.deepcopy(base)
        _get(obj, path[:-1])[path[-1]] = copy.deepcopy(value)
        _check(json.dumps(obj).encode(), False)


def test_every_key_removed_added_or_duplicated() -> None:
    base = _full_index()
    for at in _containers(base, dict):
        for k in list(_get(base, at)):
            obj = copy.deepcopy(base)
            del _get(obj, at)[k]
            _check(json.dumps(obj).encode(), True)
        for k in ("zz", "a:b", "xxh3", "param", "_x"):
            obj = copy.deepcopy(base)
            _get(obj, at)[k] = 1
            _check(json.dumps(obj).encode(), False)
    for i in range(len(_containers(base, dict))):
        for same in (True, False):
            _check(_dumps(base, True, (i, 0, 99, same), [0]).encode(), False)


# ----------------------------------------------------------------------------------------- duplicate keys
@st.composite
def _doc_with_maybe_dup(draw: st.DrawFn) -> tuple[str, bool]:
    value = draw(_json_values | st.dictionaries(_names, _json_values, max_size=4))
    ndicts = len(_containers(value, dict))
    nonempty = [i for i, p in enumerate(_containers(value, dict)) if _get(value, p)]
    dup = None
    if nonempty and draw(st.booleans()):
        dup = (
            draw(st.sampled_from(nonempty)),
            draw(st.integers(0, 99)),
            draw(st.integers(0, 99)),
            draw(st.booleans()),
        )
    assert ndicts >= len(nonempty)
    return _dumps(value, draw(st.booleans()), dup, [0]), dup is not None


@PROPS
@given(_doc_with_maybe_dup())
def test_colon_count_detects_exactly_the_duplicate_keys(case: tuple[str, bool]) -> None:
    text, has_dup = case
    raw = text.encode("utf-8", errors="surrogatepass")
    budget = colon_budget(raw)
    assert budget is not None  # json.dumps never escapes ':'
    pairs, colons = count_pairs_and_colons(json.loads(text))
    assert (pairs + colons != budget) == has_dup
    strict = _outcome(lambda: strict_loads(text, IndexFileError, "doc"))
    assert (strict[0] == "error") == has_dup


def test_an_escaped_colon_is_parsed_with_the_strict_parser() -> None:
    """The colon count cannot see through ``\\u003a``: such a text is parsed by ``strict_loads``,
    which finds duplicate keys itself; the index is otherwise checked as any other."""
    raw = b'{"a\\u003ab": 1, "a:b": 2, "weight_map": {}}'
    assert colon_budget(raw) is None
    with pytest.raises(IndexFileError, match="duplicate key 'a:b'"):
        parse_index(raw, "idx.json")
    ok = parse_index(b'{"a\\u003ab": 1, "weight_map": {}}', "idx.json")
    assert ok.model_extra == {"a:b": 1}
    with pytest.raises(IndexFileError, match=r"weight_map: expected an object, found an array"):
        parse_index(b'{"a\\u003ab": 1, "weight_map": []}', "idx.json")


def test_duplicate_keys_keep_their_message() -> None:
    raw = b'{"weight_map": {}, "unickpt": {"kind": "model", "tensors": {}, "kind": "model"}}'
    with pytest.raises(IndexFileError) as e:
        parse_index(raw, "idx.json")
    assert str(e.value) == "idx.json: index has a duplicate key 'kind'"


# ----------------------------------------------------------------------------------------- behaviour
def _sliced(n_tensors: int = 3, world: int = 4) -> bytes:
    tensors = {}
    for i in range(n_tensors):
        shape = [10 + i, 3]
        bounds = [round(r * shape[0] / world) for r in range(world + 1)]
        tensors[f"layers.{i}.weight"] = {
            "dtype": "BF16",
            "shape": shape,
            "fingerprint": hex_to_b64(f"{i:016x}"),
            "slices": [
                {
                    "file": f"model-{r + 1:05d}-of-{world:05d}.safetensors",
                    "key": f"layers.{i}.weight@{r}",
                    "offsets": [bounds[r], 0],
                    "shape": [bounds[r + 1] - bounds[r], 3],
                    "xxh3": f"{r * 7919 + i:016x}",
                }
                for r in range(world)
            ],
        }
    obj = {
        "metadata": {"total_size": 123},
        "weight_map": dict.fromkeys(tensors, SLICED_SENTINEL),
        "unickpt": {"kind": "model", "layout": {"plugin": "fsdp2", "world_size": world}, "tensors": tensors},
    }
    # Listed slices: their hashes in hex, which the edits of these tests keep valid.
    return index_to_json(IndexFile.model_validate(obj))


def test_written_index_builds_the_same_objects() -> None:
    raw = _sliced()
    fast = parse_index(raw, "idx.json")
    ref = _schema_validate(raw)
    assert fast == ref and _state(fast) == _state(ref) and index_to_json(fast) == raw
    s = fast.unickpt.tensors["layers.0.weight"].slices[0]  # type: ignore[union-attr]
    assert (
        type(s) is SliceEntry
        and type(s.offsets) is list
        and s.model_fields_set == set(SliceEntry.model_fields) - {"ranges"}
    )
    assert repr(s) == repr(ref.unickpt.tensors["layers.0.weight"].slices[0])  # type: ignore[union-attr]
    assert type(fast.metadata) is IndexMetadata and type(fast.unickpt.layout) is LayoutInfo  # type: ignore[union-attr]
    assert fast.unickpt.layout.mesh == {} and fast.unickpt.aliases == {}  # type: ignore[union-attr]


def test_slices_sharing_a_fields_set_stay_independent() -> None:
    raw = _sliced()
    idx = parse_index(raw, "idx.json")
    a, b = idx.unickpt.tensors["layers.0.weight"].slices[:2]  # type: ignore[union-attr]
    c = a.model_copy(update={"xxh3": None})
    assert c.xxh3 is None and a.xxh3 is not None
    assert b.model_fields_set == set(SliceEntry.model_fields) - {"ranges"}
    with pytest.raises(Exception, match="frozen"):
        a.key = "x"  # type: ignore[misc]
    assert b.model_fields_set == set(SliceEntry.model_fields) - {"ranges"}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda o, s: s.update(offsets=["0", 0]),
            "slices.0.offsets.0: expected an integer >= 0 below 2**62, found '0'",
        ),
        (
            lambda o, s: s.update(offsets=[0.0, 0]),
            "slices.0.offsets.0: expected an integer >= 0 below 2**62, found 0.0",
        ),
        (
            lambda o, s: s.update(offsets=[False, 0]),
            "slices.0.offsets.0: expected an integer >= 0 below 2**62, found false",
        ),
        (
            lambda o, s: s.update(shape=[2, 8.0]),
            "slices.0.shape.1: expected an integer >= 0 below 2**62, found 8.0",
        ),
        (
            lambda o, s: o["unickpt"]["layout"].update(gathered="yes"),
            "unickpt.layout.gathered: expected true or false, found 'yes'",
        ),
        (
            lambda o, s: o["unickpt"]["layout"].update(world_size=2.0),
            "unickpt.layout.world_size: expected an integer >= 1, found 2.0",
        ),
        (
            lambda o, s: o["unickpt"].update(format_version=True),
            "unickpt.format_version: expected the integer 5, found true",
        ),
        (
            lambda o, s: o["unickpt"].update(format_version=1.0),
            "unickpt.format_version: expected the integer 5, found 1.0",
        ),
        (
            lambda o, s: o["metadata"].update(total_size="12"),
            "metadata.total_size: expected an integer >= 0 below 2**62, found '12'",
        ),
    ],
)
def test_lax_values_are_refused(edit: Any, message: str) -> None:
    """JSON true, 0.0 and "0" are not integers (nor "yes" a boolean): pydantic's lax mode would
    take them; the index refuses them, naming the field, what it expects and what it found."""
    obj = json.loads(_sliced())
    edit(obj, obj["unickpt"]["tensors"]["layers.0.weight"]["slices"][0])
    raw = json.dumps(obj).encode()
    with pytest.raises(IndexFileError) as e:
        parse_index(raw, "i")
    assert str(e.value).startswith(f"i: {SCHEMA_MISMATCH}: ") and str(e.value).endswith(message), str(e.value)
    with pytest.raises(IndexFileError):
        _schema_validate(raw)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (
            lambda o, s: s.update(offsets=[-1, 0]),
            IndexFileError,
            "layers.0.weight.slices.0.offsets.0: expected an integer >= 0 below 2**62, found -1",
        ),
        (
            lambda o, s: s.update(file="../x.safetensors"),
            UnsafePathError,
            "refusing data file name '../x.safetensors'",
        ),
        (
            lambda o, s: s.update(offsets=[9, 0]),
            IndexFileError,
            "layers.0.weight.slices.0: slice 'layers.0.weight@0' in 'model-00001-of-00004.safetensors' "
            "spans [9, 11) on dim 0 of a tensor of size 10",
        ),
        (
            lambda o, s: s.update(xxh3="ABCDEF0123456789"),
            IndexFileError,
            "slices.0.xxh3: expected null or a string matching ^[0-9a-f]{16}$, found 'ABCDEF0123456789'",
        ),
        (
            lambda o, s: s.update(extra=1),
            IndexFileError,
            "slices.0.extra: unexpected key (the fields are file, key, offsets, shape, xxh3, ranges)",
        ),
        (
            lambda o, s: s.pop("key"),
            IndexFileError,
            "layers.0.weight.slices.0.key: missing (a required field)",
        ),
        (
            lambda o, s: o["unickpt"].update(aliases={"a": "nope"}),
            IndexFileError,
            "which is not a stored tensor",
        ),
    ],
)
def test_errors_keep_their_messages(edit: Any, error: type[Exception], message: str) -> None:
    obj = json.loads(_sliced())
    edit(obj, obj["unickpt"]["tensors"]["layers.0.weight"]["slices"][0])
    raw = json.dumps(obj).encode()
    with pytest.raises(error) as e:
        parse_index(raw, "idx.json")
    assert type(e.value) is error
    assert message in str(e.value) and str(e.value).startswith("idx.json: "), str(e.value)


@pytest.mark.parametrize("enabled", [True, False])
def test_garbage_collector_state_is_restored(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        parse_index(_sliced(), "idx.json")
        assert gc.isenabled() is enabled
        with pytest.raises(IndexFileError):
            parse_index(b'{"weight_map": []}', "idx.json")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_not_an_object_or_not_json() -> None:
    for raw in (b"[]", b"1", b"", b"{", b"\xff", b'{"weight_map": {}} x', b"\xef\xbb\xbf{}"):
        got = _outcome(lambda raw=raw: parse_index(raw, "i"))
        assert got[:2] == ("error", IndexFileError) and got[2].startswith("i: index "), got
    with pytest.raises(IndexFileError, match=r"^i: index must be a JSON object with a 'weight_map'$"):
        parse_index(b"[]", "i")
    with pytest.raises(IndexFileError, match=r"^i: index is not valid JSON \(Expecting"):
        parse_index(b"{", "i")
    with pytest.raises(IndexFileError, match=r"^i: index is not valid UTF-8"):
        parse_index(b"\xff", "i")


def test_deep_nesting_in_free_form_values_is_counted() -> None:
    """Free-form values nested deeper than any recursion are walked (the duplicate-key count)
    iteratively: such an index parses, and a duplicate key deep inside is still found."""
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    raw = json.dumps({"weight_map": {}, "extra": deep}).encode()
    assert parse_index(raw, "i") == _schema_validate(raw)
    dup = raw.replace(b"[1]", b'[{"a": 1, "a": 2}]')
    with pytest.raises(IndexFileError, match="duplicate key 'a'"):
        parse_index(dup, "i")


def test_fast_checks_know_the_models() -> None:
    """The fast path mirrors these fields and validators: a change to the models must update it."""
    fields = {
        SliceEntry: ["file", "key", "offsets", "shape", "xxh3", "ranges"],
        ByteRange: ["start", "end", "xxh3"],
        TensorEntry: [
            *("dtype", "shape", "fingerprint", "slices", "param", "state"),
            *("grid", "boxes", "file", "keys", "xxh3"),
        ],
        LayoutInfo: ["plugin", "world_size", "mesh", "gathered"],
        UnickptBlock: [
            "format_version",
            "kind",
            "files",
            "created_by",
            "layout",
            "tensors",
            "aliases",
            "param_groups",
            "param_state",
            "save_id",
        ],
        IndexMetadata: ["total_size"],
        IndexFile: ["metadata", "weight_map", "unickpt"],
    }
    validators = {
        TensorEntry: {"_dtype", "_slices_in_bounds", "_dump", "_listed_slices"},
        UnickptBlock: {
            "_files_are_safe",
            "_aliases_resolve",
            "_version_is_an_integer",
            "_state_not_too_deep",
            "_from_text_form",  # the fast path calls its block_from_json too
            "_to_text_form",
        },
        IndexFile: {"_safe_files", "_plain_metadata_is_informational"},
    }
    for cls, names in fields.items():
        assert list(cls.model_fields) == names, cls
        d = cls.__pydantic_decorators__
        found = (
            set(d.field_validators)
            | set(d.model_validators)
            | set(d.field_serializers)
            | set(d.model_serializers)
        )
        assert found == validators.get(cls, set()), cls
        extra = "allow" if cls in (IndexFile, IndexMetadata) else "forbid"
        assert cls.model_config.get("extra") == extra and cls.model_config.get("frozen") is True, cls


def test_a_frozen_heap_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The new objects are promoted with freeze + unfreeze only when nothing else is frozen."""
    assert gc.get_freeze_count() == 0
    keep = [[i] for i in range(100)]
    gc.freeze()
    calls: list[str] = []
    try:
        # Counting frozen objects would be flaky (frozen objects can be freed meanwhile): watch
        # the calls instead.
        with monkeypatch.context() as m:
            m.setattr(gc, "freeze", lambda: calls.append("freeze"))
            m.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
            parse_index(_sliced(), "idx.json")
        assert calls == []
    finally:
        gc.unfreeze()
    del keep
    parse_index(_sliced(), "idx.json")
    assert gc.get_freeze_count() == 0


# ------------------------------------------------------------------ load_index's memory
def test_load_index_releases_the_bytes_and_text_while_building(tmp_path: Path) -> None:
    """load_index drops the file's bytes and decoded text before the models are built (it can
    read them again for the rare refusal that needs the text): its peak (Python allocations) is
    below parse_index's, whose caller holds the bytes, by about the file's size."""
    import tracemalloc

    from unickpt.spec.index import load_index

    raw = _sliced(n_tensors=100, world=32)
    p = tmp_path / "model.safetensors.index.json"
    p.write_bytes(raw)
    want = _state(_schema_validate(raw))
    peaks = {}
    for name, fn in [
        ("load_index", lambda: load_index(p)),
        ("parse_index", lambda: parse_index(p.read_bytes(), str(p))),
    ]:
        gc.collect()
        tracemalloc.start()
        try:
            got = fn()
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert _state(got) == want
    assert peaks["parse_index"] - peaks["load_index"] > 0.9 * len(raw), (peaks, len(raw))


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace(
            '"key": "layers.0.weight@0"', '"key": "layers.0.weight@0", "key": "x"', 1
        ),  # duplicate
        lambda t: t.replace(
            '"layers.1.weight@1"', '"layers.1.weight\\u003a1"', 1
        ),  # escaped ':' (parsed by strict_loads)
        lambda t: t.replace('"world_size": 4', '"world_size": 4.0', 1),  # lax value
        lambda t: t.replace('"world_size": 4', '"world_size": 4, "world_size": 4.0', 1),  # both
    ],
)
def test_load_index_reads_the_file_again_to_name_a_duplicate(tmp_path: Path, edit: Any) -> None:
    """load_index, which dropped the text, reads the file again when a refusal needs it: the
    same answer as parse_index on the same bytes (an index, or the same error)."""
    from unickpt.spec.index import load_index

    raw = edit(_sliced().decode()).encode()
    p = tmp_path / "model.safetensors.index.json"
    p.write_bytes(raw)
    try:
        want: object = _state(parse_index(raw, str(p)))
    except IndexFileError as e:
        want = str(e)
    try:
        got: object = _state(load_index(p))
    except IndexFileError as e:
        got = str(e)
    assert got == want


def test_the_parser_checks_every_field_of_the_models() -> None:
    """The parser reads field lists, types, bounds and rules from the models: each field
    either has a check written out (CUSTOM_FIELDS) or the plain check its declared type calls
    for; a field of a type with no plain check is refused when the module is built."""
    from unickpt.spec.index import CUSTOM_FIELDS, PLAIN_CHECKS, _plain_check

    models = {IndexFile, IndexMetadata, UnickptBlock, LayoutInfo, TensorEntry, SliceEntry, ByteRange}
    assert set(CUSTOM_FIELDS) == set(PLAIN_CHECKS) == models
    for cls in models:
        assert CUSTOM_FIELDS[cls] <= set(cls.model_fields), cls.__name__
        assert CUSTOM_FIELDS[cls] | set(PLAIN_CHECKS[cls]) == set(cls.model_fields), cls.__name__

    class Odd(BaseModel):
        ratio: float

    with pytest.raises(TypeError, match=r"Odd\.ratio"):
        _plain_check(Odd, "ratio")
