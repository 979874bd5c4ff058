"""The public surface of unickpt, written out: an export added or dropped by accident fails here.

Changing a list below is changing the public API: say so in docs/architecture.md ("What is public").
"""

from __future__ import annotations

import importlib

import pytest

ERRORS = [
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
    "StorageError",
]

PUBLIC = {
    "unickpt": [
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
        *ERRORS,
    ],
    "unickpt.errors": [*ERRORS, "IntegrityFailure"],
    "unickpt.io": ["CheckpointIO", "GeneralCheckpointIO", "HookContext", "LoadReport", "LocalSlice"],
    "unickpt.plugins": [
        "Plugin",
        "DDPPlugin",
        "DDPCheckpointIO",
        "FSDP2Plugin",
        "FSDP2CheckpointIO",
        "TPPlugin",
        "TPCheckpointIO",
        "PPPlugin",
        "PPCheckpointIO",
        "ZeroPlugin",
        "ZeroCheckpointIO",
        "HybridParallelPlugin",
        "HybridCheckpointIO",
        "ExpertParallelPlugin",
        "ExpertParallelCheckpointIO",
    ],
    "unickpt.manager": ["CheckpointManager"],
    "unickpt.tools": ["merge_checkpoint", "diff_checkpoints", "verify_checkpoint", "inspect_checkpoint"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_all_is_the_written_list(package: str) -> None:
    module = importlib.import_module(package)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{package}.__all__ names something twice"
    assert sorted(exported) == sorted(PUBLIC[package])
    for name in exported:
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_top_level_names_are_the_packages_own() -> None:
    """``unickpt.X`` is the very object its home package exports (lazy loading hands out no copies)."""
    import unickpt
    import unickpt.io
    import unickpt.manager
    import unickpt.tools

    for pkg in (unickpt.io, unickpt.manager, unickpt.tools, importlib.import_module("unickpt.errors")):
        for name in set(unickpt.__all__) & set(pkg.__all__):
            assert getattr(unickpt, name) is getattr(pkg, name), name


def test_manager_only_helpers_are_not_exported_by_io() -> None:
    import unickpt.io

    for name in ("SavePayload", "hf_config_files", "lr_scheduler_json", "optimizer_tensor_name"):
        assert not hasattr(unickpt.io, name), name
    # They still live in their own modules for the manager and the tools.
    from unickpt.io.optimizer import optimizer_tensor_name
    from unickpt.io.side_files import hf_config_files, lr_scheduler_json
    from unickpt.io.tensors import SavePayload

    assert SavePayload and hf_config_files and lr_scheduler_json and optimizer_tensor_name


INTEGRATIONS = {
    "unickpt.integrations.lightning": (
        "lightning",
        [
            "UnickptCheckpointIO",
            "UnickptFSDPStrategy",
            "UnickptModelParallelStrategy",
            "STATE_FILE",
            "optimizer_dir",
        ],
    ),
    "unickpt.integrations.hf_trainer": (
        "transformers",
        ["UnickptTrainer", "OPTIMIZER_DIR", "SCHEDULER_FILE", "ARGS_FILE"],
    ),
    "unickpt.integrations.accelerate": ("accelerate", ["register_unickpt_hooks", "model_dir"]),
}


@pytest.mark.parametrize("module", sorted(INTEGRATIONS))
def test_integration_exports(module: str) -> None:
    peer, names = INTEGRATIONS[module]
    pytest.importorskip(peer, reason=f"{peer} is not installed (make peers)")
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(names)
    assert importlib.import_module("unickpt.integrations").__all__ == []
