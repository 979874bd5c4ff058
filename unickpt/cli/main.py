"""``unickpt``: inspect, verify, diff, merge, convert and upgrade checkpoints from the command line.

Exit codes (every subcommand): 0 success / identical; 1 the checkpoint is damaged or the
two checkpoints differ; 2 unusable input (not a checkpoint, malformed index, hostile
header, bad arguments); 3 an unexpected internal error (a bug). Failures print one message
on stderr, never a traceback (``UNICKPT_TRACEBACK=1`` re-raises internal errors).

Start-up stays fast: ``inspect``, ``verify`` and ``diff`` never import torch; ``merge``
imports it only for ``--dtype`` and ``convert`` only to read or write DCP, ``.bin`` and
Colossal-AI or DeepSpeed files; nothing imports ``torch.distributed`` except ``convert`` from or to DCP.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence

from unickpt import __version__
from unickpt.cli.storage_opts import add_storage_option, storage_options_applied
from unickpt.errors import IntegrityError, UnickptError

__all__ = ["main", "build_parser"]

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_UNUSABLE = 2
EXIT_INTERNAL = 3

_EPILOG = (
    "exit codes: 0 ok/identical, 1 integrity failures or differences, 2 unusable input, "
    "3 internal error (a bug in unickpt: please report it)"
)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from unickpt.ckpt.run_layout import looks_like_run
    from unickpt.tools.inspect import format_report, inspect_checkpoint

    if looks_like_run(args.path):  # a CheckpointManager run directory or one of its steps
        from unickpt.tools.run import format_run_report, inspect_run

        run_info = inspect_run(args.path)
        print(json.dumps(run_info, indent=2) if args.json else format_run_report(run_info))
        return EXIT_OK
    info = inspect_checkpoint(args.path, kind=args.kind, slices=args.json or args.slices)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_report(info, verbose=args.slices))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from unickpt.ckpt.run_layout import looks_like_run
    from unickpt.tools.verify import verify_checkpoint

    if looks_like_run(args.path):  # a CheckpointManager run directory or one of its steps
        return _verify_run(args)
    report = verify_checkpoint(
        args.path, kind=args.kind, progress=not (args.quiet or args.json), require_hashes=args.require_hashes
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return EXIT_FAIL if report else EXIT_OK
    if report:
        print(f"FAILED: {args.path}: {len(report)} integrity failure(s):", file=sys.stderr)
        for f in report[:50]:
            print(f"  {f}", file=sys.stderr)
        if len(report) > 50:
            print(f"  ... and {len(report) - 50} more", file=sys.stderr)
        print(f"checked: {report.summary()}", file=sys.stderr)
        return EXIT_FAIL
    if not args.quiet:
        print(f"OK: {args.path}: {report.summary()}")
    return EXIT_OK


def _verify_run(args: argparse.Namespace) -> int:
    from unickpt.tools.run import format_verify_report, verify_run

    results = verify_run(
        args.path, all_steps=args.all, require_hashes=bool(getattr(args, "require_hashes", False))
    )
    if args.json:
        import dataclasses

        parts = [dataclasses.asdict(r) for r in results]
        ok = not any(r.failures for r in results)
        print(json.dumps({"path": args.path, "ok": ok, "parts": parts}, indent=2))
        return EXIT_OK if ok else EXIT_FAIL
    text, bad = format_verify_report(results)
    if not args.quiet:
        print(text)
    if bad:
        print(f"FAILED: {args.path}: damaged or missing data:", file=sys.stderr)
        print(bad, file=sys.stderr)
        return EXIT_FAIL
    if not args.quiet:
        steps = sorted({r.step for r in results})
        print(f"OK: {args.path}: step(s) {', '.join(map(str, steps))}: every part checked, no damage found")
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    from unickpt.tools.diff import diff_checkpoints

    report = diff_checkpoints(
        args.a, args.b, deep=args.deep, kind=args.kind, progress=not args.quiet, index_only=args.index_only
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format())
    return report.exit_code


def _cmd_merge(args: argparse.Namespace) -> int:
    from unickpt.tools.merge import merge_checkpoint

    out = merge_checkpoint(
        args.src,
        args.out,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        verify=not args.no_verify,
        optimizer=args.optimizer,
        progress=not args.quiet,
        merge_adapters=args.merge_adapters,
        adapter_config=args.adapter_config,
        hub_names=False if args.stored_names else None,
    )
    if not args.quiet:
        print(f"merged {args.src} -> {out}")
    return EXIT_OK


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from unickpt.tools.upgrade import upgrade_checkpoint

    report = upgrade_checkpoint(args.src, args.dst)
    if not args.quiet:
        print(report.format())
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from unickpt.tools.convert import convert_checkpoint

    source = args.source or ("unickpt" if args.target in ("dcp", "colossalai", "deepspeed") else None)
    if source is None:  # told from what the source path holds (ckpt/foreign.py's rules)
        from unickpt.tools.detect import detect_source

        source = detect_source(args.src)
    out = convert_checkpoint(
        args.src,
        args.out,
        source=source,
        target=args.target,
        max_shard_size=args.max_shard_size,
        strip_prefix=args.strip_prefix,
        step=args.step,
        model=args.model,
        progress=not args.quiet,
    )
    if not args.quiet:
        print(f"converted {args.src} ({source}) -> {out} ({args.target})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unickpt",
        description="Inspect, verify, diff, merge and convert unickpt checkpoints (no GPU or process group needed).",
        epilog=_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"unickpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def kind_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--kind",
            choices=("model", "optimizer"),
            default=None,
            help="which checkpoint in the directory (default: the model one if present, else the optimizer one)",
        )

    sp = sub.add_parser(
        "inspect",
        help="list every tensor: dtype, shape, bytes, files, slices, hashes, fingerprint; totals; layout",
        description="Describe a checkpoint from its index (and headers) without reading tensor data.",
        epilog=_EPILOG,
    )
    sp.add_argument(
        "path",
        help="checkpoint directory, *.index.json file, single .safetensors file, or a CheckpointManager "
        "run directory or step-<N> directory",
    )
    sp.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    sp.add_argument(
        "--slices", action="store_true", help="table: also list every slice (key, file, offsets, hash)"
    )
    kind_arg(sp)
    sp.set_defaults(func=_cmd_inspect)

    sp = sub.add_parser(
        "verify",
        help="validate the structure and rehash every stored slice",
        description=(
            "Validate the index (schema, safe file names, exact coverage, weight_map against the unickpt "
            "block, no slice named twice) and every data file header (every key accounted for), then "
            "rehash every stored slice (xxh3-64) and recompute every fingerprint from the data. Says what "
            "was checked (slices rehashed, slices without a hash, fingerprints recomputed). Exit 0 when "
            "all match, 1 naming each bad tensor and file (or unhashed slices under --require-hashes), "
            "2 when the input is not a usable checkpoint."
        ),
        epilog=_EPILOG,
    )
    sp.add_argument(
        "path",
        help="checkpoint directory, *.index.json file, single .safetensors file, or a CheckpointManager "
        "run directory (its latest step) or step-<N> directory (every part of it)",
    )
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no OK line")
    sp.add_argument(
        "--json",
        action="store_true",
        help="machine-readable JSON report on stdout (what was checked, every failure); same exit codes",
    )
    sp.add_argument(
        "--require-hashes",
        action="store_true",
        help="a slice without a recorded hash is a failure (exit 1), e.g. a plain Hugging Face checkpoint",
    )
    sp.add_argument(
        "--all",
        action="store_true",
        help="on a CheckpointManager run directory: verify every committed step, not only the latest",
    )
    kind_arg(sp)
    sp.set_defaults(func=_cmd_verify)

    sp = sub.add_parser(
        "diff",
        help="compare two checkpoints by fingerprint, across parallelisms, from their indexes",
        description=(
            "Compare checkpoints A and B tensor by tensor using the layout-invariant fingerprints in "
            "their indexes. Tied names are resolved through aliases. A tensor one side records no "
            "comparable fingerprint for (a plain Hugging Face checkpoint, another fingerprint "
            "version, tied under another name) gets it computed from that side's data, slice hashes "
            "checked on the way (--index-only: reported as undetermined instead, and no data file is "
            "read). --deep reads all the data: rehashes slices, checks the recorded fingerprints and "
            "compares the tensors element by element (first differing index and count). Exit 0 "
            "identical, 1 different, 2 unusable input or nothing to compare with."
        ),
        epilog=_EPILOG,
    )
    sp.add_argument("a", help="first checkpoint")
    sp.add_argument("b", help="second checkpoint")
    sp.add_argument("--json", action="store_true", help="machine-readable JSON report on stdout")
    sp.add_argument(
        "--deep",
        action="store_true",
        help="also read the data: rehash slices, check fingerprints, compare the tensors element by element",
    )
    sp.add_argument(
        "--index-only",
        action="store_true",
        help="read no data file: tensors without comparable fingerprints are reported as undetermined",
    )
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    kind_arg(sp)
    sp.set_defaults(func=_cmd_diff)

    sp = sub.add_parser(
        "merge",
        help="rebuild full tensors from the slices and write a plain Hugging Face checkpoint",
        description=(
            "Merge a checkpoint of any layout (DDP, FSDP2, TP, ZeRO, hybrid ...) into a plain Hugging "
            "Face checkpoint (model.safetensors, or shards + model.safetensors.index.json), streaming "
            "one tensor at a time. Every slice hash is checked while reading; fingerprints are "
            "carried over so `unickpt diff` still matches. OUT is written under a temporary name and "
            "renamed when complete."
        ),
        epilog=_EPILOG,
    )
    sp.add_argument("src", help="checkpoint to merge (directory or index file)")
    sp.add_argument(
        "out",
        help="output directory (must not exist, or be empty), or a URL holding nothing (files streamed, "
        "the index or single file written last)",
    )
    sp.add_argument(
        "--max-shard-size", default="5GB", help='largest output file, e.g. "5GB", "500MB" (default: 5GB)'
    )
    sp.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="cast floating-point tensors"
    )
    sp.add_argument("--no-verify", action="store_true", help="skip checking slice hashes while reading")
    sp.add_argument("--optimizer", action="store_true", help="also merge the optimizer checkpoint in SRC")
    sp.add_argument(
        "--merge-adapters",
        action="store_true",
        help="SRC is a PeftModel's LoRA run: merge the adapters into the base weights (W + scale * B@A, "
        "as peft's merge_and_unload) and write the base architecture's names",
    )
    sp.add_argument(
        "--adapter-config",
        default=None,
        metavar="PATH",
        help="with --merge-adapters: the adapter_config.json to use when SRC has none",
    )
    sp.add_argument(
        "--stored-names",
        action="store_true",
        help="write the names as stored, even where config.json's transformers architecture maps "
        "them (by default fused MoE experts are written per expert, as on the Hub)",
    )
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=_cmd_merge)

    sp = sub.add_parser(
        "convert",
        help="import DCP / torchtitan / Colossal-AI / DeepSpeed / .bin checkpoints, or export to DCP, Colossal-AI or DeepSpeed",
        description=(
            "Bring checkpoints in: --from dcp reads a PyTorch Distributed Checkpoint directory "
            "(.metadata + __N_M.distcp, or a torchtitan folder of step-N/: the latest step). A training "
            "checkpoint (dcp.save of get_state_dict(model, optimizer) as {'model', 'optim'}, or "
            "torchtitan's layout) becomes a model checkpoint, an optimizer checkpoint with its "
            "param_groups and lr_scheduler.json in OUT; --to run writes OUT as a CheckpointManager "
            "directory (OUT/step-N, resumable with manager.load). --from bin reads pytorch_model*.bin "
            "shards; --from colossalai reads a Colossal-AI sharded optimizer checkpoint "
            "(pytorch_optim.bin.index.json), mapping parameter ids to names with --model; --from deepspeed "
            "reads a DeepSpeed ZeRO stage 1/2/3 checkpoint (latest + global_stepN/): fp32 master weights, "
            "Adam moments and param groups (--to run as for dcp, step = the engine's global_steps). "
            "Take checkpoints out: --to dcp writes the unickpt checkpoint SRC (model, optimizer, "
            "scheduler of a manager step) as DCP for torch.distributed.checkpoint.load / torchtitan; "
            "--to colossalai as Colossal-AI's load_model / load_optimizer read it; --to deepspeed as a "
            "DeepSpeed universal checkpoint (latest_universal + global_stepN_universal/) that an engine "
            "with load_universal resumes from at any world size (ZeRO 1/2). "
            "Nothing is unpickled except through restricted unpicklers: DCP .metadata with an "
            "allowlist of DCP's own classes, every other pickle with torch.load(weights_only=True)."
        ),
        epilog=_EPILOG,
    )
    sp.add_argument(
        "--from",
        dest="source",
        choices=("dcp", "bin", "colossalai", "deepspeed", "unickpt"),
        default=None,
        help="source format (default: told from SRC; with --to dcp, colossalai or deepspeed: unickpt)",
    )
    sp.add_argument(
        "--to",
        dest="target",
        choices=("unickpt", "hf", "run", "dcp", "colossalai", "deepspeed"),
        default="unickpt",
        help="output: unickpt (default) or hf (the same files), run (a CheckpointManager directory), "
        "dcp, colossalai or deepspeed (from a unickpt checkpoint: what dcp.load, Colossal-AI's load_model "
        "and load_optimizer, or a DeepSpeed engine with load_universal read)",
    )
    sp.add_argument(
        "src",
        help="source directory (or a single .bin / .safetensors file); a URL for --from dcp / bin "
        "(downloaded to a temporary directory first) or a unickpt checkpoint (read in place)",
    )
    sp.add_argument(
        "out",
        help="output directory (must not exist, or be empty), or a URL holding nothing (written locally, "
        "then uploaded with the index or .metadata last; not for --to run)",
    )
    sp.add_argument("--max-shard-size", default="5GB", help="largest output file (default: 5GB)")
    sp.add_argument(
        "--strip-prefix",
        default=None,
        help='model tensors only: keep names starting with this prefix, without it (e.g. "model."); '
        "without it a DCP training checkpoint is recognised and imported whole",
    )
    sp.add_argument(
        "--step",
        type=int,
        default=None,
        help="--to run: the step number (default: the checkpoint's train_state.step); --to deepspeed: "
        "the engine's global_steps (default: the manager step, else the optimizer's step count)",
    )
    sp.add_argument(
        "--model",
        default=None,
        help="--from colossalai: the model checkpoint directory whose parameter order gives the ids' names "
        "(default: the model/ directory beside SRC)",
    )
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=_cmd_convert)

    sp = sub.add_parser(
        "upgrade",
        help="convert a checkpoint of format version 1 to 4 to version 5, the one unickpt reads",
        description=(
            "Convert the checkpoint(s) in SRC (a directory's model and optimizer checkpoints, an "
            "index file, or a single .safetensors file) from a draft format version (1 to 4) to "
            "version 5. The data files are kept as they are; the new index is written last, atomically "
            "(in place: renamed over the old one, so a killed upgrade leaves the old checkpoint, which "
            "upgrade reads again). Version 1 fingerprints are recomputed from the data, after checking "
            "it against the recorded hashes. With DST, SRC is copied into DST (a new directory, or a "
            "new file for a file SRC) and left untouched."
        ),
        epilog=_EPILOG,
    )
    sp.add_argument("src", help="checkpoint directory, index file or single .safetensors file")
    sp.add_argument("dst", nargs="?", default=None, help="write the upgraded copy here instead of in place")
    sp.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    sp.set_defaults(func=_cmd_upgrade)
    for command in sub.choices.values():
        add_storage_option(command)
    return p


def _printable_streams() -> None:
    """Names from a checkpoint are printed as they are; a character the terminal's encoding
    cannot show (or a lone surrogate in a file name) is escaped instead of crashing the print."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):  # a stream that cannot change: leave it
                reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    _printable_streams()
    try:
        with storage_options_applied(args):
            return func(args)
    except IntegrityError as e:
        print(f"unickpt {args.command}: integrity failure: {e}", file=sys.stderr)
        return EXIT_FAIL
    except UnickptError as e:
        print(f"unickpt {args.command}: error: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except OSError as e:
        print(f"unickpt {args.command}: error: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        print(f"unickpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: one line and a distinct code, never a traceback (unless asked)
        if os.environ.get("UNICKPT_TRACEBACK"):
            raise
        what = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        print(
            f"unickpt {args.command}: internal error ({what}); this is a bug in unickpt, please report it "
            "(set UNICKPT_TRACEBACK=1 to see the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
