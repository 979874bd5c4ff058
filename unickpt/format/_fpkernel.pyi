from collections.abc import Sequence

def partial(
    buffer: memoryview | bytes,
    itemsize: int,
    global_lead: Sequence[int],
    offsets_lead: Sequence[int],
    shape_lead: Sequence[int],
    col_offset: int,
    cols: int,
    start: int,
    workspace: bytearray | None = None,
    /,
) -> int: ...
def table_bytes(cols: int, /) -> int: ...
def simd() -> str: ...
