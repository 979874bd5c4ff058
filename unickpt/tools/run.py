"""``unickpt inspect``/``verify`` on a ``CheckpointManager`` run directory or one of its steps. No torch.

``inspect RUN`` lists the committed steps; ``inspect RUN/step-N`` summarises the step's model,
optimizer, LR scheduler, train state and Hugging Face copy. ``verify RUN/step-N`` checks every
part: the model, optimizer and ``hf/`` checkpoints slice by slice, and the train-state files and
``lr_scheduler.json`` against the hashes each rank recorded (``train_state/rank-<r>.hashes.json``;
steps saved before those existed are checked for structure only, with a note), and the config
files beside ``model/`` and in ``hf/`` against the ``COMMIT`` record's ``xxh3`` table. ``verify RUN``
checks the latest step, ``all_steps=True`` every committed step.

Runs and steps at a URL (``s3://...``) are read through ``ckpt/run_files.py``: one listing of
the location gives the steps, their sizes and commit times; ``inspect`` then fetches only
indexes and small records, ``verify`` streams every part as on local disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

from unickpt.ckpt import run_layout as rl
from unickpt.ckpt.foreign import foreign_dir
from unickpt.ckpt.run_files import RunFiles
from unickpt.errors import IncompleteCheckpointError, UnickptError
from unickpt.spec.hashing import slice_hash
from unickpt.spec.untrusted import is_plain_name, show
from unickpt.tools._common import human_bytes
from unickpt.tools.inspect import inspect_checkpoint
from unickpt.tools.verify import verify_checkpoint

__all__ = ["PartResult", "inspect_run", "format_run_report", "verify_run", "format_verify_report"]


def _no_commit(path: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"{path} holds no committed checkpoint: it is a CheckpointManager step directory without a "
        f"{rl.COMMIT_NAME} marker (a save that was interrupted, or is still running); it is never loaded"
    )


def _no_steps(path: str, files: RunFiles) -> IncompleteCheckpointError:
    other = foreign_dir(files.listdir(path), lambda n: files.listdir(files.join(path, n)))
    if other is not None:  # a torchtitan folder of step-<N>/ DCP checkpoints
        return IncompleteCheckpointError(f"{path} holds no unickpt checkpoint: {other.hint(path)}")
    return IncompleteCheckpointError(
        f"{path} holds no committed checkpoint: it is a CheckpointManager directory without any committed "
        f"step-<N>/{rl.COMMIT_NAME}"
    )


def _steps_of(files: RunFiles, all_steps: bool) -> list[str]:
    """The step directories a run-level command works on (a step directory: itself)."""
    path = files.root
    if rl.step_of(path, files) is not None:
        if rl.read_commit(path, files) is None:
            raise _no_commit(path)
        return [path]
    steps = rl.committed_steps(path, files)
    if not steps:
        raise _no_steps(path, files)
    if not all_steps:
        latest = rl.latest_step(path, files)
        steps = [latest if latest is not None else steps[-1]]
    return [files.join(path, f"step-{s}") for s in steps]


# ---------------------------------------------------------------------- inspect
def inspect_run(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Plain data: the committed steps of a run directory, or the summary of one step directory
    (a local path or a URL; at a URL, sizes and times come from one listing)."""
    files = RunFiles(path)
    p = files.root
    if rl.step_of(p, files) is not None:
        if rl.read_commit(p, files) is None:
            raise _no_commit(p)
        return _step_summary(p, files)
    steps = rl.committed_steps(p, files)
    if not steps:
        raise _no_steps(p, files)
    rows = []
    for s in steps:
        d = files.join(p, f"step-{s}")
        commit = rl.read_commit(d, files) or {}
        mesh: dict[str, Any] = {}
        with contextlib.suppress(UnickptError, OSError):
            mesh = dict(inspect_checkpoint(files.join(d, "model"), "model")["layout"].get("mesh", {}))
        rows.append(
            {
                "step": s,
                "time": files.mtime_text(files.join(d, rl.COMMIT_NAME)),
                "plugin": commit.get("plugin"),
                "world_size": commit.get("world_size"),
                "mesh": mesh,
                "bytes": files.tree_size(d),
            }
        )
    uncommitted = sorted(
        n
        for n in files.listdir(p)
        if (n.startswith("step-") or n.startswith(".step-")) and n not in {f"step-{s}" for s in steps}
    )
    return {
        "type": "run",
        "path": p,
        "latest": rl.latest_step(p, files),
        "steps": rows,
        "uncommitted": uncommitted,
    }


def _read_json(files: RunFiles, path: str) -> Any:
    return json.loads(files.read_bytes(path))


def _step_summary(step_dir: str, files: RunFiles) -> dict[str, Any]:
    lay = rl.step_layout(step_dir, files)
    out: dict[str, Any] = {
        "type": "step",
        "path": lay.path,
        "step": lay.step,
        "time": files.mtime_text(files.join(lay.path, rl.COMMIT_NAME)),
        "plugin": lay.commit.get("plugin"),
        "world_size": lay.commit.get("world_size"),
        "bytes": files.tree_size(lay.path),
    }
    for part, sub, kind in (
        ("model", lay.model, "model"),
        ("optimizer", lay.optimizer, "optimizer"),
        ("hf", lay.hf, "model"),
    ):
        if sub is None:
            out[part] = None
            continue
        try:
            info = inspect_checkpoint(sub, kind)
        except (UnickptError, OSError) as e:
            out[part] = {"error": str(e)}
            continue
        tot = info["totals"]
        entry: dict[str, Any] = {
            "tensors": tot["tensors"],
            "bytes": tot["bytes"],
            "slices": tot["slices"],
            "hashed_slices": tot["hashed_slices"],
            "layout": info["layout"],
        }
        if kind == "optimizer":
            entry["params_with_state"] = len(
                {t["param"] for t in info["tensors"].values() if t.get("param")}
                | set(info.get("param_state", {}))
            )
            entry["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} | {"params": len(g.get("params", []))}
                for g in info.get("param_groups") or []
            ]
        out[part] = entry
    out["lr_scheduler"] = None
    if lay.scheduler is not None:
        try:
            obj = _read_json(files, lay.scheduler)
            state = obj.get("state", {}) if isinstance(obj, dict) else {}
            out["lr_scheduler"] = {
                k: state[k] for k in ("last_epoch", "_step_count", "_last_lr", "base_lrs") if k in state
            }
        except (OSError, ValueError, AttributeError) as e:
            out["lr_scheduler"] = {"error": f"unreadable: {e}"}
    ranks = sorted(lay.train_state)
    ts: dict[str, Any] = {"ranks": ranks, "hashed_ranks": sorted(lay.hash_files)}
    if ranks:
        first = next((f for f in lay.train_state[ranks[0]] if f.endswith(".json")), None)
        if first is not None:
            try:
                js = _read_json(files, first)
                ts["step"] = js.get("step")
                ts["world_size"] = js.get("world_size")
                ts["dataloader"] = "dataloader" in js
                ts["extra"] = sorted(js.get("extra", {}))
            except (OSError, ValueError, AttributeError) as e:
                ts["error"] = f"unreadable: {e}"
    out["train_state"] = ts
    return out


def format_run_report(info: dict[str, Any]) -> str:
    """Readable text for :func:`inspect_run`'s result."""
    if info["type"] == "run":
        lines = [
            f"run        : {info['path']}",
            f"committed  : {len(info['steps'])} step(s); latest (resumed by CheckpointManager.load): "
            f"step {info['latest']}",
        ]
        if info["uncommitted"]:
            lines.append(f"uncommitted: {', '.join(info['uncommitted'])} (never loaded)")
        rows = [("step", "committed at", "layout", "size")]
        for r in info["steps"]:
            mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
            layout = f"{r['plugin']} world_size={r['world_size']}" + (f" mesh={mesh}" if mesh else "")
            mark = " *" if r["step"] == info["latest"] else ""
            rows.append((f"{r['step']}{mark}", r["time"], layout, human_bytes(r["bytes"])))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines.append("")
        for i, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)
    lines = [
        f"step       : {info['step']}   ({info['path']})",
        f"committed  : {info['time']}   plugin={info['plugin']} world_size={info['world_size']}   "
        f"{human_bytes(info['bytes'])} on disk",
    ]
    for part, label in (("model", "model      "), ("optimizer", "optimizer  "), ("hf", "hf copy    ")):
        e = info[part]
        if e is None:
            lines.append(f"{label}: -")
        elif "error" in e:
            lines.append(f"{label}: unreadable: {e['error']}")
        else:
            lay = e["layout"]
            text = (
                f"{e['tensors']} tensors, {human_bytes(e['bytes'])}, {e['slices']} slices "
                f"({e['hashed_slices']} hashed), {'gathered' if lay.get('gathered', True) else 'sliced'} "
                f"by {lay['plugin']} x{lay['world_size']}"
            )
            if part == "optimizer":
                text += f"; state for {e['params_with_state']} params"
            lines.append(f"{label}: {text}")
            if part == "optimizer":
                for i, g in enumerate(e["param_groups"]):
                    hp = ", ".join(f"{k}={v}" for k, v in g.items() if k != "params")
                    lines.append(f"             group {i}: {g['params']} params; {hp}")
    sched = info["lr_scheduler"]
    lines.append(
        "scheduler  : "
        + ("-" if sched is None else ", ".join(f"{k}={v}" for k, v in sched.items()) or "(empty state)")
    )
    ts = info["train_state"]
    hashed = "hashed" if ts["ranks"] and ts["hashed_ranks"] == ts["ranks"] else "not hashed (older save)"
    text = f"{len(ts['ranks'])} rank file(s), {hashed}"
    if "step" in ts:
        text += (
            f"; step={ts['step']} world_size={ts['world_size']} "
            f"dataloader={'yes' if ts['dataloader'] else 'no'} extra={ts['extra'] or '-'}"
        )
    if "error" in ts:
        text += f"; {ts['error']}"
    lines.append(f"train state: {text}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- verify
@dataclasses.dataclass
class PartResult:
    """What ``verify`` found for one part of one step."""

    step: int
    part: str  # "model", "optimizer", "hf", "train_state"
    checked: str  # what was checked, for the report
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def verify_run(
    path: str | os.PathLike[str], *, all_steps: bool = False, require_hashes: bool = False
) -> list[PartResult]:
    """Verify a step directory, or the latest (``all_steps``: every) committed step of a run.

    Returns one result per part; a part whose bytes do not match their hashes, whose files are
    missing or unreadable, has failures. ``require_hashes`` also fails data without hashes.
    Raises ``IncompleteCheckpointError`` when there is no committed step.
    """
    files = RunFiles(path)
    out: list[PartResult] = []
    for d in _steps_of(files, all_steps):
        out.extend(_verify_step(d, require_hashes, files))
    return out


def _verify_step(step_dir: str, require_hashes: bool, files: RunFiles) -> list[PartResult]:
    lay = rl.step_layout(step_dir, files)
    results = []
    for part, sub, kind in (
        ("model", lay.model, "model"),
        ("optimizer", lay.optimizer, "optimizer"),
        ("hf", lay.hf, "model"),
    ):
        if sub is None:
            if part == "model":
                results.append(
                    PartResult(lay.step, part, "-", [f"{files.join(lay.path, 'model')} is missing"])
                )
            continue
        res = PartResult(lay.step, part, "")
        try:
            info = inspect_checkpoint(sub, kind)
            tot = info["totals"]
            unhashed = tot["slices"] - tot["hashed_slices"]
            res.checked = f"{tot['tensors']} tensors, {tot['hashed_slices']} slice(s) rehashed"
            res.failures.extend(str(f) for f in verify_checkpoint(sub, kind=kind))
            if unhashed:
                msg = f"{unhashed} slice(s) carry no hash: structure checked only"
                (res.failures if require_hashes else res.notes).append(msg)
        except (UnickptError, OSError) as e:
            res.failures.append(f"{sub}: {e}")
        results.append(res)
    ts = _verify_train_state(lay, require_hashes, files)
    if not lay.commit:
        ts.failures.append(f"{files.join(lay.path, rl.COMMIT_NAME)}: unreadable (not a JSON object)")
    results.append(ts)
    _verify_side_files(lay, files, results, require_hashes)
    return results


def _verify_side_files(
    lay: rl.StepLayout, files: RunFiles, results: list[PartResult], require_hashes: bool
) -> None:
    """``config.json``/``generation_config.json`` beside ``model/`` and in ``hf/`` (and
    ``lr_scheduler.json`` when no train-state hashes file covers it) against the ``COMMIT``
    record's ``xxh3`` table; steps committed before it existed: a structure check."""
    parts = {r.part: r for r in results}
    ts = parts["train_state"]
    try:
        table = rl.commit_hashes(lay.commit)
    except ValueError as e:
        ts.failures.append(f"{files.join(lay.path, rl.COMMIT_NAME)}: {e}")
        table = {}
    present = [
        f"{d}/{n}"
        for d in ("model", rl.HF_DIR)
        for n in rl.SIDE_FILE_NAMES
        if files.is_file(files.join(lay.path, d, n))
    ]
    rehashed: dict[str, int] = {}
    for rel, digest in sorted((table or {}).items()):
        res = parts.get(rel.split("/")[0], ts)
        if not _safe_rel(rel):
            ts.failures.append(f"{rl.COMMIT_NAME}: refuses to check {show(rel)} (not a path inside the step)")
            continue
        if rel == rl.SCHEDULER_NAME and 0 in lay.hash_files:
            continue  # rehashed with the train state
        problem = _rehash(files, lay.path, rel, digest)
        if problem:
            res.failures.append(problem)
        else:
            rehashed[res.part] = rehashed.get(res.part, 0) + 1
    for part, n in rehashed.items():
        parts[part].checked += f", {n} side file(s) rehashed"
    unhashed = [rel for rel in present if rel not in (table or {})]
    for rel in unhashed:
        res = parts.get(rel.split("/")[0], ts)
        full = files.join(lay.path, *rel.split("/"))
        try:
            ok = isinstance(_read_json(files, full), dict)
        except (OSError, ValueError) as e:
            res.failures.append(f"{full}: unreadable ({e})")
            continue
        if not ok:
            res.failures.append(f"{full}: not a JSON object")
    if unhashed:
        msg = (
            f"{', '.join(unhashed)}: no hash in {rl.COMMIT_NAME} (committed before unickpt hashed "
            "side files): structure checked only"
        )
        (ts.failures if require_hashes else ts.notes).append(msg)


def _rehash(files: RunFiles, step_dir: str, rel: str, digest: str) -> str | None:
    """Why the file ``rel`` of a step does not match its recorded xxh3-64, or ``None``."""
    full = files.join(step_dir, *rel.split("/"))
    try:
        found = slice_hash(files.read_bytes(full))
    except OSError as e:
        shown = full if len(full) <= 300 else f"{full[:297]}..."  # a name from a file: any length
        return f"{shown}: cannot be read ({e.strerror or e})"
    return None if found == digest else f"{full}: expected xxh3-64 {digest}, found {found}"


def _safe_rel(rel: str) -> bool:
    """A path inside the step that a ``COMMIT`` record or a hashes file names: plain names
    (``spec.untrusted.is_plain_name``) joined by ``/``."""
    return isinstance(rel, str) and all(is_plain_name(p) for p in rel.split("/"))


_FEW_HASHED = 16  # entries of a hashes file checked without counting the step's files first
_NAMED_MISSING = 8  # ranks without train state named one by one (the rest are counted)


def _ranks(lay: rl.StepLayout, res: PartResult) -> list[int]:
    """The ranks whose train state is checked: those below the COMMIT's ``world_size`` that have
    files, and the first few without (their files are reported missing); a ``world_size`` past
    them is counted in one failure, never listed rank by rank (it is a number in a file)."""
    world = lay.commit.get("world_size")
    present = set(lay.train_state) | set(lay.hash_files)
    if type(world) is not int or world <= 0:
        return sorted(lay.train_state)
    ranks = sorted(r for r in present if r < world)
    missing: list[int] = []
    for r in range(min(world, len(present) + _NAMED_MISSING)):  # the first few without files
        if r not in present and len(missing) < _NAMED_MISSING:
            missing.append(r)
    absent = world - len(ranks)
    if absent > len(missing):
        res.failures.append(
            f"{lay.path}/{rl.COMMIT_NAME}: world_size {world}, but {absent} rank(s) have no train state "
            f"(rank-{missing[0]:05d} first; only {len(present)} rank(s) have files)"
        )
    return sorted(ranks + missing)


def _verify_train_state(lay: rl.StepLayout, require_hashes: bool, files: RunFiles) -> PartResult:
    res = PartResult(lay.step, "train_state", "")
    ranks = _ranks(lay, res)
    hashed: dict[str, str] = {}  # relative path -> expected xxh3
    in_step: int | None = None  # files below the step, counted when a hashes file is large
    for r in ranks:
        base = f"{rl.TRAIN_STATE_DIR}/rank-{r:05d}"
        wanted = [base + ".json", base + ".safetensors"]
        hpath = lay.hash_files.get(r)
        if hpath is None:
            continue
        try:
            table = rl.read_hashes(hpath, files)
        except (OSError, ValueError) as e:
            res.failures.append(f"{hpath}: unreadable hashes file ({e})")
            continue
        if len(table) > _FEW_HASHED:  # a rank hashes its 2 files (rank 0: and lr_scheduler.json)
            in_step = files.file_count(lay.path) if in_step is None else in_step
            if len(table) > in_step:
                res.failures.append(
                    f"{hpath}: 'xxh3' lists {len(table)} paths, but the step holds {in_step} files"
                )
                continue
        for rel, digest in table.items():
            if not _safe_rel(rel):
                res.failures.append(f"{hpath}: refuses to check {show(rel)} (not a path inside the step)")
                continue
            hashed[rel] = digest
        for w in wanted:
            if w not in table:
                res.failures.append(f"{hpath}: does not list {w}")
    n_ok = 0
    for rel, digest in sorted(hashed.items()):
        problem = _rehash(files, lay.path, rel, digest)
        if problem:
            res.failures.append(problem)
        else:
            n_ok += 1
    unhashed = []
    for r in ranks:
        base = f"{rl.TRAIN_STATE_DIR}/rank-{r:05d}"
        for rel in (base + ".json", base + ".safetensors"):
            if rel not in hashed:
                unhashed.append(rel)
    if lay.scheduler is not None and rl.SCHEDULER_NAME not in hashed:
        unhashed.append(rl.SCHEDULER_NAME)
    for rel in unhashed:
        full = files.join(lay.path, *rel.split("/"))
        problem = _structure_problem(files, full)
        if problem:
            res.failures.append(f"{full}: {problem}")
    if unhashed:
        msg = (
            f"{len(unhashed)} file(s) carry no hash (saved before unickpt hashed train state): "
            "structure checked only"
        )
        (res.failures if require_hashes else res.notes).append(msg)
    res.checked = f"{len(ranks)} rank(s), {n_ok} file(s) rehashed"
    return res


def _structure_problem(files: RunFiles, path: str) -> str | None:
    """Why an unhashed train-state or scheduler file is unusable, or ``None``."""
    if not files.is_file(path):
        return "is missing"
    try:
        if path.endswith(".safetensors"):
            files.read_header(path)
            return None
        obj = _read_json(files, path)
    except (OSError, ValueError, UnickptError) as e:
        return f"unreadable ({e})"
    key = "state" if os.path.basename(path) == rl.SCHEDULER_NAME else "unickpt_train_state"
    if not isinstance(obj, dict) or key not in obj:
        return f"not a unickpt file (no {key!r} key)"
    return None


def format_verify_report(results: list[PartResult]) -> tuple[str, str]:
    """``(stdout text, stderr text)`` for :func:`verify_run`'s results."""
    ok_lines: list[str] = []
    bad_lines: list[str] = []
    for r in results:
        status = "FAILED" if r.failures else "OK"
        ok_lines.append(f"step {r.step} {r.part:<11}: {status:<6} {r.checked}")
        ok_lines.extend(f"    note: {n}" for n in r.notes)
        bad_lines.extend(f"  step {r.step} {r.part}: {f}" for f in r.failures)
    return "\n".join(ok_lines), "\n".join(bad_lines)
