"""Migration in a real 2-rank FSDP2 world (gloo, CPU): a DCP training checkpoint written by
two ranks imports into unickpt and loads into a fresh FSDP2 model and optimizer bit-exactly;
the unickpt checkpoint exported with ``convert --to dcp`` loads through torch's own
``dcp.load`` + ``set_state_dict`` into FSDP2 bit-exactly; what
``HuggingFaceStorageWriter(save_distributed=True)`` writes loads with ``load_model`` and
converts. One world, three cases (``_migrate_worker.migrate_cases``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root: Path = tmp_path_factory.mktemp("migrate")
    per_rank = run_world(2, "_migrate_worker:migrate_cases", str(root), timeout=240)
    return {name: [per_rank[0][name], per_rank[1][name]] for name in per_rank[0]}


@pytest.mark.parametrize(
    "name", ["dcp_in_fsdp2_out", "unickpt_out_dcp_into_fsdp2", "hf_distributed_save_loads"]
)
def test_case(results: dict[str, list[dict[str, Any]]], name: str) -> None:
    for r, res in enumerate(results[name]):
        assert res["ok"], f"rank {r}: {res['error']}"


def test_dcp_source_was_written_by_two_ranks(results: dict[str, list[dict[str, Any]]]) -> None:
    # .metadata + __0_0.distcp + __1_0.distcp
    assert results["dcp_in_fsdp2_out"][0]["value"] == {"files": 3}
