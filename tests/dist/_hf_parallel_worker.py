"""Worker side of test_hf_parallel: gathered saves written by every rank, under every plugin.

Each layout (``_pp_zero_hybrid_worker``'s ``PipeNet``: odd sizes, a tied embedding across pipeline
stages, a bf16 parameter, a buffer) trains one step, then saves its model gathered (several
shard files, and one file) and its optimizer gathered. Rank 0 then checks, against the full
tensors the layout holds (gathered by the test, not by the save):

- every stored tensor bit for bit (``safetensors.torch.load_file``, as Hugging Face reads them);
- the shard files byte for byte against the files the rank-0 gathered save wrote (the planner's
  grouping of whole tensors and ``format.writer.write_files`` with the same save id: the code
  path every gathered save took before);
- the single file's data section byte for byte against the sharded save's tensors;
- ``verify_checkpoint`` clean, and the index records ranges only where several ranks wrote.

Extra cases: a transformers model under FSDP2 x4 saved gathered loads in ``from_pretrained``
bit for bit; one flipped byte in a range written by one rank is named by ``verify`` (tensor and
byte range) and refused by ``load_model(verify=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

TINY_MB = 0.004  # several shard files for PipeNet's state


def _plugin(layout: str) -> Any:
    from _pp_zero_hybrid_worker import make_plugin

    if layout == "ddp4":
        from unickpt.plugins.ddp import DDPPlugin

        return DDPPlugin()
    return make_plugin(layout)


def _setup(layout: str) -> Any:
    import _pp_zero_hybrid_worker as w

    from unickpt.booster import Booster

    s = object.__new__(w.Setup)
    s.layout = layout
    s.plugin = _plugin(layout)
    s.booster = Booster(s.plugin)
    model = w.make_model(0)
    s.model, s.optim, *_ = s.booster.boost(model, w.make_optimizer(model), criterion=w.loss_fn)
    return s


def _read_all(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def reference_files(d: str, full: dict[str, torch.Tensor], kind: str, size_mb: float, out: str) -> list[str]:
    """The files the rank-0 gathered save wrote for the checkpoint in ``d`` (same save id, same order)."""
    from unickpt.ckpt.writer import data_file_metadata, write_files
    from unickpt.io.planner import plan_save
    from unickpt.io.tensors import as_bytes
    from unickpt.spec.index import load_index

    idx = load_index(os.path.join(d, f"{kind}.safetensors.index.json"))
    block = idx.unickpt
    assert block is not None and block.save_id is not None
    metas = [
        (n, t.dtype, tuple(t.shape), (0,) * len(t.shape), tuple(t.shape)) for n, t in block.tensors.items()
    ]
    plan = plan_save([metas], kind=kind, size_per_shard_bytes=int(size_mb * 1024 * 1024), sliced=False)
    specs = [
        (f.name, [(ps.key, block.tensors[ps.name].dtype, ps.shape) for ps in f.slices]) for f in plan.files
    ]

    def blocks() -> Any:
        for f in plan.files:
            for ps in f.slices:
                t = full[ps.name]
                yield ps.key, as_bytes(t), (ps.shape, ps.offsets, ps.shape)

    os.makedirs(out, exist_ok=True)
    meta = data_file_metadata(False, block.save_id)
    write_files(out, specs, lambda _f: meta, blocks(), fsync=False)
    return [f.name for f in plan.files]


def layout_case(layout: str, root: str) -> dict[str, Any]:
    from _pp_zero_hybrid_worker import full_state

    s = _setup(layout)
    s.train_step(0)
    d = os.path.join(root, layout)
    s.booster.save_model(
        s.model, os.path.join(d, "model"), shard=True, gather_dtensor=True, size_per_shard=TINY_MB
    )
    s.booster.save_model(s.model, os.path.join(d, "one"), shard=False, gather_dtensor=True)
    s.booster.save_optimizer(
        s.optim, os.path.join(d, "optim"), shard=True, gather_dtensor=True, size_per_shard=TINY_MB
    )
    exp = full_state(s)  # collective
    info: dict[str, Any] = {}
    on_rank0(lambda: _check_files(layout, d, exp, info))
    # Every layout loads its own gathered checkpoint back, checking every range on the way.
    s2 = _setup(layout)
    s2.booster.load_model(s2.model, os.path.join(d, "model"), verify=True)
    s2.booster.load_optimizer(s2.optim, os.path.join(d, "optim"))
    got_state = full_state(s2)

    def same() -> None:
        bad = [k for k in exp if not _bits_equal(exp[k], got_state[k])]
        assert not bad, f"{layout}: reloaded state differs: {bad}"

    on_rank0(same)
    return info


def on_rank0(fn: Any) -> None:
    """Run ``fn`` on rank 0; every rank raises its failure after a barrier (no rank left waiting)."""
    err: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            fn()
        except BaseException as e:
            err = e
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, err is not None)
    if err is not None:
        raise err
    if any(flags):
        raise AssertionError("rank 0's check failed")


def _check_files(layout: str, d: str, exp: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    from unickpt.spec.index import load_index
    from unickpt.tools.verify import verify_checkpoint

    model = {k[len("model/") :]: v for k, v in exp.items() if k.startswith("model/")}
    if not layout.startswith("hyb_pp"):  # tied to emb.weight: stored once, unless on another stage
        model.pop("head.weight")
    optim = {
        f"state.{k[len('optim/') :].rsplit('/', 1)[0]}.{k.rsplit('/', 1)[1]}": v
        for k, v in exp.items()
        if k.startswith("optim/")
    }
    for sub, kind, want in (("model", "model", model), ("optim", "optimizer", optim)):
        ck = os.path.join(d, sub)
        got = _read_all(ck)
        assert sorted(got) == sorted(want), f"{layout}/{sub}: {sorted(set(got) ^ set(want))}"
        bad = [k for k in want if not _bits_equal(got[k], want[k])]
        assert not bad, f"{layout}/{sub}: values differ: {bad}"
        ref = os.path.join(d, f"ref-{sub}")
        names = reference_files(ck, want, kind, TINY_MB, ref)
        assert sorted(names) == sorted(f for f in os.listdir(ck) if f.endswith(".safetensors")), layout
        for f in names:
            with open(os.path.join(ck, f), "rb") as a, open(os.path.join(ref, f), "rb") as b:
                assert a.read() == b.read(), f"{layout}/{sub}/{f}: not the bytes of the rank-0 gathered save"
        report = verify_checkpoint(ck)
        assert not report and report.hashed == len(want), (layout, sub, [str(x) for x in report])
        idx = load_index(os.path.join(ck, f"{kind}.safetensors.index.json"))
        assert idx.unickpt is not None and idx.unickpt.layout.gathered
        info[sub] = {
            n: len(t.slices[0].ranges or []) for n, t in idx.unickpt.tensors.items() if t.slices[0].ranges
        }
    one = _read_all(os.path.join(d, "one"))
    assert sorted(one) == sorted(model) and all(_bits_equal(one[k], model[k]) for k in model), layout
    assert not verify_checkpoint(os.path.join(d, "one"))


def flipped_byte_case(root: str) -> str:
    """One flipped byte inside the range rank 2 wrote: verify names it; load_model(verify=True) refuses."""
    from unickpt.ckpt.reader import RangeFailure
    from unickpt.ckpt.safetensors_io import read_header
    from unickpt.errors import IntegrityError
    from unickpt.spec.index import load_index
    from unickpt.tools.verify import verify_checkpoint

    src = os.path.join(root, "fsdp2x4", "model")
    bad = os.path.join(root, "flipped")
    name = "blocks.0.up.weight"  # [34, 16] F32 over 4 ranks: rows 9, 9, 8, 8

    def flip() -> None:
        shutil.copytree(src, bad)
        idx = load_index(os.path.join(bad, "model.safetensors.index.json"))
        assert idx.unickpt is not None
        sl = idx.unickpt.tensors[name].slices[0]
        assert sl.xxh3 is None and sl.ranges is not None and len(sl.ranges) == 4, sl
        r = sl.ranges[2]
        path = os.path.join(bad, sl.file)
        h = read_header(path)
        at = h.data_start + h.entries[name].begin + r.start + 5
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
        report = verify_checkpoint(bad)
        assert len(report) == 1, [str(x) for x in report]  # the range (it says it all: no fingerprint)
        (fail,) = report
        assert isinstance(fail, RangeFailure)
        assert (fail.tensor, fail.file, fail.start, fail.end) == (name, sl.file, r.start, r.end)
        assert f"bytes [{r.start}, {r.end}) of the tensor" in str(fail)

    on_rank0(flip)
    s = _setup("fsdp2x4")
    try:
        s.booster.load_model(s.model, bad, verify=True)
    except IntegrityError as e:
        msg = str(e)
    else:
        raise AssertionError("a flipped byte loaded")
    assert name in msg and "bytes [" in msg, msg
    return msg


def transformers_case(root: str) -> None:
    """A transformers model under FSDP2 x4, saved gathered: from_pretrained loads it bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from unickpt.booster import Booster
    from unickpt.plugins import FSDP2Plugin

    cfg = LlamaConfig(
        vocab_size=67,
        hidden_size=24,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    ref = LlamaForCausalLM(cfg)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(3)
    b = Booster(FSDP2Plugin())
    model, *_ = b.boost(LlamaForCausalLM(cfg))
    d = os.path.join(root, "llama")
    b.save_model(model, d, shard=True, gather_dtensor=True, size_per_shard=0.01)

    def check() -> None:
        assert os.path.exists(os.path.join(d, "config.json"))
        loaded = LlamaForCausalLM.from_pretrained(d)
        got = loaded.state_dict()
        bad = [k for k in want if not _bits_equal(want[k], got[k])]
        assert not bad, bad
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            assert len(json.load(f)["weight_map"]) == len(want)

    on_rank0(check)


def _tree_without_save_id(d: str) -> dict[str, bytes]:
    """Every file of a checkpoint directory, each save id replaced by zeros (ids are random per save)."""
    from unickpt.spec.index import load_index

    idx = load_index(os.path.join(d, "model.safetensors.index.json"))
    assert idx.unickpt is not None and idx.unickpt.save_id is not None
    sid = idx.unickpt.save_id.encode()
    out = {}
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), "rb") as fh:
            out[f] = fh.read().replace(sid, b"0" * 32)
    return out


def manager_case(layout: str, root: str) -> None:
    """save_hf=True, sync and async (the live tensors change while the background thread writes):
    byte-identical Hugging Face copies, equal to a gathered save_model of the same state."""
    from _pp_zero_hybrid_worker import full_state

    from unickpt import CheckpointManager

    trees = []
    for mode in (False, True):
        s = _setup(layout)
        s.train_step(0)
        exp = full_state(s)
        mroot = os.path.join(root, f"mgr-{layout}-{mode}")
        mgr = CheckpointManager(mroot, booster=s.booster, save_steps=1, async_save=mode, save_hf=True)
        mgr.save(1, s.model, s.optim, force=True)
        if mode:
            with torch.no_grad():
                for p in s.model.parameters():
                    p.add_(100.0)
        mgr.wait()
        hf = os.path.join(mroot, "step-1", "hf")

        def check(hf: str = hf, exp: dict[str, torch.Tensor] = exp) -> None:
            got = _read_all(hf)
            want = {k[len("model/") :]: v for k, v in exp.items() if k.startswith("model/")}
            assert got.keys() <= want.keys(), sorted(got.keys() - want.keys())
            assert all(_bits_equal(got[k], want[k]) for k in got)
            # A tied weight (head.weight of the embedding) is stored once, as Hugging Face does.
            for k in want.keys() - got.keys():
                assert any(_bits_equal(want[k], v) for v in got.values()), f"{k} is missing from hf/"
            # hf/ is model/'s files (every rank copied its share), byte for byte, each its own inode.
            model = os.path.join(os.path.dirname(hf), "model")
            names = sorted(n for n in os.listdir(model) if not n.startswith("."))
            assert sorted(os.listdir(hf)) == names, (os.listdir(hf), names)
            for n in names:
                a, b = os.path.join(model, n), os.path.join(hf, n)
                assert os.stat(a).st_ino != os.stat(b).st_ino, n
                with open(a, "rb") as fa, open(b, "rb") as fb:
                    assert fa.read() == fb.read(), n

        on_rank0(check)
        trees.append(_tree_without_save_id(hf) if dist.get_rank() == 0 else {})
    if dist.get_rank() == 0:
        assert trees[0].keys() == trees[1].keys()
        diff = [k for k in trees[0] if trees[0][k] != trees[1][k]]
        assert not diff, f"async Hugging Face copy differs from the sync one: {diff}"


def async_rows_case(layout: str, root: str) -> dict[str, int]:
    """An async gathered save moves column-sharded tensors to row slices in the foreground: its
    files (index included) are the synchronous save's, while training changes the live tensors."""
    s = _setup(layout)
    s.train_step(0)
    d = os.path.join(root, f"async-{layout}")
    s.booster.save_model(
        s.model, os.path.join(d, "sync"), shard=True, gather_dtensor=True, size_per_shard=TINY_MB
    )
    s.booster.save_model(
        s.model,
        os.path.join(d, "async"),
        shard=True,
        gather_dtensor=True,
        size_per_shard=TINY_MB,
        use_async=True,
    )
    with torch.no_grad():
        for p in s.model.parameters():
            p.add_(100.0)
    s.booster.checkpoint_io.wait()
    info: dict[str, int] = {}

    def check() -> None:
        from unickpt.spec.index import load_index

        a = _tree_without_save_id(os.path.join(d, "sync"))
        b = _tree_without_save_id(os.path.join(d, "async"))
        assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), sorted(
            k for k in a if a.get(k) != b.get(k)
        )
        idx = load_index(os.path.join(d, "async", "model.safetensors.index.json"))
        assert idx.unickpt is not None
        info.update({n: len(t.slices[0].ranges or []) for n, t in idx.unickpt.tensors.items()})

    on_rank0(check)
    return info


def world_worker(root: str, layouts: list[str]) -> Any:
    from harness import run_cases

    cases: list[tuple[str, Any]] = [
        (f"layout {lay}", lambda lay=lay: layout_case(lay, root)) for lay in layouts
    ]
    if "fsdp2x4" in layouts:
        cases.append(("flipped byte", lambda: flipped_byte_case(root)))
    cases.append(("transformers", lambda: transformers_case(root)))
    for lay in ("fsdp2x4", "hyb_fsdp_dp2tp2"):
        if lay in layouts:
            cases.append((f"manager save_hf {lay}", lambda lay=lay: manager_case(lay, root)))
    if "hyb_ddp_dp2tp2" in layouts:
        cases.append(("async rows", lambda: async_rows_case("hyb_ddp_dp2tp2", root)))
    return run_cases(cases)
