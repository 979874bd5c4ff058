"""Every ``python`` and ``bash`` code block of README.md and docs/*.md runs as written.

Blocks of one file run in document order in one process, sharing their names, in a fresh
directory that holds the small things the docs name (a tiny ``model`` with ``mlp.up`` and
``mlp.down``, ``optimizer``, ``criterion``, ``dataloader``, ``lr_scheduler``, ``x``, ``y``, ``ema``,
``total_steps``; a DCP checkpoint ``dcp_dir`` and a training one ``step-1000/``, a manager run
``run/``, a DeepSpeed checkpoint ``ds_ckpt/``). A ``bash`` block runs line by line with the
``unickpt`` of this environment on the path; every line must exit 0. Plugins run as a
one-process world (what a script started without torchrun gets).

An HTML comment on the line just before a fence says how its block runs:

- ``<!-- docs-test: new-process -->``: from here on, a new process (the docs' "later, in another
  run");
- ``<!-- docs-test: setup=NAME -->``: a new process whose names come from the setup ``NAME``
  (``deepspeed``: the model and optimizer of tests/data/deepspeed's fixtures);
- ``<!-- docs-test: skip REASON -->``: not run, for the reason given (``make test`` itself, a
  package install, a URL of a store that is not there). Each skip must give its reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    file: str
    line: int
    lang: str
    code: str
    mark: str


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        mark = _MARK.match(lines[start - 1]) if start else None
        out.append(Block(path.name, start + 1, lang, "\n".join(body) + "\n", mark.group(1) if mark else ""))
    return out


def _sessions(path: Path) -> list[tuple[str, list[Block]]]:
    """(setup, blocks) per process of one file: its runnable blocks, split at new-process marks."""
    out: list[tuple[str, list[Block]]] = []
    current: list[Block] = []
    setup = "default"
    for b in _blocks(path):
        if b.lang not in ("python", "bash") or b.mark.startswith("skip"):
            continue
        if b.mark == "new-process" or b.mark.startswith("setup="):
            if current:
                out.append((setup, current))
            current = []
            setup = b.mark.removeprefix("setup=") if b.mark.startswith("setup=") else "default"
        current.append(b)
    if current:
        out.append((setup, current))
    return out


SETUPS = {
    "default": """
import os
import random
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unickpt
from unickpt.data import wrap_dataloader

torch.manual_seed(0)
random.seed(0)


# The names the docs' code blocks use (MyModel, MLP): defined as the docs show them.
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.mlp(x)))


class EMA:
    def __init__(self, model) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state_dict(self):
        return dict(self.shadow)

    def load_state_dict(self, sd) -> None:
        self.shadow = dict(sd)


model = MyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
dataloader = dl = wrap_dataloader(DataLoader(TensorDataset(torch.randn(8, 8), torch.randint(0, 4, (8,))), batch_size=2))
lr_scheduler = sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
ema = EMA(model)
total_steps = 3

# What the shell blocks name: a DCP checkpoint, a DCP training checkpoint, a manager run
# (made by the file's first process; later ones find them).
if not os.path.exists("dcp_dir"):
    _m = MyModel()
    dcp.save(_m.state_dict(), checkpoint_id="dcp_dir", no_dist=True)
    dcp.save({"model": _m.state_dict()}, checkpoint_id="step-1000", no_dist=True)
    _mgr = unickpt.CheckpointManager("run", save_steps=1)
    _mgr.save(1, _m, None)
    _mgr.wait()
    shutil.copytree(DEEPSPEED / "zero2_ws2" / "ckpt", "ds_ckpt")
    del _m, _mgr
""",
    "deepspeed": """
import json

import torch
from torch import nn

import os
import shutil

if not os.path.exists("ds_ckpt"):
    shutil.copytree(DEEPSPEED / "zero2_ws2" / "ckpt", "ds_ckpt")
model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
model.register_buffer("scale", torch.zeros(3))
_named = dict(model.named_parameters())
_groups = json.loads((DEEPSPEED / "zero2_ws2" / "expected.json").read_text())["param_groups"]
optimizer = torch.optim.AdamW([{"params": [_named[n] for n in g["params"]]} for g in _groups])
""",
    "lightning": """
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


model = Tiny()
dataloader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)
""",
    "hf_trainer": """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=4, n_positions=16))


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        ids = (torch.arange(8) + i) % 64
        return {"input_ids": ids, "labels": ids}


train_ds = _Tokens()
""",
    "peft": """
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


def make_base():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


model = get_peft_model(make_base(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False))
""",
    "accelerate": """
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
""",
}

DRIVER = """
import os, subprocess, sys, traceback
from pathlib import Path
DEEPSPEED = Path({data!r})
BLOCKS = {blocks!r}
env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
ns = {{"__name__": "__main__", "DEEPSPEED": DEEPSPEED}}
exec(compile({setup!r}, "<setup>", "exec"), ns)
for where, lang, code in BLOCKS:
    if lang == "python":
        try:
            exec(compile(code, where, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"{{where}}: the python block failed")
        continue
    for line in code:
        cp = subprocess.run(line, shell=True, env=env, capture_output=True, text=True)
        if cp.returncode != 0:
            sys.exit(f"{{where}}: `{{line}}` exited {{cp.returncode}}:\\n{{cp.stdout[-2000:]}}{{cp.stderr[-3000:]}}")
# A session ends as a training script should: a world a block made is destroyed (gloo's threads
# can abort the interpreter's exit otherwise, "terminate called without an active exception").
import torch.distributed as _td
if _td.is_available() and _td.is_initialized():
    _td.destroy_process_group()
"""

FILES = [p for p in DOCS if _sessions(p)]


def _lines(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, blank and comment lines dropped."""
    joined = code.replace("\\\n", " ")
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_every_block_runs_or_says_why_not() -> None:
    for path in DOCS:
        for b in _blocks(path):
            if b.lang in ("python", "bash") and not b.mark.startswith("skip"):
                continue
            if b.lang in ("python", "bash"):
                assert b.mark.removeprefix("skip").strip(), (
                    f"{b.file}:{b.line}: a skipped block needs a reason"
                )


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_doc_blocks_run(path: Path, tmp_path: Path) -> None:
    """The file's blocks in order, one process per session, all in one directory."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    for setup, blocks in _sessions(path):
        where = f"{path.name}:{blocks[0].line}"
        assert setup in SETUPS, f"{where}: unknown setup {setup!r}"
        script = DRIVER.format(
            data=str(ROOT / "tests" / "data" / "deepspeed"),
            blocks=[
                (f"{b.file}:{b.line}", b.lang, b.code if b.lang == "python" else _lines(b.code))
                for b in blocks
            ],
            setup=textwrap.dedent(SETUPS[setup]),
        )
        cp = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(env, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"),
        )
        assert cp.returncode == 0, f"{where}:\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}"
