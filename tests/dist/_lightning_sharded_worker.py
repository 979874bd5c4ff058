"""Per-rank side of test_lightning_sharded: Lightning's ModelParallelStrategy (FSDP2 in
``configure_model``) and FSDPStrategy (FSDP1) saving and resuming through unickpt's strategies."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _module(kind: str) -> Any:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if kind == "fsdp1":
                # torch's FSDP1 refuses CPU unless given device_id=cpu, which Lightning's
                # FSDPStrategy never passes ("FSDP needs a non-CPU accelerator device"): the
                # module is wrapped here, and the strategy takes it as already wrapped.
                from torch.distributed.fsdp import FullyShardedDataParallel

                self.net = FullyShardedDataParallel(
                    self.net, device_id=torch.device("cpu"), use_orig_params=True
                )
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)
            fully_shard(self, mesh=mesh)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.8, 0.95))
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)}

    return Tiny()


def _data() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=g)
    ds = torch.utils.data.TensorDataset(x, torch.stack([x.sum(1), x[:, 0], x[:, 1] * x[:, 2]], 1))
    return torch.utils.data.DataLoader(ds, batch_size=3)


def _strategy(kind: str) -> Any:
    from unickpt.integrations.lightning import UnickptFSDPStrategy, UnickptModelParallelStrategy

    if kind == "fsdp2":
        return UnickptModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)
    return UnickptFSDPStrategy()


def _weights(module: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _trainer(kind: str, epochs: int, root: str | None, **kw: Any) -> Any:
    """A Lightning ``Trainer`` over this world (every process a device) with ``kind``'s strategy."""
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "unickpt-tests")  # Lightning joins this world
    import lightning.pytorch as pl

    return pl.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=_strategy(kind),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def train_and_resume(root: str, kind: str) -> dict[str, Any]:
    """4 epochs straight; 2 epochs saving each; 2 more resumed from epoch 1's checkpoint."""
    import lightning.pytorch as pl

    def trainer(epochs: int, name: str, **kw: Any) -> Any:
        return _trainer(kind, epochs, os.path.join(root, name), **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = _module(kind)
        trainer(4, "full", enable_checkpointing=False).fit(full, _data())
        first = _module(kind)
        cb = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ck"), save_top_k=-1)
        bad = _Unencodable()
        t1 = trainer(2, "a", callbacks=[cb, bad])
        t1.fit(first, _data())
        ckpt = os.path.join(root, "ck", "epoch=1-step=8.ckpt")
        failed = _failed_save(t1, bad, ckpt)
        second = _module(kind)
        t2 = trainer(4, "b", enable_checkpointing=False)
        t2.fit(second, _data(), ckpt_path=ckpt)
    a, b = _weights(full), _weights(second)
    opt_full = full.trainer.optimizers[0].state_dict()["state"]
    opt_second = second.trainer.optimizers[0].state_dict()["state"]

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    return {
        "world": t2.world_size,
        "full": full.losses,
        "resumed": first.losses + second.losses,
        "same_weights": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
        "same_optimizer": sorted(opt_full) == sorted(opt_second)
        and all(
            torch.equal(local(opt_full[p][k]), local(opt_second[p][k])) for p in opt_full for k in opt_full[p]
        ),
        "lr": t2.optimizers[0].param_groups[0]["lr"],
        "ckpt": sorted(os.listdir(ckpt)),
        "failed_save": failed,
    }


class _Unencodable:
    """A callback whose state JSON cannot hold once ``on`` (a function): rank 0 fails alone."""

    def __new__(cls) -> Any:
        import lightning.pytorch as pl

        class Unencodable(pl.Callback):
            on = False

            def state_dict(self) -> dict[str, Any]:
                return {"fn": print} if self.on else {}

        return Unencodable()


def _failed_save(trainer: Any, bad: Any, ckpt: str) -> dict[str, Any]:
    """Save over ``ckpt`` with a state rank 0 cannot write: what each rank raised, and whether the
    committed checkpoint and its directory stayed as they were."""
    parent = os.path.dirname(ckpt)
    state = Path(ckpt) / "lightning.json"
    before = state.read_bytes()
    listing = sorted(os.listdir(parent))
    bad.on = True
    try:
        trainer.save_checkpoint(ckpt)
        raised: tuple[str, str] | None = None
    except Exception as e:
        raised = (type(e).__name__, str(e))
    finally:
        bad.on = False
    dist.barrier()
    return {
        "raised": raised,
        "unchanged": state.read_bytes() == before,
        "listing_same": sorted(os.listdir(parent)) == listing,
    }


def train_and_resume_on_a_store(url: str, env: dict[str, str], kind: str) -> dict[str, Any]:
    """As :func:`train_and_resume` with ``ModelCheckpoint(dirpath=url)`` on an object store (every
    rank writes its slices there, rank 0 commits ``lightning.json`` last), then a save over the
    epoch 0's checkpoint failing on rank 0 alone: on a store the old one was un-committed first,
    so it is gone whole (no object of it left), never half replaced."""
    os.environ.update(env)
    import fsspec
    import lightning.pytorch as pl

    def trainer(epochs: int, **kw: Any) -> Any:
        return _trainer(kind, epochs, None, **kw)

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    ckpt = f"{url}/epoch=1-step=8.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = _module(kind)
        trainer(4, enable_checkpointing=False).fit(full, _data())
        first = _module(kind)
        cb = pl.callbacks.ModelCheckpoint(dirpath=url, save_top_k=-1)
        bad = _Unencodable()
        t1 = trainer(2, callbacks=[cb, bad])
        t1.fit(first, _data())
        listing = sorted(p.rsplit("/", 1)[1] for p in fs.ls(ckpt.removeprefix("s3://"), detail=False))
        # A save over epoch 0's checkpoint that rank 0 cannot write (a callback's state).
        over = f"{url}/epoch=0-step=4.ckpt"
        bad.on = True
        try:
            t1.save_checkpoint(over)
            raised: tuple[str, str] | None = None
        except Exception as e:
            raised = (type(e).__name__, str(e))
        bad.on = False
        dist.barrier()
        fs.invalidate_cache()
        left = fs.find(over.removeprefix("s3://"))
        second = _module(kind)
        t2 = trainer(4, enable_checkpointing=False)
        t2.fit(second, _data(), ckpt_path=ckpt)
    a, b = _weights(full), _weights(second)
    return {
        "full": full.losses,
        "resumed": first.losses + second.losses,
        "same_weights": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
        "ckpt": listing,
        "raised": raised,
        "left": left,
    }
