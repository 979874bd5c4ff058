"""A 1-rank process group: unickpt's object collectives have no other rank to hear from, so a save
and a load through the Booster run no ``torch.distributed`` collective at all, and still write and
read the checkpoint bit-exact (``_world_of_one_worker.py``, a real 1-rank gloo world)."""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_world

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def obs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one")
    (result,) = run_world(1, "_world_of_one_worker:world_of_one", str(root), timeout=200)
    return dict(result)


@pytest.mark.parametrize("layout", ["sliced", "gathered"])
def test_save_and_load_run_no_collective(obs: dict[str, Any], layout: str) -> None:
    assert obs[f"save_{layout}"] == {}
    assert obs[f"load_{layout}"] == {}
    assert obs[f"exact_{layout}"] is True


def test_object_helpers_answer_alone(obs: dict[str, Any]) -> None:
    assert obs["helpers"] == {}
    assert obs["gathered_object"] == [{"x": 1}]
    assert obs["broadcast_object"] == "b"
    assert obs["agree_gather"] == [7]
    assert obs["raised"] == "only rank"
