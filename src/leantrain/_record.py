"""What was applied stays with the run, and what is saved is what each optimization declares: ``leantrain.json``
(versions, resolved options with their sources, report) beside the weights that ``save_model()`` writes, the
statuses in the run config of the trackers the trainer reports to (wandb, MLflow, TensorBoard, ...) when training
begins, and user exports passed through each applied optimization's ``export_state_dict``. Nothing goes into
``trainer.state.log_history`` or the metric stream: scripts and trackers see exactly what a stock run logs.
Installed by ``patch_trainer`` on the trainer's undo."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ._compat import installed
from ._version import __version__
from .config import ResolvedConfig
from .report import WIDTH, PatchReport
from .undo import Undo


RECORD_NAME = "leantrain.json"
CONFIG_PREFIX = "leantrain/"
VERSIONED = ("torch", "transformers", "trl")
logger = logging.getLogger("leantrain")


def tracker_config(report: PatchReport) -> dict[str, str]:
    """``{"leantrain/cggr": "applied", ...}``: one status per optimization, for the trackers' run config."""
    return {CONFIG_PREFIX + o.name: o.status.value for o in report.outcomes}


# How each tracker's run config takes the statuses, keyed by the name of transformers' integration callback (matched
# along the callback's MRO, so subclasses such as DagsHub's MLflow callback count; nothing is imported): the
# attribute that holds the tracker once the callback's own on_train_begin has set it up, and the call. TensorBoard
# has no run config: the report goes in as text, as the callback writes the training arguments.
TRACKERS: dict[str, tuple[str, Callable[[Any, dict[str, str], str], Any]]] = {
    "WandbCallback": ("_wandb", lambda wandb, params, text: wandb.config.update(params, allow_val_change=True)),
    "TrackioCallback": (
        "_trackio",
        lambda trackio, params, text: trackio.config.update(params, allow_val_change=True),
    ),
    "SwanLabCallback": ("_swanlab", lambda swanlab, params, text: swanlab.config.update(params)),
    "MLflowCallback": ("_ml_flow", lambda mlflow, params, text: mlflow.log_params(params)),
    "CometCallback": ("_experiment", lambda experiment, params, text: experiment.log_parameters(params)),
    "DVCLiveCallback": ("live", lambda live, params, text: live.log_params(params)),
    "TensorBoardCallback": ("tb_writer", lambda writer, params, text: writer.add_text("leantrain", text)),
}


def _tracker(callback: Any) -> tuple[str, Any, Callable[[Any, dict[str, str], str], Any]] | None:
    """(name, the tracker handle, how to write to it) for a set-up integration callback, else None."""
    for cls in type(callback).__mro__:
        if cls.__name__ in TRACKERS:
            attribute, write = TRACKERS[cls.__name__]
            handle = getattr(callback, attribute, None)
            ready = getattr(callback, "_initialized", True) and handle is not None
            return (cls.__name__, handle, write) if ready else None
    return None


class TrackerConfigCallback(TrainerCallback):
    """At ``on_train_begin``, after the integration callbacks have set their trackers up, records the statuses in
    each tracker's run config (main process only). A tracker that refuses is warned about once; training goes on."""

    def __init__(self, report: Callable[[], PatchReport | None], callbacks: Callable[[], list[Any]]) -> None:
        self._report = report
        self._callbacks = callbacks
        self._warned: set[str] = set()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report = self._report()
        if report is None or not getattr(state, "is_world_process_zero", True):
            return
        indent = "    "  # TensorBoard's text panel reads markdown: an indented block keeps the table's columns
        lines = report.render(width=WIDTH - len(indent)).splitlines()
        params, text = tracker_config(report), "\n".join(indent + line for line in lines)
        for callback in self._callbacks():
            found = _tracker(callback)
            if found is None:
                continue
            name, handle, write = found
            try:
                write(handle, params, text)
            except Exception as error:  # a tracker's own error must not stop training
                if name not in self._warned:
                    self._warned.add(name)
                    logger.warning("leantrain: could not record the patch report in %s: %s", name, error)


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
    """Add the trackers' callback and wrap ``save_model`` (composing with any wrapper already on the instance,
    e.g. the exports above); both come off with ``undo``."""
    undo.add_callback(trainer, TrackerConfigCallback(report, lambda: list(trainer.callback_handler.callbacks)))

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
