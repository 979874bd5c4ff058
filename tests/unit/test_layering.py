"""The dependency arrows of docs/architecture.md, enforced.

booster -> plugins -> io -> format -> errors;  cli -> tools -> format.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "unickpt"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


MODULES = {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}

# layer -> unickpt packages it must never import
FORBIDDEN = {
    "unickpt.format": [
        "unickpt.io",
        "unickpt.plugins",
        "unickpt.booster",
        "unickpt.manager",
        "unickpt.tools",
        "unickpt.cli",
        "torch",
    ],
    "unickpt.io": ["unickpt.plugins", "unickpt.booster", "unickpt.manager", "unickpt.tools", "unickpt.cli"],
    "unickpt.plugins": ["unickpt.booster", "unickpt.manager", "unickpt.tools", "unickpt.cli"],
    "unickpt.tools": ["unickpt.plugins", "unickpt.booster", "unickpt.manager", "unickpt.cli"],
    "unickpt.errors": ["unickpt.", "torch"],
}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_does_not_import_upwards(layer: str) -> None:
    bad = []
    for mod, imports in MODULES.items():
        if mod != layer and not mod.startswith(layer + "."):
            continue
        for imp in imports:
            for forbidden in FORBIDDEN[layer]:
                if imp == forbidden.rstrip(".") or imp.startswith(
                    forbidden if forbidden.endswith(".") else forbidden + "."
                ):
                    if forbidden == "unickpt." and imp == "unickpt.errors":
                        continue
                    bad.append(f"{mod} imports {imp}")
    assert not bad, "\n".join(bad)


def test_plugins_do_not_import_each_other() -> None:
    shared = {"unickpt.plugins", "unickpt.plugins.base"}
    bad = []
    for mod, imports in MODULES.items():
        if not mod.startswith("unickpt.plugins.") or mod.split(".")[-1].startswith("_"):
            continue
        for imp in imports:
            if (
                imp.startswith("unickpt.plugins.")
                and imp not in shared
                and not imp.split(".")[-1].startswith("_")
            ):
                bad.append(f"{mod} imports {imp}")
    assert not bad, "\n".join(bad)


def test_format_layer_runs_without_torch() -> None:
    code = (
        "import sys, unickpt.format.reader, unickpt.format.index, unickpt.format.hashing, "
        "unickpt.format.safetensors_io, unickpt.format.boxes, unickpt.format.commit\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_unickpt_is_light() -> None:
    code = "import sys, unickpt\nassert 'torch' not in sys.modules\nprint(unickpt.__version__)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_surface_is_deliberate() -> None:
    import unickpt

    assert sorted(unickpt.__all__) == sorted(
        [
            "__version__",
            "Booster",
            "CheckpointIO",
            "GeneralCheckpointIO",
            "LoadReport",
            "ModelWrapper",
            "OptimizerWrapper",
            "CheckpointManager",
            "merge_checkpoint",
            "diff_checkpoints",
            "verify_checkpoint",
            "UnickptError",
            "CheckpointFormatError",
            "IndexFileError",
            "HeaderError",
            "UnsafePathError",
            "IncompleteCheckpointError",
            "IntegrityError",
            "StateMismatchError",
            "UnsupportedError",
            "DistributedError",
            "CheckpointBusyError",
            "CheckpointChangedError",
            "OutputExistsError",
            "ConfigError",
        ]
    )
    for name in unickpt.__all__:
        assert getattr(unickpt, name) is not None, name
