"""The dependency arrows of docs/architecture.md, enforced.

booster -> plugins -> io -> ckpt -> store -> spec -> errors;  cli -> tools -> ckpt;
io, manager, booster -> _dist -> errors (the object collectives, shared; never spec, store, ckpt or tools).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[3] / "unickpt"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (lazy imports count too).

    ``from package import name`` records ``package`` and, when ``name`` is a submodule,
    ``package.name`` (``from unickpt.plugins import _mesh`` imports ``unickpt.plugins._mesh``);
    relative imports are resolved against ``module``.
    """
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in PATHS)
    return out


PATHS = {_module_name(p): p for p in PKG.rglob("*.py")}
MODULES = {mod: _imports(path, mod) for mod, path in PATHS.items()}

# layer -> unickpt packages it must never import
FORBIDDEN = {
    # spec (what the files are) <- store (where bytes live, publishing) <- ckpt (a checkpoint over a
    # store): no torch, arrows down only.
    "unickpt.spec": [
        "unickpt.store",
        "unickpt.ckpt",
        "unickpt.io",
        "unickpt.plugins",
        "unickpt.booster",
        "unickpt.manager",
        "unickpt.tools",
        "unickpt.cli",
        "unickpt._dist",
        "torch",
    ],
    "unickpt.store": [
        "unickpt.ckpt",
        "unickpt.io",
        "unickpt.plugins",
        "unickpt.booster",
        "unickpt.manager",
        "unickpt.tools",
        "unickpt.cli",
        "unickpt._dist",
        "torch",
    ],
    "unickpt.ckpt": [
        "unickpt.io",
        "unickpt.plugins",
        "unickpt.booster",
        "unickpt.manager",
        "unickpt.tools",
        "unickpt.cli",
        "unickpt._dist",
        "torch",
    ],
    "unickpt.io": ["unickpt.plugins", "unickpt.booster", "unickpt.manager", "unickpt.tools", "unickpt.cli"],
    "unickpt.plugins": ["unickpt.booster", "unickpt.manager", "unickpt.tools", "unickpt.cli"],
    "unickpt.tools": [
        "unickpt.plugins",
        "unickpt.booster",
        "unickpt.manager",
        "unickpt.cli",
        "unickpt._dist",
    ],
    "unickpt.errors": ["unickpt.", "torch"],
    # The shared collectives know only the errors: every layer that runs collectives may use them.
    "unickpt._dist": ["unickpt."],
    # The manager duck-types the booster and never names a plugin; the booster never the manager.
    "unickpt.manager": ["unickpt.booster", "unickpt.plugins", "unickpt.cli"],
    "unickpt.booster": ["unickpt.manager", "unickpt.tools", "unickpt.cli"],
    # The trainer integrations sit on top, on the public modules only (never the format layer,
    # the collectives or a plugin's internals); a trainer's checkpoint of several parts and its
    # small files are published through the store's one protocol (store.publish).
    "unickpt.integrations": [
        "unickpt.spec",
        "unickpt.ckpt",
        "unickpt._dist",
        "unickpt.plugins._shared",
        "unickpt.cli",
    ],
}


def test_nothing_imports_the_integrations() -> None:
    """``unickpt.integrations`` is a leaf: no other part of unickpt (which never needs lightning,
    transformers or accelerate) imports it."""
    bad = [
        f"{mod} imports {imp}"
        for mod, imports in MODULES.items()
        if not mod.startswith("unickpt.integrations")
        for imp in imports
        if imp == "unickpt.integrations" or imp.startswith("unickpt.integrations.")
    ]
    assert not bad, "\n".join(bad)


def test_importing_unickpt_imports_no_trainer() -> None:
    code = (
        "import sys, unickpt, unickpt.integrations, unickpt.io, unickpt.manager, unickpt.tools\n"
        "bad = [m for m in ('lightning', 'transformers', 'accelerate') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


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


SHARED_PLUGIN_CODE = ("unickpt.plugins.base", "unickpt.plugins._shared")


def _is_shared(mod: str) -> bool:
    return any(mod == s or mod.startswith(s + ".") for s in SHARED_PLUGIN_CODE)


def test_plugins_do_not_import_each_other() -> None:
    """A plugin module (private ones too) imports only the shared plugin code, never another plugin."""
    bad = []
    for mod, imports in MODULES.items():
        if not mod.startswith("unickpt.plugins."):
            continue
        for imp in imports:
            if imp.startswith("unickpt.plugins.") and not _is_shared(imp):
                bad.append(f"{mod} imports {imp}")
    assert not bad, "\n".join(bad)


def test_shared_plugin_code_knows_no_plugin() -> None:
    bad = [
        f"{mod} imports {imp}"
        for mod, imports in MODULES.items()
        if _is_shared(mod)
        for imp in imports
        if imp == "unickpt.plugins" or (imp.startswith("unickpt.plugins.") and not _is_shared(imp))
    ]
    assert not bad, "\n".join(bad)


INTEGRATIONS = "unickpt.integrations"


def _is_private(mod: str) -> bool:
    return any(part.startswith("_") for part in mod.split(".")[1:])


def test_integrations_use_only_public_modules_and_nothing_imports_them() -> None:
    """unickpt.integrations.* (drop-in checkpointers for other frameworks) sit above everything:
    they import only unickpt's public modules (no ``_private`` one outside their own package), and
    no other module imports them, so ``import unickpt`` never imports a framework."""
    bad = []
    for mod, imports in MODULES.items():
        inside = mod == INTEGRATIONS or mod.startswith(INTEGRATIONS + ".")
        for imp in imports:
            if not imp.startswith("unickpt"):
                continue
            own = imp.startswith(INTEGRATIONS + ".")  # the package's own shared helpers
            if inside and _is_private(imp) and not own:
                bad.append(f"{mod} imports the private {imp}")
            if not inside and (imp == INTEGRATIONS or imp.startswith(INTEGRATIONS + ".")):
                bad.append(f"{mod} imports {imp}")
    assert not bad, "\n".join(bad)
    assert _is_private("unickpt.io._commit") and _is_private("unickpt._dist")
    assert not _is_private("unickpt.manager") and not _is_private("unickpt.io")


def test_lazy_private_and_relative_imports_are_seen(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "def f():\n    from unickpt.plugins import _shared\n    import unickpt.booster\nfrom . import base\n"
    )
    found = _imports(src, "unickpt.plugins.m")
    assert {"unickpt.plugins._shared", "unickpt.booster", "unickpt.plugins.base"} <= found
    # booster.py imports the plugins' mesh helpers inside a function.
    assert any(i.startswith("unickpt.plugins._shared") for i in MODULES["unickpt.booster"])


def test_format_layer_runs_without_torch() -> None:
    code = (
        "import sys, unickpt.ckpt.reader, unickpt.spec.index, unickpt.spec.hashing, "
        "unickpt.ckpt.safetensors_io, unickpt.spec.boxes, unickpt.store.publish, unickpt.store.lock\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_unickpt_is_light() -> None:
    code = (
        "import sys, unickpt, unickpt.integrations\nassert 'torch' not in sys.modules\n"
        "assert 'torchtitan' not in sys.modules\nprint(unickpt.__version__)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import cycles of ``graph`` (its strongly connected components of 2 or more modules,
    and modules importing themselves), by Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.add(m)
                        if m == node:
                            break
                    if len(comp) > 1 or node in graph[node]:
                        out.append(frozenset(comp))
    return out


# The package has no import cycle (imports inside functions counted); this stays empty.
KNOWN_CYCLES: set[frozenset[str]] = set()


def test_no_new_import_cycle() -> None:
    # A package's __init__ re-exports its modules' names: an import of the package stands for the
    # modules it names, already edges of their own, so packages are not nodes here.
    modules = {m for m, path in PATHS.items() if path.name != "__init__.py"}
    graph = {mod: {m for m in MODULES[mod] if m in modules and m != mod} for mod in modules}
    found = set(_cycles(graph))
    new = sorted(sorted(c) for c in found - KNOWN_CYCLES)
    assert not new, f"new import cycles (imports inside functions count): {new}"
    gone = sorted(sorted(c) for c in KNOWN_CYCLES - found)
    assert not gone, f"cycles broken: remove them from KNOWN_CYCLES: {gone}"


def test_the_cycle_check_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert set(_cycles(graph)) == {frozenset({"a", "b", "c"}), frozenset({"e"})}
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (rootdir-relative, no packages): two files of one
    name under tests/unit and tests/dist make the second fail to collect."""
    tests = Path(__file__).resolve().parents[2]
    seen: dict[str, str] = {}
    clashes = []
    for p in sorted(tests.rglob("test_*.py")):
        if p.name in seen:
            clashes.append(f"{seen[p.name]} and {p.relative_to(tests)}")
        seen[p.name] = str(p.relative_to(tests))
    assert not clashes, clashes


def _private_reaches(pkg: Path) -> list[str]:
    """``obj._name`` read in one module where ``_name`` is defined only in other unickpt modules.

    A module's private names (functions, classes, attributes it sets, ``__slots__`` entries) are
    its own: another module reaching them goes around the interface the owner offers. Private
    names of other libraries (torch's ``_local_tensor``, fsspec's ``_info``) are not unickpt's to
    police and are not counted; ``self``/``cls``/``super()`` reaches are the class's own.
    """
    defined: dict[str, set[Path]] = {}
    trees = {p: ast.parse(p.read_text(), str(p)) for p in pkg.rglob("*.py")}
    for p, tree in trees.items():
        for n in ast.walk(tree):
            names: list[str] = []
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names = [n.name]
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names = [n.attr]
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names = [n.id]
            elif isinstance(n, ast.arg):
                names = [n.arg]
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
                names = [n.value]
            for name in names:
                defined.setdefault(name, set()).add(p)
    found = []
    for p, tree in trees.items():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            owners = defined.get(n.attr, set())
            if owners and p not in owners:
                found.append(
                    f"{p.relative_to(pkg.parent)}:{n.lineno}: .{n.attr} (defined in {sorted(str(o.relative_to(pkg.parent)) for o in owners)[0]})"
                )
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_names() -> None:
    found = _private_reaches(PKG)
    assert not found, "\n".join(found)


def test_the_private_reach_check_finds_reaches(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def __init__(self):\n        self._secret = 1\n")
    (pkg / "b.py").write_text("def peek(a):\n    return a._secret\n")
    (pkg / "c.py").write_text("def own(x):\n    x._mine = 2\n    return x._mine\n")
    assert _private_reaches(pkg) == ["pkg/b.py:2: ._secret (defined in pkg/a.py)"]


def test_plain_module_save_and_load_import_no_heavy_module(tmp_path: Path) -> None:
    """A save, a load and a verified load of a plain ``nn.Module`` import neither transformers
    (asked whether the model is one of its models) nor ``torch.distributed.tensor`` (asked
    whether a tensor is a DTensor): no DTensor or PreTrainedModel can exist before its module is
    imported. Either import costs a save or a load of any other model about 40 to 180 MB of
    resident memory and a second or more."""
    code = (
        "import sys, torch\n"
        "from unickpt.io import GeneralCheckpointIO\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))\n"
        "io = GeneralCheckpointIO()\n"
        f"io.save_model(m, {str(tmp_path / 's')!r}, shard=True)\n"
        f"io.save_model(m, {str(tmp_path / 'g')!r}, shard=False)\n"
        f"io.load_model(m, {str(tmp_path / 's')!r}, strict=True, verify=True)\n"
        f"io.load_model(m, {str(tmp_path / 'g')!r}, strict=True)\n"
        "heavy = ('transformers', 'torch.distributed.tensor', 'sympy', 'peft', 'torch._dynamo')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
