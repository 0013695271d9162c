"""The patch report stays out of the metric stream: ``trainer.state.log_history`` of a patched run has exactly the
entries and keys of a stock run (TRL's own tests read ``log_history[0]``), the console gets the report once, and the
trackers get the statuses in their run config (wandb, MLflow, ...) or as text (TensorBoard), never as metrics."""

from __future__ import annotations

import logging

import pytest
import torch

import leantrain
from leantrain._record import TRACKERS, TrackerConfigCallback, tracker_config

from ._fakes import tiny_trainer


def _eval_rows() -> list[dict]:
    ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _history(tmp_path, patch: dict | None, **args) -> list[dict]:
    trainer = tiny_trainer(tmp_path, steps=2, eval_dataset=_eval_rows(), eval_strategy="steps", eval_steps=1, **args)
    if patch is not None:
        report = leantrain.patch_trainer(trainer, environ={}, **patch)
        # what the test asks for applies (on CPU the defaults apply nothing here: nothing is measured faster on it)
        assert set(report.applied) == {k for k, v in patch.items() if v}, report
    trainer.train()
    return trainer.state.log_history


@pytest.mark.parametrize(
    "patch",
    [{}, {"fused_ce": True}, {"fused_ce": True, "osft": True}],
    ids=["defaults", "fused_ce_applied", "osft_applied"],
)
def test_log_history_equals_stock_key_for_key(tmp_path, patch):
    stock = _history(tmp_path / "stock", None)
    patched = _history(tmp_path / "patched", patch)
    assert [sorted(e) for e in patched] == [sorted(e) for e in stock]
    assert [e["step"] for e in patched] == [e["step"] for e in stock]


def test_first_entry_is_the_first_evaluation_as_in_stock(tmp_path):
    """TRL's SFT test_train_with_eval reads log_history[0]["eval_loss"]: evaluation before the first loss log."""
    history = _history(tmp_path, {"fused_ce": True}, logging_steps=10)
    assert "eval_loss" in history[0] and history[0]["step"] == 1


def test_console_gets_the_report_once(tmp_path, caplog):
    trainer = tiny_trainer(tmp_path, steps=2)
    with caplog.at_level(logging.INFO, logger="leantrain"):
        report = leantrain.patch_trainer(trainer, environ={})
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.name == "leantrain"]
    assert lines == [report.summary()]


class _Recorder:
    """Stands in for a tracker module / writer: records every call made on it, on any attribute path."""

    def __init__(self, calls: list, path: str = "") -> None:
        self._calls, self._path = calls, path

    def __getattr__(self, name: str) -> _Recorder:
        return _Recorder(self._calls, f"{self._path}.{name}".lstrip("."))

    def __call__(self, *args, **kwargs) -> None:
        self._calls.append((self._path, args, kwargs))


def _integration_callback(name: str, handle, initialized: bool = True):
    """transformers' own integration callback, built without its tracker installed (none is, on CI)."""
    from transformers.integrations import integration_utils

    callback = object.__new__(getattr(integration_utils, name))
    setattr(callback, TRACKERS[name][0], handle)
    callback._initialized = initialized
    callback._auto_end_run = False  # read by MLflowCallback.__del__
    return callback


EXPECTED_CALL = {
    "WandbCallback": ("config.update", {"allow_val_change": True}),
    "TrackioCallback": ("config.update", {"allow_val_change": True}),
    "SwanLabCallback": ("config.update", {}),
    "MLflowCallback": ("log_params", {}),
    "CometCallback": ("log_parameters", {}),
    "DVCLiveCallback": ("log_params", {}),
}


def _begin(tmp_path, callbacks: list, world_zero: bool = True):
    trainer = tiny_trainer(tmp_path, steps=1)
    report = leantrain.patch_trainer(trainer, osft=True, environ={})
    callback = TrackerConfigCallback(lambda: report, lambda: callbacks)
    trainer.state.is_world_process_zero = world_zero
    callback.on_train_begin(trainer.args, trainer.state, trainer.control)
    return report


@pytest.mark.parametrize("name", sorted(EXPECTED_CALL))
def test_statuses_go_to_the_trackers_run_config(tmp_path, name):
    calls: list = []
    report = _begin(tmp_path, [_integration_callback(name, _Recorder(calls))])
    path, kwargs = EXPECTED_CALL[name]
    assert calls == [(path, (tracker_config(report),), kwargs)]
    assert tracker_config(report)["leantrain/osft"] == "applied"
    assert all(isinstance(v, str) for v in tracker_config(report).values())


def test_tensorboard_gets_the_report_as_text(tmp_path):
    calls: list = []
    report = _begin(tmp_path, [_integration_callback("TensorBoardCallback", _Recorder(calls))])
    ((path, (tag, text), _),) = calls
    assert (path, tag) == ("add_text", "leantrain")
    from leantrain.report import WIDTH

    lines = text.splitlines()
    assert all(line.startswith("    ") and len(line) <= WIDTH for line in lines)  # an indented block, within 119
    assert [line[4:] for line in lines] == report.render(width=WIDTH - 4).splitlines()  # every word of the report


def test_subclass_counts_trackers_not_set_up_and_other_ranks_are_left_alone(tmp_path):
    from transformers.integrations import integration_utils

    calls: list = []
    dagshub = object.__new__(integration_utils.DagsHubCallback)  # an MLflowCallback subclass
    dagshub._ml_flow, dagshub._initialized, dagshub._auto_end_run = _Recorder(calls), True, False
    idle = _integration_callback("WandbCallback", _Recorder(calls), initialized=False)
    _begin(tmp_path, [dagshub, idle, object()])
    assert [c[0] for c in calls] == ["log_params"]
    calls.clear()
    _begin(tmp_path / "rank1", [dagshub], world_zero=False)
    assert calls == []


def test_a_tracker_that_refuses_is_warned_about_once(tmp_path, caplog):
    class Refusing:
        def log_params(self, params):
            raise RuntimeError("changing a logged param")

    callback = _integration_callback("MLflowCallback", Refusing())
    with caplog.at_level(logging.WARNING, logger="leantrain"):
        _begin(tmp_path / "a", [callback, callback])
    warned = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert warned == ["leantrain: could not record the patch report in MLflowCallback: changing a logged param"]
