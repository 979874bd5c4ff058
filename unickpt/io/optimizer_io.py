"""``OptimizerIO``: the optimizer side of ``CheckpointIO`` (planning a save, loading any layout).

Optimizer state is saved keyed by parameter FQN (``state.<fqn>.<key>`` tensors, scalars and
``param_groups`` as JSON in the block), so it loads under any layout: each rank's template comes
from the ``_optimizer_state`` hook, is filled like a model's tensors, and is handed back to
``_set_optimizer_state``. ``CheckpointIO`` adds the public ``save_optimizer`` on top.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt.errors import UnsupportedError
from unickpt.format.reader import CheckpointReader
from unickpt.io.async_save import AsyncSaveIO
from unickpt.io.hooks import HookContext
from unickpt.io.jsonstate import to_json_value
from unickpt.io.load import LoadReport, load_tensors
from unickpt.io.names import apply_prefix
from unickpt.io.optim_state import (
    apply_groups,
    merge_groups,
    optimizer_tensor_name,
    param_of,
    same_optimizer_class,
    state_targets,
)
from unickpt.io.param_groups import validate_param_groups
from unickpt.io.param_names import check_param_names, model_from_param_names
from unickpt.io.payload import SavePayload
from unickpt.wrappers import unwrap_optimizer

__all__ = ["OptimizerIO"]


class OptimizerIO(AsyncSaveIO):
    """``AsyncSaveIO`` with the optimizer's planning and loading (collective methods)."""

    def plan_optimizer(
        self,
        optimizer: Any,
        prefix: str | None = None,
        *,
        shard: bool = True,
        gather_dtensor: bool = False,
        args: _dist.Args | None = None,
    ) -> SavePayload:
        """Collective: what this rank saves of ``optimizer`` (param groups merged over ranks).

        ``shard``/``gather_dtensor`` as for :meth:`plan_model`; ``args``: the calling save's
        arguments, checked equal on every rank by the first agreement. Each local phase is agreed before the next collective: an optimizer that fails on one
        rank (another class, a value JSON cannot hold) raises on every rank, none waits.
        """
        optim, model = _dist.agreed(
            lambda: self._optim_and_model(optimizer), "checking the optimizer to save", self.group, args
        )
        same_optimizer_class(optim, self.group)
        ctx = HookContext(
            "optimizer", saving=True, model=model, optimizer=optim, gather=gather_dtensor, shard=shard
        )
        had_state = {id(param) for param, st in optim.state.items() if st}
        try:
            osd = _dist.agreed(
                lambda: self._optimizer_state(ctx), "collecting the optimizer's state", self.group
            )
            payload = _dist.agreed(
                lambda: self._plan_optimizer(ctx, osd, had_state, prefix),
                "planning the optimizer save",
                self.group,
            )
        except BaseException:
            # A failed save leaves behind no state torch invented for parameters that never stepped.
            for _, param in self._state_parameters(model):
                if id(param) not in had_state:
                    optim.state.pop(param, None)
            raise
        # Pipeline stages each know part of every group: merge the ranks' views.
        all_groups = _dist.all_gather_object(payload.block_extras["param_groups"], self.group)
        all_scalars = _dist.all_gather_object(payload.block_extras["param_state"], self.group)
        merged_scalars: dict[str, dict[str, Any]] = {}
        for ps in all_scalars:
            merged_scalars.update(ps)
        payload.block_extras = {"param_groups": merge_groups(all_groups), "param_state": merged_scalars}
        return payload

    def _plan_optimizer(
        self, ctx: HookContext, osd: dict[str, Any], had_state: set[int], prefix: str | None
    ) -> SavePayload:
        model, optim = ctx.model, ctx.optim
        p = apply_prefix(prefix)
        # torch fills in state for parameters that never stepped (a zero-gradient step);
        # that state is not the user's and is neither saved nor left behind.
        for fqn, param in self._state_parameters(model):
            if id(param) not in had_state:
                optim.state.pop(param, None)
                osd["state"].pop(fqn, None)
        maybe_fail("optimizer.plan")
        tensors: dict[str, torch.Tensor] = {}
        extras: dict[str, dict[str, Any]] = {}
        param_state: dict[str, dict[str, Any]] = {}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    name = optimizer_tensor_name(p + fqn, k)
                    tensors[name] = v
                    extras[name] = {"param": p + fqn, "state": k}
                else:
                    param_state.setdefault(p + fqn, {})[k] = to_json_value(v, f"state[{fqn!r}][{k!r}]")
        groups = [
            {
                **{
                    k: to_json_value(v, f"param_groups[{i}][{k!r}]")
                    for k, v in g.items()
                    if k not in ("params", "param_names")  # the FQNs are "params" already
                },
                "params": [p + f for f in g["params"]],
            }
            for i, g in enumerate(osd["param_groups"])
        ]
        slices = self._local_slices_of(tensors, ctx)
        return SavePayload(
            "optimizer",
            tensors,
            slices,
            entry_extras=extras,
            block_extras={"param_groups": groups, "param_state": param_state},
        )

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        verify: bool = False,
        *,
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> LoadReport:
        """Collective: load optimizer state saved under any layout into this optimizer.

        State is matched by parameter FQN; hyperparameters of each group come from the saved
        group holding the same parameters. A parameter with no saved state (never stepped)
        gets none. ``checkpoint`` is a directory or the single file of an unsharded save.
        ``low_cpu_mem_mode``/``num_threads`` are accepted (Colossal-AI) and change nothing; a
        string in the third place is Colossal-AI's positional ``prefix``.
        """
        del low_cpu_mem_mode, num_threads
        if isinstance(verify, str) and prefix is None:  # Colossal-AI's third positional is prefix
            prefix, verify = verify, False
        self.wait()
        args = _dist.Args(
            "load_optimizer",
            {"checkpoint": _dist.path_arg(checkpoint), "verify": verify, "prefix": prefix},
            check=lambda: apply_prefix(prefix),
        )
        optim, model = _dist.agreed(
            lambda: self._optim_and_model(optimizer), "checking the optimizer to load", self.group, args
        )
        same_optimizer_class(optim, self.group)
        p = apply_prefix(prefix)
        where = os.fspath(checkpoint)
        reader = self._open(checkpoint, "optimizer")
        try:
            block = reader.block
            # Every FQN some rank's optimizer holds (pipeline stages each hold a part).
            mine = [p + f for f, _ in self._state_parameters(model)]
            known = {f for fs in _dist.all_gather_object(mine, self.group) for f in fs}

            def check_groups() -> None:
                maybe_fail("optimizer.load.prepare")
                validate_param_groups(
                    block.param_groups or [],
                    self._live_groups(model, optim),
                    prefix=p,
                    known=known,
                    where=where,
                )

            # Before anything changes: a refused checkpoint leaves the optimizer as it was.
            _dist.agreed(check_groups, f"checking the param_groups of {where}", self.group)
            had_state = {id(param) for param, st in optim.state.items() if st}
            ctx = HookContext("optimizer", saving=False, model=model, optimizer=optim)
            done = False
            saved_params: set[str] = set()
            try:
                report, template, saved_params = self._load_optimizer_state(reader, ctx, p, verify, where)

                def apply() -> None:
                    maybe_fail("optimizer.load.apply")
                    apply_groups(template["param_groups"], block.param_groups or [], p)
                    self._set_optimizer_state(ctx, template)

                _dist.agreed(apply, f"applying the optimizer state of {where}", self.group)
                done = True
                self._after_load(ctx)
            finally:
                # Building the template gave parameters without state fresh state (a zero-gradient
                # step); parameters the checkpoint holds no state for get none, and a failed load
                # leaves none invented behind.
                for fqn, param in self._state_parameters(model):
                    if (done and p + fqn not in saved_params) or (not done and id(param) not in had_state):
                        optim.state.pop(param, None)
            return report
        finally:
            reader.close()

    def _live_groups(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """The optimizer's param groups with ``params`` as FQN lists, read without changing anything."""
        fqns: dict[int, list[str]] = {}
        for fqn, t in self._state_parameters(model):
            fqns.setdefault(id(t), []).append(fqn)
        return [
            dict(g, params=[f for prm in g["params"] for f in fqns.get(id(prm), [])])
            for g in optim.param_groups
        ]

    def _load_optimizer_state(
        self, reader: CheckpointReader, ctx: HookContext, p: str, verify: bool, where: str
    ) -> tuple[LoadReport, dict[str, Any], set[str]]:
        """Collective: build the state template, then read the saved tensors into it."""
        block = reader.block
        saved_params = {e.param for e in block.tensors.values() if e.param is not None} | set(
            block.param_state
        )

        def prepare() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            template = self._optimizer_state(ctx)
            fqns = [f for f, _ in self._state_parameters(ctx.model)]
            return template, state_targets(template, block, p, saved_params, fqns, where)

        template, targets = _dist.agreed(prepare, f"preparing the optimizer to load {where}", self.group)
        owned = {p + f for f in template["state"]}
        report = load_tensors(
            reader,
            targets,
            self._local_slices_fn(ctx),
            strict=True,
            verify=verify,
            what="optimizer",
            group=self.group,
            ignore_unexpected=lambda n: param_of(reader, n) not in owned,
            atomic=self.atomic_load,
        )
        return report, template, saved_params

    def _optim_and_model(self, optimizer: Any) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
        optim, model = unwrap_optimizer(optimizer)
        if model is None:
            # torch keeps the names of an optimizer built from model.named_parameters().
            model = model_from_param_names(optim)
            if model is None:
                raise UnsupportedError(
                    "optimizer state is saved keyed by parameter FQN, which needs the model: pass the optimizer "
                    "returned by Booster.boost(), unickpt.OptimizerWrapper(optimizer, model), or an optimizer "
                    "built from model.named_parameters()"
                )
        else:
            check_param_names(optim, self._state_parameters(model))
        return optim, model
