"""How many unickpt modules one save and one load pass through.

Traces (``sys.setprofile``) a single-process sliced save (FSDP2 on a 1-rank gloo world,
``save_model(shard=True, gather_dtensor=False)``) and a verified load of it, and counts the
unickpt modules entered and the transitions between them (a call or a return that changes the
module on top of the stack), with how many of those go straight back to the module they came from.
The same counts for DCP's ``dcp.save``/``dcp.load`` of the same model are printed beside them.

    .venv/bin/python benchmarks/trips.py [--json out.json] [--modules]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Trips:
    """The modules under ``prefix`` that a traced call enters, and the hops between them."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.entered: Counter[str] = Counter()
        self.transitions = 0
        self.back = 0
        self._stack: list[str] = []
        self._last: list[str] = []

    def _module(self, frame: Any) -> str | None:
        name = frame.f_globals.get("__name__", "")
        if name == self.prefix or name.startswith(self.prefix + "."):
            return str(name)
        return None

    def _hop(self, to: str) -> None:
        if self._last and self._last[-1] == to:
            return
        if self._last:
            self.transitions += 1
            if len(self._last) >= 2 and self._last[-2] == to:
                self.back += 1
        self._last.append(to)

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        module = self._module(frame)
        if event == "call":
            if module is not None:
                self.entered[module] += 1
                self._stack.append(module)
                self._hop(module)
            return
        if module is not None and self._stack:
            self._stack.pop()
            if self._stack:
                self._hop(self._stack[-1])

    def run(self, fn: Callable[[], Any]) -> None:
        sys.setprofile(self.profile)
        try:
            fn()
        finally:
            sys.setprofile(None)

    def summary(self) -> dict[str, Any]:
        return {
            "modules": len(self.entered),
            "transitions": self.transitions,
            "straight_back": self.back,
            "entered": dict(sorted(self.entered.items())),
        }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--modules", action="store_true", help="print the modules entered")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import torch.distributed.checkpoint as dcp

    from unickpt import Booster
    from unickpt.plugins import FSDP2Plugin

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        booster = Booster(plugin=FSDP2Plugin())
        model, *_ = booster.boost(_model())
        path = os.path.join(tmp, "u")
        booster.save_model(model, path, shard=True, gather_dtensor=False)  # warm: imports, plan cache
        path = os.path.join(tmp, "u2")
        save = Trips("unickpt")
        save.run(lambda: booster.save_model(model, path, shard=True, gather_dtensor=False))
        booster.load_model(model, path, verify=True)
        load = Trips("unickpt")
        load.run(lambda: booster.load_model(model, path, verify=True))
        results["unickpt_save"] = save.summary()
        results["unickpt_verified_load"] = load.summary()

        sd = {k: v for k, v in model.state_dict().items()}
        dcp.save(sd, checkpoint_id=os.path.join(tmp, "d0"))
        dsave = Trips("torch.distributed.checkpoint")
        dsave.run(lambda: dcp.save(sd, checkpoint_id=os.path.join(tmp, "d")))
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "d"))
        dload = Trips("torch.distributed.checkpoint")
        dload.run(lambda: dcp.load(sd, checkpoint_id=os.path.join(tmp, "d")))
        results["dcp_save"] = dsave.summary()
        results["dcp_load"] = dload.summary()
    dist.destroy_process_group()

    for name, r in results.items():
        print(
            f"{name:24s} modules {r['modules']:3d}  transitions {r['transitions']:4d}  straight back {r['straight_back']:4d}"
        )
        if args.modules:
            for m, n in r["entered"].items():
                print(f"    {m} ({n})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
