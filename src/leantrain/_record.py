"""What was applied stays with the run, and what is saved is what each optimization declares: one
``leantrain/<name>`` entry in ``trainer.state.log_history`` when training begins, ``leantrain.json`` (versions,
resolved options with their sources, report) beside the weights that ``save_model()`` writes, and user exports passed
through each applied optimization's ``export_state_dict``. Installed by ``patch_trainer`` on the trainer's undo."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ._compat import installed
from ._version import __version__
from .config import ResolvedConfig
from .report import PatchReport
from .undo import Undo


RECORD_NAME = "leantrain.json"
LOG_PREFIX = "leantrain/"
VERSIONED = ("torch", "transformers", "trl")


def log_entry(report: PatchReport) -> dict[str, str]:
    """``{"leantrain/cggr": "applied", ...}``: one status per optimization."""
    return {LOG_PREFIX + o.name: o.status.value for o in report.outcomes}


class ReportLogCallback(TrainerCallback):
    """Appends the report to ``log_history`` at ``on_train_begin`` (after ``train()`` has made the run's state).

    Written to the history directly, not through ``trainer.log``: the statuses are strings, which trackers and the
    progress bar expect to be numbers. A history resumed from a checkpoint that already holds the entry gets none.
    """

    def __init__(self, report: Callable[[], PatchReport | None]) -> None:
        self._report = report

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report = self._report()
        if report is None:
            return
        entry = log_entry(report)
        if not any(all(past.get(k) == v for k, v in entry.items()) for past in state.log_history):
            state.log_history.append({**entry, "step": state.global_step})


def record(config: ResolvedConfig, report: PatchReport) -> dict[str, Any]:
    """The content of ``leantrain.json``."""
    options = {
        name: {"value": list(value) if isinstance(value, tuple) else value, "source": config.sources[name]}
        for name, value in vars(config.config).items()
    }
    return {
        "versions": {"leantrain": __version__, **{name: installed(name) for name in VERSIONED}},
        "options": options,
        "report": report.to_dict(),
    }


def write_record(output_dir: str, config: ResolvedConfig, report: PatchReport) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RECORD_NAME)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record(config, report), handle, indent=2, default=str)
        handle.write("\n")
    return path


def _writes_files(trainer: Any) -> bool:
    """The process that writes the weights (``args.should_save``: world rank 0, or each node's first rank)."""
    args = getattr(trainer, "args", None)
    if args is not None and hasattr(args, "should_save"):
        return bool(args.should_save)
    check = getattr(trainer, "is_world_process_zero", None)
    return bool(check()) if callable(check) else True


def install_exports(trainer: Any, optimizations: list[Any], undo: Undo) -> None:
    """A user export (``save_model()``) writes the state dict each applied optimization's ``export_state_dict``
    makes (OSFT: dense weights that stock ``from_pretrained`` loads); the checkpoints that ``train()`` writes
    (``save_model(..., _internal_call=True)``) keep the live state so that training resumes exactly."""
    exporting = [o for o in optimizations if type(o).export_state_dict is not _base_export()]
    if not exporting:
        return
    user_export = {"on": False}

    def make_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_model(output_dir: str | None = None, _internal_call: bool = False) -> Any:
            if _internal_call:
                return original(output_dir, _internal_call=True)
            user_export["on"] = True
            try:
                return original(output_dir, _internal_call=False)
            finally:
                user_export["on"] = False

        return save_model

    def make_save(original: Callable[..., Any]) -> Callable[..., Any]:
        def _save(output_dir: str | None = None, state_dict: dict | None = None) -> Any:
            if user_export["on"] and (state_dict is not None or trainer.args.should_save):
                if state_dict is None:
                    state_dict = trainer.model.state_dict()
                for optimization in exporting:
                    state_dict = optimization.export_state_dict(trainer, state_dict) or state_dict
            return original(output_dir, state_dict=state_dict)

        return _save

    undo.wrap_method(trainer, "save_model", make_save_model)
    undo.wrap_method(trainer, "_save", make_save)


def _base_export() -> Callable[..., Any]:
    from .optimization import Optimization

    return Optimization.export_state_dict


def install(trainer: Any, config: ResolvedConfig, report: Callable[[], PatchReport | None], undo: Undo) -> None:
    """Add the log_history callback and wrap ``save_model`` (composing with any wrapper already on the instance,
    e.g. the exports above); both come off with ``undo``."""
    undo.add_callback(trainer, ReportLogCallback(report))

    def make_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_model(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            output_dir = args[0] if args else kwargs.get("output_dir")
            current = report()
            if current is not None and _writes_files(trainer):
                write_record(output_dir if output_dir is not None else trainer.args.output_dir, config, current)
            return result

        return save_model

    undo.wrap_method(trainer, "save_model", make_save_model)
