"""The 2-process harness's verdicts (``_trainer_cases.spawn``): a rank killed by a signal before its results exist
fails the run with every rank's stderr tail (faulthandler's stack included); one killed in its exit, after every
result was written, is a warning and the results are read."""

from __future__ import annotations

import pytest


pytest.importorskip("trl")
pytest.importorskip("datasets")

import _spawn_faults as faults  # noqa: E402
from _trainer_cases import MARKS, spawn  # noqa: E402


pytestmark = MARKS


def test_abort_before_results_fails_with_the_ranks_logs(tmp_path):
    with pytest.raises(AssertionError) as failed:
        spawn("ddp", ["a", "b"], tmp_path, entry=faults.abort_before_results)
    message = str(failed.value)
    assert "SIGABRT" in message
    never = message.split("results never written: ")[1].split(", ")
    assert {"a_rank0.pt", "b_rank0.pt"} <= set(never)  # rank 1 may or may not finish before the parent stops it
    assert "--- rank 0 stderr" in message and "--- rank 1 stderr" in message
    assert "abort_before_results" in message  # faulthandler's Python stack of the aborted rank


def test_abort_after_every_result_warns_and_reads_them(tmp_path):
    with pytest.warns(UserWarning, match="died after writing every result") as caught:
        runs = spawn("ddp", ["a", "b"], tmp_path, entry=faults.abort_after_results)
    assert "about to abort in the exit" in str(caught[0].message)
    assert runs == {c: [{"case": c, "rank": r} for r in range(2)] for c in ("a", "b")}
