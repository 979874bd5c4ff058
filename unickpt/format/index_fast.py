"""The fast path of ``parse_index``: the schema of ``index_models`` checked in one plain pass.

Validating with the models costs 13 to 20 us per listed slice, paid by every loading rank,
mostly per-object overhead. The fast path parses with plain ``json.loads`` and checks duplicate
keys by counting colons (``_json.colon_budget``); pauses the garbage collector while it builds
the tree (``index_bulk.gc_paused``); checks listed slices with C-level bulk operations
(``index_bulk.bulk_slices``; anything else through ``slices_slow``) and everything else with
plain code driven by the schema's one definition in ``index_models`` (field lists, bounds and
choices, and the rule functions the validators call); and builds the objects validation builds
(``model_construct``, or the attributes it sets, in bulk).

Any doubt raises NotFast, and parse_index then runs the models and reports their answer.
tests/unit/spec/test_index_fast.py checks that both paths accept the same inputs, build equal
indexes and refuse the rest with the same messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, cast

from annotated_types import Ge, Lt
from pydantic import BaseModel, Strict, ValidationError

from unickpt.errors import CheckpointFormatError, IndexFileError, UnsafePathError
from unickpt.format import index_models as models
from unickpt.format._json import TooDeep, colon_budget, count_pairs_and_colons, json_depth
from unickpt.format.digest_text import DigestTextError, block_from_json
from unickpt.format.dtypes import DTYPE_ITEMSIZE
from unickpt.format.index_bulk import (
    SLICE_FIELDS,
    SLICE_REQUIRED,
    bulk_slices,
    compact_field_colons,
    construct,
    found_text,
)
from unickpt.format.index_models import (
    HEX16,
    HEX16_BODY,
    KINDS,
    KNOWN_FORMAT_VERSIONS,
    MAX_DIM,
    MAX_STATE_DEPTH,
    MIN_POSITIVE,
    SAVE_ID_BODY,
    Hex16,
    NonNeg,
    alias_problem,
    attach_tables,
    check_file_name,
    compact_problem,
    fields_of,
    files_problem,
    ranges_problem,
    shape_problem,
    slice_problem,
    strict_metadata_ok,
)
from unickpt.format.versioning import OtherFormatVersion

__all__ = ["FastIndex", "NotFast"]

_TENSOR_FIELDS, _TENSOR_REQUIRED = fields_of(models.TensorEntry)
_LAYOUT_FIELDS, _LAYOUT_REQUIRED = fields_of(models.LayoutInfo)
_BLOCK_FIELDS, _BLOCK_REQUIRED = fields_of(models.UnickptBlock)
_VERSIONS = " or ".join(map(str, KNOWN_FORMAT_VERSIONS))
_KIND_CHOICES = " or ".join(map(repr, KINDS))
_hex16 = re.compile(HEX16_BODY).fullmatch
_save_id = re.compile(SAVE_ID_BODY).fullmatch
_SCHEMA = "index does not match the unickpt index schema"
# The fields whose checks FastIndex writes out (a rule, a bulk path or a lax case of their
# own), per model. Every other field is checked by the plain check its declared type calls for
# (_plain_check, read from index_models: str, str | None, a bounded strict int, a strict bool,
# list[NonNeg], Hex16 | None); a field of any other type fails at import until it gets a check.
CUSTOM_FIELDS: dict[type[BaseModel], frozenset[str]] = {
    models.IndexFile: frozenset({"metadata", "weight_map", "unickpt"}),
    models.IndexMetadata: frozenset(),
    models.UnickptBlock: frozenset(
        {"format_version", "kind", "files", "layout", "tensors", "aliases"}
        | {"param_groups", "param_state", "save_id"}
    ),
    models.LayoutInfo: frozenset({"mesh"}),
    models.TensorEntry: frozenset({"dtype", "slices", "grid", "boxes", "file", "keys", "xxh3"}),
    models.SliceEntry: frozenset({"file", "ranges"}),
    models.ByteRange: frozenset({"start", "end", "xxh3"}),  # each range checked by its model
}


class NotFast(Exception):
    """The fast checks do not vouch for the input: the full validation decides.

    ``problem`` is set when the input definitely breaks the schema (the full validation must
    refuse it too, else ``problem`` is raised as ``error``). It is None when pydantic's lax mode
    may still accept the input (``"3"`` or ``3.0`` for an integer, ``1`` for a boolean), and
    when the input has a duplicate key, escapes a colon or nests too deeply for the fast walk.
    """

    def __init__(
        self, problem: str | None = None, error: type[CheckpointFormatError] = IndexFileError
    ) -> None:
        super().__init__(problem)
        self.problem = problem
        self.error = error


def _schema(where: str, expected: str, value: Any) -> NotFast:
    return NotFast(f"{_SCHEMA}: {where}: expected {expected}, found {found_text(value)}")


class FastIndex:
    """One pass over the decoded index: checks, counts members and colons, builds the models."""

    __slots__ = ("budget", "colons", "files", "pairs", "raw", "shared")

    def __init__(self, raw: bytes | None, budget: int | None = None) -> None:
        self.raw = raw
        self.budget = budget  # colon_budget(raw), when the caller computed it and dropped raw
        self.pairs = 0  # members of every JSON object met
        self.colons = 0  # ':' in every string met that may hold one
        self.files: set[str] = set()  # distinct slice file names
        self.shared: dict[tuple[str, ...], set[str]] = {}  # fields sets of slices, by key order

    def parse(self, text: str | list[str]) -> models.IndexFile:
        """Parse ``text``; given as a one-item list, the text is taken out of it and dropped once
        decoded (with ``raw`` released by the caller, the index's bytes then cost nothing while
        the models are built)."""
        budget = colon_budget(self.raw) if self.raw is not None else self.budget
        self.raw = None
        if budget is None:
            raise NotFast
        try:
            obj = json.loads(text.pop() if isinstance(text, list) else text)
        except (ValueError, RecursionError):
            raise NotFast from None
        if type(obj) is not dict:
            raise NotFast
        try:
            index = self.index(obj)
        except (TooDeep, RecursionError, DigestTextError, OtherFormatVersion):  # the models word these
            raise NotFast from None
        if self.pairs + self.colons != budget:
            raise NotFast  # a duplicate key: strict_loads names it
        return index

    # ------------------------------------------------------------------ values
    def walk(self, v: Any) -> None:
        p, c = count_pairs_and_colons(v)
        self.pairs += p
        self.colons += c

    def string(self, v: Any, where: str, colons: bool = True) -> str:
        if type(v) is not str:
            raise _schema(where, "a string", v)
        if colons:
            self.colons += v.count(":")
        return v

    def integer(self, v: Any, where: str, lo: int, hi: int | None = None) -> int:
        if type(v) is int:
            if v >= lo and (hi is None or v < hi):
                return v
            bound = f" below {hi}" if hi is not None else ""
            raise _schema(where, f"an integer >= {lo}{bound}", v)
        if type(v) in (bool, float, str):
            raise NotFast  # pydantic's lax mode may coerce it
        raise _schema(where, "an integer", v)

    def optional_string(self, v: Any, where: str) -> str | None:
        return None if v is None else self.string(v, where)

    def boolean(self, v: Any, where: str) -> bool:
        if type(v) is not bool:
            if type(v) in (int, float, str):
                raise NotFast  # pydantic takes 0, 1, "true", "no"...
            raise _schema(where, "a boolean", v)
        return v

    def dims(self, v: Any, where: str) -> list[int]:
        if type(v) is not list:
            raise _schema(where, "an array of integers", v)
        for i, x in enumerate(v):
            self.integer(x, f"{where}.{i}", 0, MAX_DIM)
        return v

    def hex16(self, v: Any, where: str) -> str | None:
        if v is None or (type(v) is str and _hex16(v)):
            return v
        raise _schema(where, f"null or a string matching {HEX16}", v)

    def obj(self, v: Any, where: str, fields: tuple[str, ...], required: frozenset[str]) -> dict[str, Any]:
        """An object of an ``extra="forbid"`` model: no unknown key, every required key."""
        if type(v) is not dict:
            raise _schema(where, "an object", v)
        for k in v:
            if k not in fields:
                raise NotFast(f"{_SCHEMA}: {where}: unexpected key {k!r}")
        for k in required:
            if k not in v:
                raise NotFast(f"{_SCHEMA}: {where}: missing key {k!r}")
        self.pairs += len(v)
        return v

    # ------------------------------------------------------------------ the index
    def index(self, obj: dict[str, Any]) -> models.IndexFile:
        self.pairs += len(obj)
        given: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in obj.items():
            if k == "metadata":
                if obj.get("unickpt") is None and not strict_metadata_ok(v):
                    raise NotFast  # a plain index's metadata is informational: the models decide
                given[k] = self.metadata(v)
            elif k == "weight_map":
                given[k] = self.weight_map(v)
            elif k == "unickpt":
                given[k] = None if v is None else self.block(v)
            else:
                self.colons += k.count(":")
                self.walk(v)
                extra[k] = v
        if "weight_map" not in given:
            raise NotFast(f"{_SCHEMA}: weight_map: missing")
        return construct(models.IndexFile, given, set(obj), extra)

    def metadata(self, v: Any) -> models.IndexMetadata:
        if type(v) is not dict:
            raise _schema("metadata", "an object", v)
        self.pairs += len(v)
        given: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, x in v.items():
            check = _META_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, f"metadata.{k}")
            else:
                self.colons += k.count(":")
                self.walk(x)
                extra[k] = x
        return construct(models.IndexMetadata, given, set(v), extra)

    def weight_map(self, v: Any) -> dict[str, str]:
        if type(v) is not dict:
            raise _schema("weight_map", "an object", v)
        self.pairs += len(v)
        self.colons += "".join(v).count(":")
        for k, f in v.items():
            if type(f) is not str:
                raise _schema(f"weight_map.{k}", "a string", f)
        self._safe_names(set(v.values()))
        return v

    def _safe_names(self, names: set[str]) -> None:
        for name in names:
            try:
                check_file_name(name)
            except UnsafePathError as e:
                raise NotFast(str(e), UnsafePathError) from None
            if ":" in name:
                raise NotFast  # never, with today's names: the colon count skips file names

    def block(self, v: Any) -> models.UnickptBlock:
        v, fewer = block_from_json(v)  # the text form (base64url digests, default dtype)
        self.pairs += fewer
        b = self.obj(v, "unickpt", _BLOCK_FIELDS, _BLOCK_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in b.items():
            where = f"unickpt.{k}"
            check = _BLOCK_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, where)
            elif k == "format_version":
                if type(x) is not int:
                    if type(x) in (bool, float):
                        raise NotFast  # pydantic takes true and 1.0 for 1
                    raise _schema(where, _VERSIONS, x)
                if x not in KNOWN_FORMAT_VERSIONS:
                    raise _schema(where, f"{_VERSIONS} (a format version this reader knows)", x)
                given[k] = x
            elif k == "kind":
                if x not in KINDS or type(x) is not str:
                    raise _schema(where, _KIND_CHOICES, x)
                given[k] = x
            elif k == "layout":
                given[k] = self.layout(x)
            elif k == "files":
                if x is not None:
                    if type(x) is not list or set(map(type, x)) - {str}:
                        raise NotFast  # the models name what is wrong
                    self.files |= set(x)
                given[k] = x
            elif k == "tensors":
                given[k] = self.tensors(x)
            elif k == "aliases":
                if type(x) is not dict:
                    raise _schema(where, "an object", x)
                for a, t in x.items():
                    if type(t) is not str:
                        raise _schema(f"{where}.{a}", "a string", t)
                self.walk(x)
                given[k] = dict(x)
            elif k == "param_groups":
                if x is not None:
                    if type(x) is not list:
                        raise _schema(where, "null or an array of objects", x)
                    for i, g in enumerate(x):
                        if type(g) is not dict:
                            raise _schema(f"{where}.{i}", "an object", g)
                    if json_depth(x, MAX_STATE_DEPTH + 1) > MAX_STATE_DEPTH:
                        raise NotFast  # the model's validator names it
                    self.walk(x)
                    x = [dict(g) for g in x]
                given[k] = x
            elif k == "save_id":
                if x is not None and (type(x) is not str or _save_id(x) is None):
                    raise NotFast  # the schema's own message names the pattern
                given[k] = x
            else:  # param_state
                if type(x) is not dict:
                    raise _schema(where, "an object", x)
                for p, st in x.items():
                    if type(st) is not dict:
                        raise _schema(f"{where}.{p}", "an object", st)
                if json_depth(x, MAX_STATE_DEPTH + 1) > MAX_STATE_DEPTH:
                    raise NotFast  # the model's validator names it
                self.walk(x)
                given[k] = {p: dict(st) for p, st in x.items()}
        # models.UnickptBlock's model validators.
        tensors = given["tensors"]
        problem = files_problem(given.get("files"), tensors)
        if problem is not None:
            raise NotFast(f"{_SCHEMA}: unickpt: {problem}")
        self._safe_names(self.files)
        problem = alias_problem(given.get("aliases", {}), tensors)
        if problem is not None:
            raise NotFast(f"{_SCHEMA}: unickpt.aliases: {problem}")
        attach_tables(given.get("files"), tensors)
        return construct(models.UnickptBlock, given, set(b), None)

    def layout(self, v: Any) -> models.LayoutInfo:
        d = self.obj(v, "unickpt.layout", _LAYOUT_FIELDS, _LAYOUT_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in d.items():
            where = f"unickpt.layout.{k}"
            check = _LAYOUT_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, where)
            else:  # mesh
                if type(x) is not dict:
                    raise _schema(where, "an object", x)
                self.pairs += len(x)
                self.colons += "".join(x).count(":")
                for axis, size in x.items():
                    self.integer(size, f"{where}.{axis}", MIN_POSITIVE)
                given[k] = dict(x)
        return construct(models.LayoutInfo, given, set(d), None)

    def tensors(self, v: Any) -> dict[str, models.TensorEntry]:
        if type(v) is not dict:
            raise _schema("unickpt.tensors", "an object", v)
        self.pairs += len(v)
        self.colons += "".join(v).count(":")
        return {name: self.tensor(name, t) for name, t in v.items()}

    def tensor(self, name: str, v: Any) -> models.TensorEntry:
        where = f"unickpt.tensors.{name}"
        t = self.obj(v, where, _TENSOR_FIELDS, _TENSOR_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in t.items():
            check = _TENSOR_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, f"{where}.{k}")
            elif k == "dtype":
                dtype = self.string(x, f"{where}.dtype", colons=False)
                if dtype not in DTYPE_ITEMSIZE or ":" in dtype:
                    raise _schema(f"{where}.dtype", f"a dtype in {sorted(DTYPE_ITEMSIZE)}", x)
                given[k] = x
            elif k == "slices":
                if type(x) is not list:
                    raise _schema(f"{where}.slices", "an array of slice objects", x)
                given[k] = x
            else:  # the compact fields
                given[k] = self.compact_field(k, x)
        shape = given["shape"]
        problem = shape_problem(shape)
        if problem is not None:
            raise NotFast(f"{_SCHEMA}: {where}: {problem}")
        if "slices" not in given:
            # Whether or not 'file' is given (absent: slice K in files[K]), as TensorEntry checks.
            problem = compact_problem(
                shape,
                given.get("grid"),
                given.get("boxes"),
                given.get("file"),
                given.get("keys"),
                given.get("xxh3"),
            )
            if problem is not None:
                raise NotFast(f"{_SCHEMA}: {where}: {problem}")
            given["slices"] = []  # replaced by attach_tables (a default_factory costs 1 ms here)
            return construct(models.TensorEntry, given, set(t), None)
        bulk = bulk_slices(shape, given["slices"], self.shared)
        if bulk is None:
            given["slices"] = self.slices_slow(where, shape, given["slices"], DTYPE_ITEMSIZE[given["dtype"]])
        else:
            given["slices"], pairs, colons, files = bulk
            self.pairs += pairs
            self.colons += colons
            self.files |= files
        return construct(models.TensorEntry, given, set(t), None)

    def ranges(self, v: Any, where: str) -> list[models.ByteRange] | None:
        """A slice's byte ranges, each checked by its model; their tiling with the slice."""
        if v is None:
            return None
        if type(v) is not list:
            raise _schema(where, "null or an array of range objects", v)
        try:
            return [models.ByteRange.model_validate(self.obj(r, where, *_RANGE)) for r in v]
        except ValidationError as e:
            raise NotFast(f"{_SCHEMA}: {where}: {e.errors()[0]['msg']}") from None

    def compact_field(self, k: str, x: Any) -> Any:
        """A compact field of a tensor, type-checked in bulk; any doubt goes to the models."""
        colons = compact_field_colons(k, x)
        if colons is None:
            raise NotFast
        self.colons += colons
        return x

    def slices_slow(
        self, where: str, gshape: list[int], sl: list[Any], isize: int = 1
    ) -> list[models.SliceEntry]:
        """Slice by slice, as the models check them (any key order), with a message for each problem."""
        out = []
        for i, v in enumerate(sl):
            w = f"{where}.slices.{i}"
            s = self.obj(v, w, SLICE_FIELDS, SLICE_REQUIRED)
            given: dict[str, Any] = {}
            for k, x in s.items():
                check = _SLICE_PLAIN.get(k)
                if check is not None:
                    given[k] = check(self, x, f"{w}.{k}")
                elif k == "ranges":
                    given[k] = self.ranges(x, f"{w}.ranges")
                else:  # file
                    given[k] = self.string(x, f"{w}.file", colons=False)  # a safe name has none
            out.append((s, given))
        built = []
        for s, given in out:
            file = given["file"]
            problem = slice_problem(given["key"], file, given["offsets"], given["shape"], gshape)
            problem = problem or ranges_problem(
                given["key"], file, given.get("ranges"), given["shape"], isize
            )
            if problem is not None:
                raise NotFast(f"{_SCHEMA}: {where}: {problem}")
            self.files.add(file)
            built.append(construct(models.SliceEntry, given, set(s), None))
        return built


_Check = Callable[[FastIndex, Any, str], Any]


def _plain_check(cls: type[BaseModel], name: str) -> _Check:
    """The check of a field declared with one of the schema's plain types, read from its declaration."""
    field = cls.model_fields[name]
    ann, meta = field.annotation, field.metadata
    if ann is str:
        return FastIndex.string
    if ann == str | None and not meta:
        return FastIndex.optional_string
    if ann is bool and Strict(strict=True) in meta:
        return FastIndex.boolean
    if ann is int and Strict(strict=True) in meta:
        lo = next(cast(int, m.ge) for m in meta if isinstance(m, Ge))
        hi = next((cast(int, m.lt) for m in meta if isinstance(m, Lt)), None)
        return lambda fast, v, where: fast.integer(v, where, lo, hi)
    if ann == list[NonNeg]:
        return FastIndex.dims
    if ann == Hex16 | None:
        return FastIndex.hex16
    raise TypeError(f"{cls.__name__}.{name}: the fast index path has no check for {ann!r}")


#: The plain checks, by model and field: every field not in CUSTOM_FIELDS.
PLAIN_CHECKS: dict[type[BaseModel], dict[str, _Check]] = {
    cls: {name: _plain_check(cls, name) for name in cls.model_fields if name not in custom}
    for cls, custom in CUSTOM_FIELDS.items()
}
_META_PLAIN = PLAIN_CHECKS[models.IndexMetadata]
_BLOCK_PLAIN = PLAIN_CHECKS[models.UnickptBlock]
_LAYOUT_PLAIN = PLAIN_CHECKS[models.LayoutInfo]
_TENSOR_PLAIN = PLAIN_CHECKS[models.TensorEntry]
_SLICE_PLAIN = PLAIN_CHECKS[models.SliceEntry]
_RANGE = fields_of(models.ByteRange)
