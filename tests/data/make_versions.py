"""Make tests/data/versions/: small checkpoints of format versions 1 to 4, for ``unickpt upgrade``.

Each ``v<N>/`` holds, as the writers of version N wrote them:

- ``sliced/``: a sliced model checkpoint (two data files; row, column and whole slices, a tie);
- ``gathered/``: a gathered (Hugging Face) model checkpoint;
- ``single.safetensors``: a single-file model checkpoint (the block in its header metadata);
- ``optimizer/``: a sliced optimizer checkpoint (SGD with momentum);

and ``expected.safetensors`` (plain safetensors) the tensors they hold, model and optimizer
(``state.<fqn>.<key>``), for bit-exact comparisons. Written with unickpt at commit dcdde7a (run from an export of it),
the last one whose writers wrote every version (``index.as_version``, the version 1
fingerprint); this script does not run against later code and is kept as the record of how the
fixtures were made.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from unickpt import GeneralCheckpointIO
from unickpt.spec.hashing import fingerprint_of_array  # type: ignore[attr-defined]
from unickpt.spec.index import as_version  # type: ignore[attr-defined]
from unickpt.spec.naming import LONG_SLICED_SENTINEL  # type: ignore[attr-defined]
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

OUT = Path(__file__).parent / "versions"


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 4, bias=False))
    with torch.no_grad():
        m[1].weight.data = m[1].weight.data.to(torch.bfloat16)
    return m


def _tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}


DT = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64"}


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


def _boxes(shape: tuple[int, ...], how: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if not shape or how == "whole":
        return [((0,) * len(shape), shape)]
    if how == "rows":  # torch.chunk into 4 (9 rows: 3, 3, 3, 0)
        step = -(-shape[0] // 4)
        out = []
        for k in range(4):
            b = min(k * step, shape[0])
            e = min(b + step, shape[0])
            out.append(((b,) + (0,) * (len(shape) - 1), (e - b, *shape[1:])))
        return out
    c = shape[1] // 2  # two column blocks
    return [((0, 0), (shape[0], c)), ((0, c), (shape[0], shape[1] - c))]


def _write_sliced(d: Path, ts: dict[str, torch.Tensor], hows: dict[str, str]) -> None:
    data = {}
    for n, t in ts.items():
        sl = []
        for o, s in _boxes(tuple(t.shape), hows[n]):
            part = t[tuple(slice(x, x + k) for x, k in zip(o, s, strict=True))]
            sl.append(SliceData(o, s, _raw(part)))
        data[n] = TensorData(DT[t.dtype], list(t.shape), sl)
    write_checkpoint(str(d), data, sliced=True, files=2, aliases={"tied.weight": "1.weight"})


def _write_gathered(d: Path, ts: dict[str, torch.Tensor]) -> None:
    data = {
        n: TensorData(DT[t.dtype], list(t.shape), [SliceData((0,) * t.dim(), tuple(t.shape), _raw(t))])
        for n, t in ts.items()
    }
    write_checkpoint(str(d), data, sliced=False, max_shard_bytes=200)


def _old(obj: dict[str, Any], v: int, ts: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``obj`` (a version 5 index or block holder) as version ``v`` wrote it."""
    as_version(obj, v)
    if v <= 3:
        obj["weight_map"] = {
            k: (LONG_SLICED_SENTINEL if f == "run-unickpt-merge-first.safetensors" else f)
            for k, f in obj.get("weight_map", {}).items()
        }
    if v == 1:
        for n, e in obj["unickpt"]["tensors"].items():
            t = ts[n]
            e["fingerprint"] = fingerprint_of_array(
                n, DT[t.dtype], _raw(t).tobytes(), list(t.shape), version=1
            )
    return obj


def _dump(obj: dict[str, Any], v: int) -> str:
    if v <= 2:  # versions 1 and 2 indented their index
        return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _rewrite_index(d: Path, kind: str, v: int, ts: dict[str, torch.Tensor]) -> None:
    f = d / f"{kind}.safetensors.index.json"
    obj = json.loads(f.read_text())
    f.write_text(_dump(_old(obj, v, ts), v))


def _rewrite_single(f: Path, v: int, ts: dict[str, torch.Tensor]) -> None:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header["__metadata__"]
    holder = _old({"unickpt": json.loads(meta["unickpt"])}, v, ts)
    meta["unickpt"] = json.dumps(holder["unickpt"], separators=(",", ":"))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    m = _model()
    opt = torch.optim.SGD(m.named_parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    mts = _tensors(m)  # after the step: every model checkpoint holds these
    io = GeneralCheckpointIO()
    hows = {"0.weight": "rows", "0.bias": "rows", "1.weight": "cols"}
    for v in (1, 2, 3, 4):
        base = OUT / f"v{v}"
        _write_sliced(base / "sliced", mts, hows)
        _rewrite_index(base / "sliced", "model", v, mts)
        _write_gathered(base / "gathered", mts)
        _rewrite_index(base / "gathered", "model", v, mts)
        io.save_model(m, base / "single.safetensors", shard=False, gather_dtensor=True)
        _rewrite_single(base / "single.safetensors", v, mts)
        io.save_optimizer(opt, base / "optimizer", shard=True, gather_dtensor=False)
        with open(base / "optimizer" / "optimizer.safetensors.index.json") as fh:
            names = json.load(fh)["unickpt"]["tensors"]
        ots = _optim_tensors(opt, m, names)
        _rewrite_index(base / "optimizer", "optimizer", v, ots)
        for p in base.rglob(".unickpt.lock"):
            p.unlink()
    ots = _optim_tensors(opt, m, None)
    save_file({**mts, **ots}, str(OUT / "expected.safetensors"))
    print(sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file()), "bytes", file=sys.stderr)


def _optim_tensors(opt: Any, m: torch.nn.Module, names: Any) -> dict[str, torch.Tensor]:
    fqn = {id(p): n for n, p in m.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k, t in st.items():
            if isinstance(t, torch.Tensor):
                out[f"state.{fqn[id(p)]}.{k}"] = t.detach().clone().contiguous()
    if names is not None:
        missing = set(names) - set(out)
        assert not missing, missing
    return out


if __name__ == "__main__":
    main()
