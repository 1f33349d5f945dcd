"""The agent's own state travels with the machine: a checkpoint's context comes back from
history() and restore(), and after export and import into another store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewind import InvalidArgument, Sandbox
from rewind.results import Checkpoint
from rewind.sandbox import MAX_CONTEXT, history_of
from rewind.store import export_checkpoint, import_checkpoint, open_store

PLAN = json.dumps({"messages": [{"role": "user", "content": "migrate the database"}], "step": 3,
                   "note": "ünïcödé and newlines\n"})


def test_context_comes_back_from_history_and_restore(sbx: Sandbox) -> None:
    point = sbx.checkpoint(name="planned", context=PLAN)
    assert point.context == PLAN
    sbx.checkpoint(name="later", context="step 4")
    assert [(c.name, c.context) for c in sbx.history()[:2]] == [("later", "step 4"), ("planned", PLAN)]
    restored = sbx.restore(point)
    assert restored.id == point.id and restored.context == PLAN
    assert sbx.checkpoint(name="no-context").context is None


def test_context_survives_export_and_import(sbx: Sandbox, tmp_path: Path) -> None:
    point = sbx.checkpoint(name="to-carry", context=PLAN, wait=True)
    out = tmp_path / "point.rewind"
    export_checkpoint(sbx._store, point.id, out)
    other = open_store(tmp_path / "other-store", create=True)
    imported = import_checkpoint(other, out)
    assert Checkpoint.of(imported).context == PLAN
    assert history_of(other.get("to-carry"), sbx._machine.home)[0].context == PLAN


@pytest.mark.parametrize("bad", [b"bytes", {"a": 1}, "x" * (MAX_CONTEXT + 1)])
def test_a_bad_context_is_refused_and_the_machine_runs_on(sbx: Sandbox, bad: object) -> None:
    before = len(sbx.history())
    with pytest.raises(InvalidArgument, match="context"):
        sbx.checkpoint(context=bad)  # type: ignore[arg-type]
    assert len(sbx.history()) == before and sbx.exec("echo ok").stdout == "ok\n"
