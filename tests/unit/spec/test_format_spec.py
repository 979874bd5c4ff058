"""The spec (docs/format.md, docs/index.schema.json) and the code stay in step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from unickpt.spec import hashing
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.index import FORMAT_VERSION
from unickpt.spec.naming import SLICED_SENTINEL, parse_slice_key, slice_key, slice_keys
from unickpt.spec.schema import index_schema_json
from unickpt.tools.upgrade import v1_finalize, v1_partial

DOCS = Path(__file__).resolve().parents[3] / "docs"


def fingerprint_v1(name: str, dtype: str, data: bytes | memoryview, shape: tuple[int, ...]) -> str:
    """Fingerprint v1 of a whole tensor from its raw C-order bytes, as upgrade checks version 1 indexes."""
    words = np.frombuffer(data, dtype=f"<u{DTYPE_ITEMSIZE[dtype]}")
    return v1_finalize(name, dtype, shape, v1_partial(words, shape, [0] * len(shape), shape))


def test_exported_schema_matches_docs() -> None:
    assert (DOCS / "index.schema.json").read_text() == index_schema_json(), (
        "regenerate with: python -m unickpt.spec.schema > docs/index.schema.json"
    )


def test_spec_names_the_constants_the_code_uses() -> None:
    spec = (DOCS / "format.md").read_text()
    for needle in [
        SLICED_SENTINEL,
        "0x9E3779B97F4A7C15",
        "0xBF58476D1CE4E5B9",
        "0x94D049BB133111EB",
        "0xD1B54A32D192ED03",
        "100,000,000",
        '"format": "unickpt-sliced"',
        ".unickpt.lock",
        # fingerprint v2
        f"0x{hashing.SEED_L:016X}",
        f"0x{hashing.SEED_H:016X}",
        f"2^32 - 5 = {hashing.P1}",
        f"2^32 - 17 = {hashing.P2}",
        f"`G = {hashing.G}`",
        hashing.TAG.rstrip(b"\0").decode(),
        f'"format_version": {FORMAT_VERSION}',
    ]:
        assert needle in spec, needle


def _reference_fingerprint(name: str, dtype: str, words: list[int], shape: tuple[int, ...]) -> str:
    """Fingerprint v1 (docs/format.md 5.2.3, which ``unickpt upgrade`` checks in version 1 indexes)
    written out literally with Python integers."""
    mask = (1 << 64) - 1

    def mix64(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    cols = shape[-1] if shape else 1
    total = 0
    for i, w in enumerate(words):
        r, c = divmod(i, cols)
        total = (total + (mix64(r) | 1) * (mix64(c ^ 0xD1B54A32D192ED03) | 1) * w) & mask
    return v1_finalize(name, dtype, shape, total)


def test_fingerprint_v1_follows_the_written_definition() -> None:
    t = torch.randn(3, 5).to(torch.bfloat16)
    words = [int(x) & 0xFFFF for x in t.view(torch.int16).reshape(-1).tolist()]
    data = t.view(torch.uint8).numpy().tobytes()
    assert fingerprint_v1("w", "BF16", data, (3, 5)) == _reference_fingerprint("w", "BF16", words, (3, 5))
    s = torch.tensor(7, dtype=torch.int64)
    assert fingerprint_v1("s", "I64", s.reshape(1).view(torch.uint8).numpy().tobytes(), ()) == (
        _reference_fingerprint("s", "I64", [7], ())
    )
    assert v1_partial(t.view(torch.int16).numpy().view("<u2"), (3, 5), (0, 0), (3, 5)) != 0


def test_schema_is_valid_json_schema() -> None:
    schema = json.loads(index_schema_json())
    assert schema["title"].startswith("unickpt checkpoint index")
    assert "unickpt" in schema["properties"]


def test_slice_keys_are_written_and_read_by_one_rule() -> None:
    """``NAME@K`` (docs/format.md, sliced checkpoints): formed one by one and in bulk alike, and read
    back only in the form written (``K`` decimal ASCII, no sign, no leading zero; the last ``@``)."""
    names = ["w", "a@b", "model.layers.0.mlp.up_proj.weight", "é", ""]
    for name in names:
        ks = [0, 1, 9, 10, 12345]
        keys = slice_keys(name, ks)
        assert keys == [slice_key(name, k) for k in ks] == [f"{name}@{k}" for k in ks]
        assert [parse_slice_key(key) for key in keys] == [(name, k) for k in ks]
    for key in ["w", "w@", "w@01", "w@-1", "w@+1", "w@1.0", "w@ 1", "w@\uff11", "w@\u0663", "w@1a"]:
        assert parse_slice_key(key) is None, key
    assert parse_slice_key("@0") == ("", 0)
    assert parse_slice_key("w@" + "9" * 18) == ("w", 10**18 - 1)
    assert parse_slice_key("w@" + "1" * 19) is None and parse_slice_key("w@" + "1" * 5000) is None
