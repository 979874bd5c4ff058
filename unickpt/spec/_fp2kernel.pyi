# The compiled fingerprint v2 kernel (unickpt/spec/_fp2kernel.c).
from collections.abc import Sequence

def partial(
    buffer: bytes | memoryview | bytearray,
    itemsize: int,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    start: int,
    /,
) -> tuple[int, int]: ...
def simd() -> str: ...  # "avx512-ifma", "avx512", "avx2", "neon" or "scalar"
