"""The index validator: the schema of ``index_models`` checked in one plain pass over the JSON.

``parse_index`` goes through here and nowhere else (the pydantic models declare the schema and
export ``docs/index.schema.json``; no index is validated through them). It parses with plain
``json.loads`` and checks duplicate keys by counting colons (``_json.colon_budget``); pauses the
garbage collector while it builds the tree (``index_bulk.gc_paused``); checks listed slices with
C-level bulk operations over the whole table (``index_bulk.bulk_slices``) and, for a table the
bulk checks do not take (an unusual key order, byte ranges, or a problem), row by row
(``IndexParser.slices_rows``), which names the first offending slice; and everything else with
plain code driven by the schema's one definition in ``index_models`` (field lists, bounds and
choices, and the rule functions). It builds the objects the models describe (``model_construct``,
or the attributes it sets, in bulk), and refuses with an ``IndexFileError`` (``UnsafePathError``
for a data file name) whose message names the file, the field (``unickpt.tensors.NAME.slices.K
.offsets.0``), what was expected and what was found.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NoReturn, cast

from annotated_types import Ge, Lt
from pydantic import BaseModel, Strict

from unickpt.errors import CheckpointFormatError, IndexFileError, UnsafePathError
from unickpt.spec import index_models as models
from unickpt.spec._json import count_pairs_and_colons, json_depth, strict_loads
from unickpt.spec.digest_text import DigestTextError, block_from_json
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.index_bulk import (
    SLICE_FIELDS,
    SLICE_REQUIRED,
    bulk_slices,
    compact_field_colons,
    compact_field_problem,
    construct,
    found_text,
)
from unickpt.spec.index_models import (
    HEX16,
    HEX16_BODY,
    KINDS,
    KNOWN_FORMAT_VERSIONS,
    MAX_DIM,
    MAX_STATE_DEPTH,
    MIN_POSITIVE,
    SAVE_ID,
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
from unickpt.spec.versioning import OtherFormatVersion, version_error

__all__ = ["IndexParser", "SCHEMA_MISMATCH", "validate_block"]

_TENSOR_FIELDS, _TENSOR_REQUIRED = fields_of(models.TensorEntry)
_LAYOUT_FIELDS, _LAYOUT_REQUIRED = fields_of(models.LayoutInfo)
_BLOCK_FIELDS, _BLOCK_REQUIRED = fields_of(models.UnickptBlock)
_RANGE_FIELDS, _RANGE_REQUIRED = fields_of(models.ByteRange)
_VERSIONS = " or ".join(map(str, KNOWN_FORMAT_VERSIONS))
_KIND_CHOICES = " or ".join(map(repr, KINDS))
_hex16 = re.compile(HEX16_BODY).fullmatch
_save_id = re.compile(SAVE_ID_BODY).fullmatch
#: The words every schema refusal of ``parse_index`` starts with (after the file's path).
SCHEMA_MISMATCH = "index does not match the unickpt index schema"
# The fields whose checks IndexParser writes out (a rule, a bulk path or a case of their own),
# per model. Every other field is checked by the plain check its declared type calls for
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
    models.ByteRange: frozenset({"xxh3"}),  # a range's digest is not optional
}


class IndexParser:
    """One pass over the decoded index of ``path``: checks, counts members and colons, builds the models.

    ``again`` gives the index's text once more, for the rare refusals that need it: a duplicate
    key (the colon count finds one, ``strict_loads`` names it) and a schema problem found in a
    text that may also hold a duplicate key (reported first, as the JSON's own problem).
    """

    __slots__ = ("again", "budget", "colons", "files", "mismatch", "pairs", "path", "shared")

    def __init__(self, path: str, budget: int | None, again: Callable[[], str], what: str = "index") -> None:
        self.path = path
        self.mismatch = f"{path}: {what} does not match the unickpt index schema"
        self.budget = budget  # colon_budget(raw): None when the text escapes a colon
        self.again = again
        self.pairs = 0  # members of every JSON object met
        self.colons = 0  # ':' in every string met that may hold one
        self.files: set[str] = set()  # distinct slice file names
        self.shared: dict[tuple[str, ...], set[str]] = {}  # fields sets of slices, by key order

    def parse(self, box: list[str]) -> models.IndexFile:
        """Parse the text in the one-item list ``box``, taken out of it and dropped once decoded."""
        what = f"{self.path}: index"
        text = box.pop()
        if self.budget is None:  # an escaped colon: the count cannot tell duplicates apart
            obj = strict_loads(text, IndexFileError, what)
        else:
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError):
                strict_loads(text, IndexFileError, what)  # words the problem
                raise IndexFileError(f"{what} is not valid JSON") from None
        del text
        if type(obj) is not dict:
            raise IndexFileError(f"{what} must be a JSON object with a 'weight_map'")
        try:
            index = self.index(obj)
        except CheckpointFormatError:
            if self.budget is not None:
                strict_loads(self.again(), IndexFileError, what)  # a duplicate key is reported first
            raise
        except DigestTextError as e:
            if self.budget is not None:
                strict_loads(self.again(), IndexFileError, what)
            raise IndexFileError(f"{self.mismatch}: unickpt: {e}") from None
        except OtherFormatVersion as e:
            raise version_error(self.path, e.version) from None
        if self.budget is not None and self.pairs + self.colons != self.budget:
            strict_loads(self.again(), IndexFileError, what)  # names the duplicate key
            raise IndexFileError(f"{what} has a duplicate key")  # never: the count is exact
        return index

    # ------------------------------------------------------------------ refusals
    def refuse(
        self, where: str, problem: str, error: type[CheckpointFormatError] = IndexFileError
    ) -> NoReturn:
        raise error(f"{self.mismatch}: {where}: {problem}")

    def expected(self, where: str, expected: str, value: Any) -> NoReturn:
        self.refuse(where, f"expected {expected}, found {found_text(value)}")

    # ------------------------------------------------------------------ values
    def walk(self, v: Any) -> None:
        p, c = count_pairs_and_colons(v)
        self.pairs += p
        self.colons += c

    def string(self, v: Any, where: str, colons: bool = True) -> str:
        if type(v) is not str:
            self.expected(where, "a string", v)
        if colons:
            self.colons += v.count(":")
        return v

    def integer(self, v: Any, where: str, lo: int, hi: int | None = None) -> int:
        if type(v) is int and v >= lo and (hi is None or v < hi):
            return v
        bound = (
            f" below 2**{hi.bit_length() - 1}" if hi == MAX_DIM else f" below {hi}" if hi is not None else ""
        )
        self.expected(where, f"an integer >= {lo}{bound}", v)

    def optional_string(self, v: Any, where: str) -> str | None:
        return None if v is None else self.string(v, where)

    def boolean(self, v: Any, where: str) -> bool:
        if type(v) is not bool:
            self.expected(where, "true or false", v)
        return v

    def dims(self, v: Any, where: str) -> list[int]:
        if type(v) is not list:
            self.expected(where, "an array of integers", v)
        for i, x in enumerate(v):
            self.integer(x, f"{where}.{i}", 0, MAX_DIM)
        return v

    def hex16(self, v: Any, where: str) -> str | None:
        if v is None or (type(v) is str and _hex16(v)):
            return v
        self.expected(where, f"null or a string matching {HEX16}", v)

    def obj(self, v: Any, where: str, fields: tuple[str, ...], required: frozenset[str]) -> dict[str, Any]:
        """An object of an ``extra="forbid"`` model: no unknown key, every required key."""
        if type(v) is not dict:
            self.expected(where, "an object", v)
        for k in v:
            if k not in fields:
                self.refuse(f"{where}.{k}", f"unexpected key (the fields are {', '.join(fields)})")
        for k in fields:
            if k in required and k not in v:
                self.refuse(f"{where}.{k}", "missing (a required field)")
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
                    given[k] = self.informational_metadata(v)
                else:
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
            self.refuse("weight_map", "missing (a required field)")
        return construct(models.IndexFile, given, set(obj), extra)

    def metadata(self, v: Any) -> models.IndexMetadata:
        if type(v) is not dict:
            self.expected("metadata", "an object", v)
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

    def informational_metadata(self, v: Any) -> models.IndexMetadata:
        """A plain Hugging Face index's metadata that a unickpt index could not have: Hugging Face
        reads only ``weight_map`` (Colossal-AI writes total_size in MB as a float), so its
        ``total_size`` is dropped (and the whole of anything that is not an object)."""
        self.walk(v)
        kept = {k: x for k, x in v.items() if k != "total_size"} if type(v) is dict else {}
        return construct(models.IndexMetadata, {}, set(kept), kept)

    def weight_map(self, v: Any) -> dict[str, str]:
        if type(v) is not dict:
            self.expected("weight_map", "an object", v)
        self.pairs += len(v)
        self.colons += "".join(v).count(":")
        for k, f in v.items():
            if type(f) is not str:
                self.expected(f"weight_map.{k}", "a string", f)
        for name in set(v.values()):  # a safe name holds no ':' (the colon count skips them)
            try:
                check_file_name(name)
            except UnsafePathError:
                k = next(k for k, f in v.items() if f == name)
                self.safe_names({name}, f"weight_map[{k!r}]")
        return v

    def safe_names(self, names: set[str], where: str = "") -> None:
        for name in names:
            try:
                check_file_name(name, where)
            except UnsafePathError as e:
                raise UnsafePathError(f"{self.path}: {e}") from None

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
                    self.expected(where, f"the integer {_VERSIONS}", x)
                if x not in KNOWN_FORMAT_VERSIONS:
                    self.expected(where, f"{_VERSIONS} (a format version this reader knows)", x)
                given[k] = x
            elif k == "kind":
                if type(x) is not str or x not in KINDS:
                    self.expected(where, _KIND_CHOICES, x)
                given[k] = x
            elif k == "layout":
                given[k] = self.layout(x)
            elif k == "files":
                if x is not None:
                    if type(x) is not list:
                        self.expected(where, "null or an array of file names", x)
                    for i, f in enumerate(x):
                        self.string(f, f"{where}.{i}", colons=False)  # safe names hold no ':'
                    self.files |= set(x)
                given[k] = x
            elif k == "tensors":
                given[k] = self.tensors(x)
            elif k == "aliases":
                if type(x) is not dict:
                    self.expected(where, "an object", x)
                for a, t in x.items():
                    if type(t) is not str:
                        self.expected(f"{where}.{a}", "a string", t)
                self.walk(x)
                given[k] = dict(x)
            elif k == "param_groups":
                if x is not None:
                    if type(x) is not list:
                        self.expected(where, "null or an array of objects", x)
                    for i, g in enumerate(x):
                        if type(g) is not dict:
                            self.expected(f"{where}.{i}", "an object", g)
                    self.state_depth(x, where)
                    self.walk(x)
                    x = [dict(g) for g in x]
                given[k] = x
            elif k == "save_id":
                if x is not None and (type(x) is not str or _save_id(x) is None):
                    self.expected(where, f"null or a string matching {SAVE_ID}", x)
                given[k] = x
            else:  # param_state
                if type(x) is not dict:
                    self.expected(where, "an object", x)
                for p, st in x.items():
                    if type(st) is not dict:
                        self.expected(f"{where}.{p}", "an object", st)
                self.state_depth(x, where)
                self.walk(x)
                given[k] = {p: dict(st) for p, st in x.items()}
        # The rules that span the block's fields.
        tensors = given["tensors"]
        problem = files_problem(given.get("files"), tensors)
        if problem is not None:
            self.refuse("unickpt", problem)
        self.safe_names(self.files)
        problem = alias_problem(given.get("aliases", {}), tensors)
        if problem is not None:
            self.refuse("unickpt.aliases", problem)
        attach_tables(given.get("files"), tensors)
        return construct(models.UnickptBlock, given, set(b), None)

    def state_depth(self, x: Any, where: str) -> None:
        if json_depth(x, MAX_STATE_DEPTH + 1) > MAX_STATE_DEPTH:
            self.refuse(where, f"nested deeper than {MAX_STATE_DEPTH} levels")

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
                    self.expected(where, "an object", x)
                self.pairs += len(x)
                self.colons += "".join(x).count(":")
                for axis, size in x.items():
                    self.integer(size, f"{where}.{axis}", MIN_POSITIVE)
                given[k] = dict(x)
        return construct(models.LayoutInfo, given, set(d), None)

    def tensors(self, v: Any) -> dict[str, models.TensorEntry]:
        if type(v) is not dict:
            self.expected("unickpt.tensors", "an object", v)
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
                if type(x) is not str or x not in DTYPE_ITEMSIZE:
                    self.expected(f"{where}.dtype", f"a dtype in {sorted(DTYPE_ITEMSIZE)}", x)
                given[k] = x
            elif k == "slices":
                if type(x) is not list:
                    self.expected(f"{where}.slices", "an array of slice objects", x)
                given[k] = x
            else:  # the compact fields
                given[k] = self.compact_field(k, x, f"{where}.{k}")
        shape = given["shape"]
        problem = shape_problem(shape)
        if problem is not None:
            self.refuse(where, problem)
        if "slices" not in given:
            # Whether or not 'file' is given (absent: slice K in files[K]).
            problem = compact_problem(
                shape,
                given.get("grid"),
                given.get("boxes"),
                given.get("file"),
                given.get("keys"),
                given.get("xxh3"),
            )
            if problem is not None:
                self.refuse(where, problem)
            given["slices"] = []  # replaced by attach_tables (a default_factory costs 1 ms here)
            return construct(models.TensorEntry, given, set(t), None)
        bulk = bulk_slices(shape, given["slices"], self.shared)
        if bulk is None:
            given["slices"] = self.slices_rows(where, shape, given["slices"], DTYPE_ITEMSIZE[given["dtype"]])
        else:
            given["slices"], pairs, colons, files = bulk
            self.pairs += pairs
            self.colons += colons
            self.files |= files
        return construct(models.TensorEntry, given, set(t), None)

    def ranges(self, v: Any, where: str) -> list[models.ByteRange] | None:
        """A slice's byte ranges, each an object of ``ByteRange``'s fields (their tiling is
        ``ranges_problem``'s)."""
        if v is None:
            return None
        if type(v) is not list:
            self.expected(where, "null or an array of range objects", v)
        out = []
        for j, r in enumerate(v):
            w = f"{where}.{j}"
            d = self.obj(r, w, _RANGE_FIELDS, _RANGE_REQUIRED)
            given = {k: _RANGE_PLAIN[k](self, x, f"{w}.{k}") for k, x in d.items() if k != "xxh3"}
            h = d["xxh3"]
            if type(h) is not str or not _hex16(h):
                self.expected(f"{w}.xxh3", f"a string matching {HEX16}", h)
            given["xxh3"] = h
            out.append(construct(models.ByteRange, given, set(d), None))
        return out

    def compact_field(self, k: str, x: Any, where: str) -> Any:
        """A compact field of a tensor, type-checked in bulk; the first bad item named when it fails."""
        colons = compact_field_colons(k, x)
        if colons is None:
            found, expected, value = compact_field_problem(k, x)
            self.expected(f"{where}{found}", expected, value)
        self.colons += colons
        return x

    def slices_rows(
        self, where: str, gshape: list[int], sl: list[Any], isize: int = 1
    ) -> list[models.SliceEntry]:
        """A tensor's slices row by row (any key order, byte ranges): the first offending slice
        is named by its number, field, what was expected and what was found."""
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
                else:  # file: a safe name has no ':', and an unsafe one is refused
                    given[k] = self.string(x, f"{w}.file", colons=False)
            file = given["file"]
            problem = slice_problem(given["key"], file, given["offsets"], given["shape"], gshape)
            problem = problem or ranges_problem(
                given["key"], file, given.get("ranges"), given["shape"], isize
            )
            if problem is not None:
                self.refuse(w, problem)
            self.files.add(file)
            out.append(construct(models.SliceEntry, given, set(s), None))
        return out


def validate_block(obj: Any, path: str, what: str) -> models.UnickptBlock:
    """A unickpt block read on its own (``obj`` from ``strict_loads``, which refused duplicate
    keys): checked as the block of an index, refusals naming ``path`` and ``what`` it is."""
    parser = IndexParser(path, None, _no_text, what)
    try:
        return parser.block(obj)
    except DigestTextError as e:
        raise IndexFileError(f"{parser.mismatch}: unickpt: {e}") from None
    except OtherFormatVersion as e:
        raise version_error(path, e.version) from None


def _no_text() -> str:  # pragma: no cover - never: a parser without a budget never asks
    raise RuntimeError("the text of a block validated on its own is not kept")


_Check = Callable[[IndexParser, Any, str], Any]


def _plain_check(cls: type[BaseModel], name: str) -> _Check:
    """The check of a field declared with one of the schema's plain types, read from its declaration."""
    field = cls.model_fields[name]
    ann, meta = field.annotation, field.metadata
    if ann is str:
        return IndexParser.string
    if ann == str | None and not meta:
        return IndexParser.optional_string
    if ann is bool and Strict(strict=True) in meta:
        return IndexParser.boolean
    if ann is int and Strict(strict=True) in meta:
        lo = next(cast(int, m.ge) for m in meta if isinstance(m, Ge))
        hi = next((cast(int, m.lt) for m in meta if isinstance(m, Lt)), None)
        return lambda parser, v, where: parser.integer(v, where, lo, hi)
    if ann == list[NonNeg]:
        return IndexParser.dims
    if ann == Hex16 | None:
        return IndexParser.hex16
    raise TypeError(f"{cls.__name__}.{name}: the index parser has no check for {ann!r}")


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
_RANGE_PLAIN = PLAIN_CHECKS[models.ByteRange]
