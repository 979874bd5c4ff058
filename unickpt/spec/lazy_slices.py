"""``TensorEntry.slices`` of a version 3 index: a list whose ``SliceEntry`` objects are built when read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, SupportsIndex, overload

from unickpt.spec.slice_table import SliceTable

__all__ = ["LazySlices"]


class LazySlices(list):  # type: ignore[type-arg]
    """A tensor's ``slices`` list that builds its ``SliceEntry`` objects the first time it is read.

    It carries the tensor's :class:`SliceTable` (``.table``); ``len`` needs no objects. Every way
    of reading the elements goes through the methods below, which build the list once.
    """

    __slots__ = ("_built", "table")

    def __init__(self, table: SliceTable, built: Iterable[Any] | None = None) -> None:
        super().__init__()
        self.table = table
        self._built = False
        if built is not None:
            list.extend(self, built)
            self._built = True

    def _build(self) -> None:
        if not self._built:
            list.extend(self, self.table.entries())
            self._built = True

    def built(self) -> LazySlices:
        """The list with its ``SliceEntry`` objects built: for readers that see the list's storage
        without calling its methods (pydantic's serializer reads a list subclass at the C level)."""
        self._build()
        return self

    def __len__(self) -> int:
        return list.__len__(self) if self._built else len(self.table)

    def __iter__(self) -> Iterator[Any]:
        self._build()
        return list.__iter__(self)

    def __reversed__(self) -> Iterator[Any]:
        self._build()
        return list.__reversed__(self)

    @overload
    def __getitem__(self, i: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: Any) -> Any:
        if not self._built and isinstance(i, int) and -len(self.table) <= i < len(self.table):
            return self.table.entry(i % len(self.table))
        self._build()
        return list.__getitem__(self, i)

    def __contains__(self, x: object) -> bool:
        self._build()
        return list.__contains__(self, x)

    def __eq__(self, other: object) -> bool:
        self._build()
        if isinstance(other, LazySlices):
            other._build()
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._build()
        return list.__repr__(self)

    def __bool__(self) -> bool:
        return len(self) > 0

    def copy(self) -> list[Any]:
        self._build()
        return list(list.__iter__(self))

    def index(self, *args: Any) -> int:
        self._build()
        return list.index(self, *args)

    def count(self, x: Any) -> int:
        self._build()
        return list.count(self, x)

    def __add__(self, other: Any) -> list[Any]:
        return self.copy() + list(other)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (LazySlices, (self.table,))  # pickled as its table: no SliceEntry per slice

    def __copy__(self) -> list[Any]:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return self.copy()
