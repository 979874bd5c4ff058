"""The block's text form: base64url digests and a default dtype (docs/format.md 3.2); the one format
version readers accept."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from unickpt import GeneralCheckpointIO, merge_checkpoint, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import IndexFileError
from unickpt.spec.index import (
    FORMAT_VERSION,
    NO_DIGEST,
    IndexFile,
    LayoutInfo,
    b64_to_hex,
    hex_to_b64,
    index_to_json,
    parse_index,
)

INDEX = "model.safetensors.index.json"


def _reference(hexs: str) -> str:
    """Each digest encoded on its own with the standard library, the padding dropped."""
    out = []
    for k in range(0, len(hexs), 16):
        h = hexs[k : k + 16]
        out.append(NO_DIGEST if h == "-" * 16 else base64.urlsafe_b64encode(bytes.fromhex(h)).decode()[:11])
    return "".join(out)


def test_digests_round_trip_as_the_standard_library_encodes_them() -> None:
    rng = random.Random(5)
    edge = ["0" * 16, "f" * 16, "8000000000000000", "0000000000000001", "-" * 16]
    digests = edge + [f"{rng.getrandbits(64):016x}" for _ in range(2000)]
    hexs = "".join(digests)
    text = hex_to_b64(hexs)
    assert text == _reference(hexs) and len(text) == 11 * len(digests)
    assert b64_to_hex(text) == hexs
    assert hex_to_b64("5b0e0c7f2d3a9c41") == "Ww4Mfy06nEE"  # docs/format.md's example
    assert hex_to_b64("") == "" == b64_to_hex("")
    # Every digest's last character carries 4 bits and two zero bits.
    assert set(text[10::11]) - {"~"} <= set("AEIMQUYcgkosw048")


def _save(tmp_path: Path, name: str = "v5") -> tuple[Path, dict[str, torch.Tensor]]:
    """A sliced save of a tiny model, each tensor in 4 row blocks (as FSDP2 x4 stores it)."""
    from unickpt.io.save import SaveOptions, save_tensors
    from unickpt.io.tensors import LocalSlice

    torch.manual_seed(0)
    full = {
        "embed": torch.randn(33, 5).to(torch.bfloat16),
        "proj": torch.randn(10, 7).to(torch.bfloat16),
        "norm": torch.randn(6),
        "steps": torch.arange(3, dtype=torch.int64),
    }
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}

    def boxes(n: str, t: torch.Tensor) -> list[LocalSlice]:
        out, start = [], 0
        for part in t.chunk(4):
            rows = part.shape[0]
            box = (start, *[0] * (t.dim() - 1))
            out.append(LocalSlice(n, dtypes[t.dtype], tuple(t.shape), box, tuple(part.shape), part))  # type: ignore[arg-type]
            start += rows
        return out

    d = tmp_path / name
    save_tensors(full, str(d), SaveOptions("model", True, False, 1024, LayoutInfo()), boxes)
    return d, full


def _loads_bit_exact(path: Path, full: dict[str, torch.Tensor]) -> None:
    m = torch.nn.Module()
    for name, t in full.items():
        if t.is_floating_point():
            m.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t)))
        else:
            m.register_buffer(name, torch.zeros_like(t))
    GeneralCheckpointIO().load_model(m, path, verify=True)
    for name, want in full.items():
        assert torch.equal(m.state_dict()[name], want), name


def test_a_save_writes_base64url_digests_and_a_default_dtype(tmp_path: Path) -> None:
    d, full = _save(tmp_path)
    raw = (d / INDEX).read_bytes()
    block = json.loads(raw)["unickpt"]
    assert block["format_version"] == FORMAT_VERSION == 5 and block["dtype"] == "BF16"
    tensors = block["tensors"]
    assert "dtype" not in tensors["embed"] and tensors["norm"]["dtype"] == "F32"
    assert tensors["steps"]["dtype"] == "I64" and len(tensors["embed"]["xxh3"]) == 44
    assert all(len(t["fingerprint"]) == 11 for t in tensors.values())
    fast = parse_index(raw, "a.json")
    assert fast == IndexFile.model_validate(json.loads(raw)) and fast.unickpt is not None
    for name, t in fast.unickpt.tensors.items():  # hex digests and every dtype in memory
        assert t.fingerprint is not None and len(t.fingerprint) == 16
        assert t.fingerprint == b64_to_hex(tensors[name]["fingerprint"])
        assert t.table.hashes == b64_to_hex(tensors[name]["xxh3"])
        assert t.dtype == tensors[name].get("dtype", "BF16")
    assert index_to_json(fast) == raw  # a parsed index writes the save's exact bytes
    report = verify_checkpoint(d)
    assert not list(report) and report.hashed == 14 and report.fingerprints == 4, report.summary()
    _loads_bit_exact(d, full)


def test_a_merge_writes_the_text_form(tmp_path: Path) -> None:
    d, full = _save(tmp_path)
    for shard in ("1KB", "5GB"):  # several files (an index), one file (the block in its header)
        out = tmp_path / f"merged-{shard}"
        merge_checkpoint(d, out, max_shard_size=shard)
        if (out / INDEX).exists():
            block = json.loads((out / INDEX).read_text())["unickpt"]
        else:
            with open_checkpoint(out) as r:
                raw_meta = r.block.model_dump_json(exclude_none=True)
            block = json.loads(raw_meta)
        assert block["format_version"] == 5 and "dtype" in block
        assert len(block["tensors"]["proj"]["fingerprint"]) == 11
        _loads_bit_exact(out, full)
        assert not list(verify_checkpoint(out))


@pytest.mark.parametrize(
    "version",
    [0, 1, 2, 3, 4, 6, -1, 10**4000, -(10**4000)],
    ids=lambda v: str(v) if abs(v) < 100 else f"{'-' if v < 0 else ''}10**4000",
)
def test_another_format_version_is_refused_on_both_paths(tmp_path: Path, version: int) -> None:
    obj = _v5_index(tmp_path)
    obj["unickpt"]["format_version"] = version
    raw = json.dumps(obj).encode()
    for parse in (parse_index,):
        with pytest.raises(IndexFileError) as e:
            parse(raw, "ck/model.safetensors.index.json")
        msg = str(e.value)
        # The version as found, its middle cut: a file's number can be thousands of digits.
        found = str(version) if abs(version) < 100 else f"{str(version)[:28]}...{'0' * 29}"
        head = f"ck/model.safetensors.index.json: format_version {found}"
        assert msg.startswith(head) and msg[len(head)] in " ,", msg
        assert len(msg) < 400, len(msg)
        if 1 <= version <= 4:
            assert "a draft" in msg and "`unickpt upgrade ck`" in msg, msg
        elif version > 5:
            assert "a newer unickpt wrote it" in msg, msg
        else:
            assert "is no format version" in msg, msg


HUGE = 10**4000  # what json reads of a 4,001-digit number; Python refuses longer ones


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda o: o["weight_map"].__setitem__("proj", HUGE), "weight_map.proj: expected a string"),
        (lambda o: o["unickpt"]["tensors"]["proj"].__setitem__("dtype", HUGE), "unickpt.tensors.proj.dtype"),
        (lambda o: o["unickpt"].__setitem__("layout", HUGE), "unickpt.layout: expected an object"),
    ],
    ids=["weight_map", "dtype", "layout"],
)
def test_a_number_thousands_of_digits_long_is_named_not_echoed(tmp_path: Path, edit: Any, field: str) -> None:
    obj = _v5_index(tmp_path)
    edit(obj)
    with pytest.raises(IndexFileError) as e:
        parse_index(json.dumps(obj).encode(), "ck/model.safetensors.index.json")
    msg = str(e.value)
    assert field in msg and f"found 1{'0' * 27}...{'0' * 29}" in msg, msg[:600]
    assert len(msg) < 600, len(msg)


def _v5_index(tmp_path: Path) -> dict[str, Any]:
    d, _ = _save(tmp_path)
    obj: dict[str, Any] = json.loads((d / INDEX).read_text())
    return obj


def _flip_last_bits(s: str) -> str:
    """The first digest's last character with a nonzero padding bit."""
    return s[:10] + chr(ord(s[10]) + 1) + s[11:]


_HOSTILE: list[tuple[str, Any, str]] = [
    ("short xxh3", lambda t, b: t.update(xxh3=t["xxh3"][:-1]), "'xxh3' holds 43 characters for 4 slice(s)"),
    ("long xxh3", lambda t, b: t.update(xxh3=t["xxh3"] + "A" * 11), "holds 55 characters for 4 slice(s)"),
    ("hex xxh3", lambda t, b: t.update(xxh3=b64_to_hex(t["xxh3"])), "holds 64 characters for 4 slice(s)"),
    ("hex fingerprint", lambda t, b: t.update(fingerprint="0123456789abcdef"), "'fingerprint' holds 16"),
    ("plus", lambda t, b: t.update(xxh3="+" + t["xxh3"][1:]), "digest 0 ('+"),
    ("slash", lambda t, b: t.update(xxh3=t["xxh3"][:12] + "/" + t["xxh3"][13:]), "digest 1 ("),
    ("padding", lambda t, b: t.update(xxh3=t["xxh3"][:10] + "=" + t["xxh3"][11:]), "holds '='"),
    ("non-ascii", lambda t, b: t.update(xxh3="é" + t["xxh3"][1:]), "holds 'é'"),
    ("half marker", lambda t, b: t.update(xxh3="~" * 5 + t["xxh3"][5:]), "holds '~'"),
    ("trailing bits", lambda t, b: t.update(xxh3=_flip_last_bits(t["xxh3"])), "nonzero padding bits"),
    (
        "fingerprint trailing bits",
        lambda t, b: t.update(fingerprint=_flip_last_bits(t["fingerprint"])),
        "'fingerprint': digest 0",
    ),
    (
        "bad default dtype",
        lambda t, b: b.update(dtype="bf16"),
        "'dtype' (the tensors' default dtype) must be",
    ),
    ("no dtype anywhere", lambda t, b: b.pop("dtype"), "embed.dtype"),
]


@pytest.mark.parametrize(("what", "edit", "finding"), _HOSTILE, ids=[h[0] for h in _HOSTILE])
def test_malformed_version_5_text_is_refused_naming_file_tensor_and_finding(
    tmp_path: Path, what: str, edit: Any, finding: str
) -> None:
    obj = _v5_index(tmp_path)
    edit(obj["unickpt"]["tensors"]["embed"], obj["unickpt"])
    raw = json.dumps(obj, ensure_ascii=False).encode()
    for parse in (parse_index,):
        with pytest.raises(IndexFileError) as e:
            parse(raw, "bad.index.json")
        msg = str(e.value)
        assert msg.startswith("bad.index.json: ") and finding in msg, msg
        if "dtype" not in what:
            assert "tensor 'embed'" in msg, msg


def test_a_duplicate_default_dtype_is_refused(tmp_path: Path) -> None:
    raw = json.dumps(_v5_index(tmp_path)).replace('"dtype": "BF16"', '"dtype": "BF16", "dtype": "F32"', 1)
    for parse in (parse_index,):
        with pytest.raises(IndexFileError, match="duplicate"):
            parse(raw.encode(), "dup.index.json")


def test_a_slice_without_a_hash_is_eleven_tildes(tmp_path: Path) -> None:
    obj = _v5_index(tmp_path)
    t = obj["unickpt"]["tensors"]["embed"]
    t["xxh3"] = t["xxh3"][:11] + NO_DIGEST + t["xxh3"][22:]
    raw = json.dumps(obj).encode()
    for parse in (parse_index,):
        idx = parse(raw, "i.json")
        assert idx.unickpt is not None
        table = idx.unickpt.tensors["embed"].table
        assert table.xxh3(1) is None and table.xxh3(0) is not None and table.xxh3(2) is not None
    written = json.loads(index_to_json(parse_index(raw, "i.json")))
    assert written["unickpt"]["tensors"]["embed"]["xxh3"] == t["xxh3"]


def test_block_json_of_a_tensor_of_every_dtype_keeps_each_dtype() -> None:
    """The default is the most frequent dtype; the others stay on their tensors; in Python mode
    (``model_dump()``) nothing changes."""
    obj = {
        "weight_map": dict.fromkeys("abc", "model-00001-of-00001.safetensors"),
        "unickpt": {
            "format_version": 5,
            "kind": "model",
            "dtype": "F16",
            "tensors": {
                "a": {
                    "shape": [2],
                    "slices": [
                        {"file": "model-00001-of-00001.safetensors", "key": "a", "offsets": [0], "shape": [2]}
                    ],
                },
                "b": {
                    "dtype": "I8",
                    "shape": [2],
                    "slices": [
                        {"file": "model-00001-of-00001.safetensors", "key": "b", "offsets": [0], "shape": [2]}
                    ],
                },
                "c": {
                    "dtype": "I8",
                    "shape": [2],
                    "slices": [
                        {"file": "model-00001-of-00001.safetensors", "key": "c", "offsets": [0], "shape": [2]}
                    ],
                },
            },
        },
    }
    idx = IndexFile.model_validate(obj)
    assert idx.unickpt is not None and idx.unickpt.tensors["a"].dtype == "F16"
    dumped = json.loads(index_to_json(idx))["unickpt"]
    assert dumped["dtype"] == "I8" and dumped["tensors"]["a"]["dtype"] == "F16"
    assert "dtype" not in dumped["tensors"]["b"] and list(dumped)[:3] == ["format_version", "kind", "dtype"]
    assert (
        "dtype" not in idx.unickpt.model_dump() and idx.unickpt.model_dump()["tensors"]["b"]["dtype"] == "I8"
    )
    assert np.array_equal(
        [t.dtype for t in IndexFile.model_validate(json.loads(index_to_json(idx))).unickpt.tensors.values()],  # type: ignore[union-attr]
        ["F16", "I8", "I8"],
    )


def test_the_schema_takes_the_text_form_and_refuses_hex_and_loose_bits(tmp_path: Path) -> None:
    import re

    from unickpt.spec.schema import index_schema_json

    defs = json.loads(index_schema_json())["$defs"]
    props = defs["TensorEntry"]["properties"]
    fp, xxh = (props[k]["anyOf"][0]["pattern"] for k in ("fingerprint", "xxh3"))
    assert (
        "dtype" not in defs["TensorEntry"]["required"]
        and "BF16" in defs["UnickptBlock"]["properties"]["dtype"]["enum"]
    )
    t = _v5_index(tmp_path)["unickpt"]["tensors"]["embed"]
    for pattern, v5 in ((fp, t["fingerprint"]), (xxh, t["xxh3"])):
        assert re.search(pattern, v5) and not re.search(pattern, b64_to_hex(v5))
        assert not re.search(pattern, _flip_last_bits(v5)) and not re.search(pattern, "+" + v5[1:])
    assert re.search(xxh, NO_DIGEST + t["xxh3"]) and not re.search(xxh, "~" + t["xxh3"][1:])


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("", True),
        ("0123456789abcdef" * 3, True),
        ("-" * 16 + "f" * 16, True),
        ("0" * 15, False),
        ("0" * 17, False),
        ("0123456789ABCDEF", False),
        ("g" * 16, False),
        ("," * 16, False),
        ("é" * 16, False),
        ("-" * 15 + "0", False),
        ("Ww4Mfy06nEE" + "A" * 5, False),
    ],
)
def test_the_hex_hashes_check_is_the_schemas_pattern(text: str, ok: bool) -> None:
    """The index's C-level check of a hex ``xxh3`` string says what the ``HASHES`` regex says."""
    import re

    from unickpt.spec.index import HASHES, _concatenated_hashes

    assert _concatenated_hashes(text) is ok is (re.fullmatch(HASHES, text) is not None)


def test_every_string_decodes_to_one_digest_or_is_refused() -> None:
    """Random strings over base64url, standard base64, '=', '~', space and a non-ASCII letter: each
    is refused, or it decodes to digests that encode back to exactly it (so no two strings give
    the same digest)."""
    from unickpt.spec.index import _Bad

    rng = random.Random(11)
    chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_+/=~ é"
    accepted = 0
    for _ in range(3000):
        n = rng.randrange(1, 4)
        if rng.random() < 0.5:  # mostly valid: digests with one character changed
            text = list(hex_to_b64("".join(f"{rng.getrandbits(64):016x}" for _ in range(n))))
            text[rng.randrange(len(text))] = rng.choice(chars)
            s = "".join(text)
        else:
            s = "".join(rng.choice(chars) for _ in range(11 * n + rng.choice([0, 0, 0, -1, 1])))
        try:
            hexs = b64_to_hex(s)
        except _Bad:
            continue
        accepted += 1
        assert hex_to_b64(hexs) == s, s
    assert accepted > 300
