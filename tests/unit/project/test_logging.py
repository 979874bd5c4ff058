"""Rank-aware logging: rank 0 speaks by default; other ranks only warn."""

from __future__ import annotations

import logging

import pytest

from unickpt._logging import get_logger


def test_other_ranks_only_warn_and_every_record_names_its_rank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = get_logger("unickpt.test_rank_logging")
    caplog.set_level(logging.INFO, logger="unickpt.test_rank_logging")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    log.info("hello")
    log.warning("careful")
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] careful"]
    monkeypatch.setenv("UNICKPT_LOG_ALL_RANKS", "1")
    log.info("hello")
    assert caplog.records[-1].getMessage() == "[rank 1] hello"
    caplog.clear()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("UNICKPT_LOG_ALL_RANKS")
    log.info("from zero")
    assert [r.getMessage() for r in caplog.records] == ["[rank 0] from zero"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    log.info("alone")
    assert caplog.records[-1].getMessage() == "alone"
