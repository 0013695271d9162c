"""``_launch.launch``'s verdicts on a stand-in launch (one process, no torch.distributed): a clean exit passes, an
abort before the results exist fails with the output's tail, an abort after every result was written warns."""

from __future__ import annotations

import sys

import pytest
from _launch import launch


WRITE = "import os, pathlib, sys; pathlib.Path(sys.argv[1]).write_text('{}'); print('trained', flush=True)"


def stand_in(tmp_path, *, abort_first: bool = False, abort_after: bool = False) -> list[str]:
    code = ("import os; os.abort()\n" if abort_first else "") + WRITE + ("; os.abort()" if abort_after else "")
    return [sys.executable, "-c", code, str(tmp_path / "result_rank0.json")]


def test_a_clean_exit_passes(tmp_path):
    done = launch(stand_in(tmp_path), [tmp_path / "result_rank0.json"], timeout=60)
    assert done.returncode == 0 and "trained" in done.stdout


def test_an_abort_before_the_results_fails_with_the_log(tmp_path):
    with pytest.raises(AssertionError, match="results never written: result_rank0.json"):
        launch(stand_in(tmp_path, abort_first=True), [tmp_path / "result_rank0.json"], timeout=60)


def test_an_abort_after_every_result_warns(tmp_path):
    with pytest.warns(UserWarning, match="died after every result was written") as caught:
        done = launch(stand_in(tmp_path, abort_after=True), [tmp_path / "result_rank0.json"], timeout=60)
    assert done.returncode != 0 and "trained" in str(caught[0].message)


def test_a_result_missing_for_one_rank_fails(tmp_path):
    results = [tmp_path / "result_rank0.json", tmp_path / "result_rank1.json"]
    with pytest.raises(AssertionError, match="results never written: result_rank1.json"):
        launch(stand_in(tmp_path, abort_after=True), results, timeout=60)
