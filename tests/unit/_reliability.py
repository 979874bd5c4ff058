"""Shared helpers of the unit tests: the tiny models, the one checkpoint builder
(:func:`save_checkpoint`; the ``make_checkpoint`` fixture of ``conftest.py`` puts one under
``tmp_path``; :func:`row_sliced_checkpoint` writes thousands of slices the way an FSDP2 save of
many ranks does), model comparison, safetensors/index editing, and the kill hooks of the crash tests.

The models: :class:`Tiny` (several dtypes and ranks, a buffer: spread over several shard files),
:class:`Net` (two layers of two dtypes, see :func:`trained`), :class:`MLP` (two plain linear
layers of any sizes) and :class:`Tied` (an embedding tied to the head). A test keeps its own
model only where its shape is what the test checks (each says why).
"""

from __future__ import annotations

import json
import os
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.safetensors_io import SafetensorsWriter, encode_header
from unickpt.ckpt.writer import build_block, build_index
from unickpt.spec.index import FORMAT_VERSION, LayoutInfo, as_listed, index_to_json, parse_index
from unickpt.spec.naming import SLICED_SENTINEL, shard_name, slice_key
from unickpt.wrappers import OptimizerWrapper

INDEX = "model.safetensors.index.json"
# size_per_shard is in MB; this many MB puts roughly one tensor per file for the model below.
TINY_SHARD_MB = 300 / (1024 * 1024)


class Tiny(nn.Module):
    """A few tensors of different dtypes and ranks: enough to spread over several shard files."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(8, 6, generator=g))
        self.b = nn.Parameter(torch.randn(40, generator=g))
        self.c = nn.Parameter(torch.randn(5, 4, 3, generator=g).to(torch.bfloat16))
        self.register_buffer("steps", torch.arange(7, dtype=torch.int64) + seed)
        self.d = nn.Parameter(torch.randn(3, 17, generator=g).half())


class Net(nn.Module):
    """Two layers, the second in bf16: a model whose AdamW state has tensors of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3, dtype=torch.bfloat16)


class MLP(nn.Module):
    """Two linear layers ``a`` and ``b`` (``sizes``: in, hidden, out). ``seed`` draws every
    parameter from its own generator (else from torch's global one); ``steps`` adds an int64
    buffer ``steps`` (``arange(7) * seed``)."""

    def __init__(self, *sizes: int, seed: int | None = None, steps: bool = False) -> None:
        super().__init__()
        n_in, hidden, n_out = sizes or (4, 3, 2)
        self.a = nn.Linear(n_in, hidden)
        self.b = nn.Linear(hidden, n_out)
        if steps:
            self.register_buffer("steps", torch.arange(7, dtype=torch.int64) * (seed or 0))
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Tied(nn.Module):
    """An embedding tied to the head (``head.weight is emb.weight``: stored once), and a
    projection: ``vocab`` x ``dim`` embedding, ``proj`` outputs (0: no projection)."""

    def __init__(self, vocab: int = 11, dim: int = 6, proj: int = 7) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        if proj:
            self.proj = nn.Linear(dim, proj)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: named_parameters() lists it once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        out = self.head(h)
        if hasattr(self, "proj"):
            return self.proj(h).sum() + out.sum()
        return out


def trained(seed: int) -> tuple[Net, OptimizerWrapper]:
    """A :class:`Net` and its AdamW optimizer after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m.b(m.a(torch.randn(4, 5)).to(torch.bfloat16)).float().sum().backward()
    opt.step()
    return m, OptimizerWrapper(opt, m)


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def train_state(m: nn.Module, opt: OptimizerWrapper) -> dict[str, bytes]:
    """Every byte of a model's and its optimizer's state, by name: equal dicts, equal training states."""
    out = {f"model.{k}": bits(v) for k, v in m.state_dict().items()}
    for i, st in opt.optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim.{i}.{k}"] = bits(v) if isinstance(v, torch.Tensor) else repr(v).encode()
    return out


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(model: nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    sd = model.state_dict()
    return set(sd) == set(snap) and all(
        sd[k].dtype == snap[k].dtype
        and torch.equal(sd[k].view(-1).view(torch.uint8), snap[k].view(-1).view(torch.uint8))
        if sd[k].numel()
        else sd[k].shape == snap[k].shape
        for k in snap
    )


def save_checkpoint(
    path: Path | str,
    seed: int = 0,
    *,
    model: nn.Module | None = None,
    sharded: bool = True,
    sliced: bool = False,
    shard_mb: float = TINY_SHARD_MB,
    io: GeneralCheckpointIO | None = None,
) -> nn.Module:
    """Save ``model`` (default: ``Tiny(seed)``) at ``path`` and return it: ``sharded`` (an index
    and its files, about one tensor a file), else one ``model.safetensors``; ``sliced`` keeps the
    slices (``gather_dtensor=False``: a sliced index) instead of Hugging Face files; ``io``
    saves with that CheckpointIO."""
    m = Tiny(seed) if model is None else model
    (io or GeneralCheckpointIO()).save_model(
        m,
        str(path),
        shard=sharded or sliced,
        gather_dtensor=not sliced,
        size_per_shard=shard_mb,  # type: ignore[arg-type]
    )
    return m


def row_sliced_checkpoint(
    directory: Path, world: int, tensors: int, cols: int, *, listed: bool = False
) -> dict[str, np.ndarray]:
    """A sliced checkpoint at ``directory`` as an FSDP2 save of ``world`` ranks writes it:
    ``tensors`` tensors ``layers.{i}.w`` of (``world``, ``cols``) F32, row r of each in rank r's
    file, the rows of one file back to back. The index lists every slice (``listed``) or is the
    compact form the writer writes. Returns the tensors' values."""
    rng = np.random.default_rng(0)
    names = [f"layers.{i}.w" for i in range(tensors)]
    data = {n: rng.standard_normal((world, cols)).astype(np.float32) for n in names}
    slices: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(world):
        fname = shard_name("model", r + 1, world)
        header, _ = encode_header(
            [(slice_key(n, r), "F32", (1, cols)) for n in names], {"format": "unickpt-sliced"}
        )
        rows = [data[n][r : r + 1].tobytes() for n in names]
        (directory / fname).write_bytes(header + b"".join(rows))
        for n, row in zip(names, rows, strict=True):
            slices[n].append(
                {
                    "file": fname,
                    "key": slice_key(n, r),
                    "offsets": [r, 0],
                    "shape": [1, cols],
                    "xxh3": xxhash.xxh3_64(row).hexdigest(),
                }
            )
    layout = {"plugin": "fsdp2", "world_size": world, "mesh": {"dp": world}, "gathered": False}
    obj = {
        "metadata": {"total_size": 4 * world * cols * tensors},
        "weight_map": dict.fromkeys(names, SLICED_SENTINEL),
        "unickpt": {
            "format_version": FORMAT_VERSION,
            "kind": "model",
            "created_by": "test",
            "layout": layout,
            "tensors": {n: {"dtype": "F32", "shape": [world, cols], "slices": slices[n]} for n in names},
            "aliases": {},
        },
    }
    raw = json.dumps(obj).encode()
    if not listed:
        parsed = parse_index(raw, INDEX).unickpt
        assert parsed is not None
        block = build_block(
            kind="model",
            created_by="test",
            layout=LayoutInfo(**layout),
            tensors=dict(parsed.tensors),
            aliases={},
            save_id=None,
        )
        raw = index_to_json(build_index(block, sliced=True))
    (directory / INDEX).write_bytes(raw)
    return data


def row_sliced_model(data: dict[str, np.ndarray]) -> nn.Module:
    """A zeroed module with a parameter for every ``layers.{i}.{leaf}`` of ``data``, of its shape."""
    m = nn.Module()
    m.add_module("layers", nn.Module())
    for n, v in data.items():
        _, i, leaf = n.split(".")
        if not hasattr(m.layers, i):
            m.layers.add_module(i, nn.Module())
        getattr(m.layers, i).register_parameter(leaf, nn.Parameter(torch.zeros(v.shape)))
    return m


def count_preadv(monkeypatch: Any) -> list[int]:
    """Record the buffer count of every ``preadv`` call from now on: ``os.preadv``'s and the
    local store's own libc call over an iovec array (Linux)."""
    from unickpt.store import storage

    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, bufs: Any, offset: int) -> int:
        calls.append(len(bufs))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counting)
    libc = storage._PREADV
    if libc is not None:

        def counting_libc(fd: int, iov: int, count: int, offset: int) -> int:
            calls.append(count)
            return int(libc(fd, iov, count, offset))

        monkeypatch.setattr(storage, "_PREADV", counting_libc)
    return calls


def dcp_model() -> nn.Module:
    """The model of the DCP / torchtitan training runs the import tests convert (seeded: the
    same on every call): two linear layers around a LayerNorm."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))


def dcp_optimizer(m: nn.Module) -> torch.optim.Optimizer:
    """AdamW over :func:`dcp_model`'s parameters in two groups of other hyperparameters."""
    return torch.optim.AdamW(
        [
            {"params": [m[0].weight, m[2].weight], "lr": 1e-2},
            {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "lr": 3e-3, "weight_decay": 0.0},
        ],
        betas=(0.85, 0.97),
    )


def dcp_train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 11) -> None:
    """``steps`` optimizer steps of :func:`dcp_model` on seeded random batches."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(torch.randn(3, 5, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def flat_optim(opt: torch.optim.Optimizer, m: nn.Module) -> dict[str, Any]:
    """torchtitan's ``get_flat_optim_state_dict`` (components/optimizer/utils.py), written here
    independently of unickpt's reading of it, for an optimizer built on named parameters:
    ``state.<fqn>.<key>`` and ``param_groups.<fqn>.<hyper>``."""
    names = {id(p): n for n, p in m.named_parameters()}
    osd = opt.state_dict()
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    flat: dict[str, Any] = {}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            flat[f"state.{order[pid]}.{k}"] = v
    for g in osd["param_groups"]:
        for pid in g["params"]:
            for k, v in g.items():
                if k not in ("params", "param_names"):
                    flat[f"param_groups.{order[pid]}.{k}"] = v
    return flat


def data_files(path: Path | str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def read_index(path: Path | str) -> dict[str, Any]:
    """The index as JSON, each tensor's slices listed (version 3 takes them too), to be edited."""
    with open(os.path.join(path, INDEX), "rb") as f:
        obj: dict[str, Any] = json.loads(f.read())
    return as_listed(obj)


def write_index(path: Path | str, obj: Any) -> None:
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(obj, f)


def header_of(file: Path | str) -> tuple[dict[str, Any], int]:
    """(header JSON, absolute offset of the data section) of a safetensors file."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def st_bytes(header: Any, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def tree_state(root: Path | str) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``root``: compared before/after to prove nothing was written."""
    out = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(dp, f)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def install_kill_hooks(kill_at: int, log: list[str]) -> None:
    """In the child only: SIGKILL this process at the ``kill_at``-th event (0: never)."""
    state = {"n": 0}

    def tick(what: str, before_kill: Callable[[], None] | None = None) -> None:
        state["n"] += 1
        log.append(what)
        if state["n"] == kill_at:
            if before_kill is not None:
                before_kill()
            os.kill(os.getpid(), signal.SIGKILL)

    orig_write = SafetensorsWriter.write

    def write(self: SafetensorsWriter, key: str, data: Any) -> None:
        tick(f"write-start {os.path.basename(self.path)}:{key}")
        mv = memoryview(data).cast("B")

        def half() -> None:
            assert self._f is not None
            self._f.write(mv[: mv.nbytes // 2])
            self._f.flush()

        tick(f"write-half {os.path.basename(self.path)}:{key}", half)
        orig_write(self, key, data)
        tick(f"write-end {os.path.basename(self.path)}:{key}")

    SafetensorsWriter.write = write  # type: ignore[method-assign]

    # Gathered saves (io/hf_save.py) and single files' headers are written in place
    # (``LocalStorage.open_range``: pwrite).
    from unickpt.store.storage import LocalRange

    orig_pwrite = LocalRange.pwrite

    def pwrite(f: LocalRange, data: memoryview | bytes, pos: int) -> None:
        name = f"{os.path.basename(f.path)}@{pos}"
        tick(f"write-start {name}")
        mv = memoryview(data).cast("B")
        tick(f"write-half {name}", lambda: orig_pwrite(f, mv[: mv.nbytes // 2], pos))
        orig_pwrite(f, data, pos)
        tick(f"write-end {name}")

    LocalRange.pwrite = pwrite  # type: ignore[method-assign]

    def around(mod: Any, name: str) -> None:
        orig = getattr(mod, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            label = f"{name} {os.path.basename(str(a[0])) if a and not isinstance(a[0], int) else ''}".strip()
            tick(f"before {label}")
            out = orig(*a, **k)
            tick(f"after {label}")
            return out

        setattr(mod, name, wrapped)

    for name in ("fsync", "replace", "unlink", "rename"):
        around(os, name)


def run_child(kill_at: int, fn: Callable[[], None], log_path: Path) -> int:
    """Fork; the child runs ``fn`` under the kill hooks. Returns the child's signal (or -exit code)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        log: list[str] = []
        try:
            install_kill_hooks(kill_at, log)
            fn()
        except BaseException:
            code = 3
        finally:
            with open(log_path, "w") as f:
                json.dump(log, f)
            os._exit(code)
    os.close(w)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status)
    return -os.WEXITSTATUS(status)
