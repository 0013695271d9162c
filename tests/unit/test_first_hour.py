"""What a newcomer meets in the first hour: one meaning of strict (what applies to this model and trainer must be
ready; what does not apply is never an error) in the API and the command line alike, a repeated patch_trainer that
cannot silently ignore a new request, bad arguments refused clearly, advice that works on this machine, and no
third-party notice the user's job has no use for."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import leantrain
from leantrain import NotReadyError, Status, patch_trainer, unpatch_trainer
from leantrain.cli import launch, main
from leantrain.entry import command_line

from ._fakes import FakeLossOpt, tiny_trainer


AUTO = {"LEANTRAIN_CGGR": "auto"}


def classifier_trainer(tmp_path) -> Trainer:
    """A BERT sequence classifier: nothing here for a causal-LM loss, no experts, no served layer-kernel family."""
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=2
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    rows = [{"input_ids": torch.randint(1, 64, (8,)), "labels": torch.tensor(k % 2)} for k in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, save_strategy="no")
    return Trainer(model=model, args=args, train_dataset=rows)


def test_strict_on_a_classifier_is_not_an_error(tmp_path):
    """Nothing applies to a classifier: strict has nothing to hold ready, and says so instead of raising."""
    trainer = classifier_trainer(tmp_path)
    report = patch_trainer(trainer, strict=True, environ={})
    assert report.applied == () and report["fused_ce"].status is Status.SKIPPED
    assert "is not a language model" in report["fused_ce"].reasons[0]
    unpatch_trainer(trainer)


def test_strict_raises_for_a_declined_optimization_that_applies(tmp_path, monkeypatch):
    """Declined (applicable, not ready) is an error under strict, from the API and from the command line alike."""
    opt = FakeLossOpt()
    opt.reasons = ("needs a GPU with sm90",)
    from leantrain.optimization import NotAvailable

    fakes = {name: opt if name == "cggr" else NotAvailable(name) for name in leantrain.config.OPTIMIZATIONS}
    monkeypatch.setattr("leantrain.entry.registry", lambda: fakes)
    for kwargs, cli in (({"strict": True}, None), ({}, {"strict": True})):
        trainer = tiny_trainer(tmp_path)
        strict = r"cggr applies here but is not ready \(strict mode\): needs a GPU"
        with command_line(cli or {}), pytest.raises(NotReadyError, match=strict):
            patch_trainer(trainer, environ=AUTO, **kwargs)
    opt.applicable = False  # not applicable: never an error, strict or not
    trainer = tiny_trainer(tmp_path)
    assert patch_trainer(trainer, strict=True, environ=AUTO)["cggr"].status is Status.SKIPPED


def test_a_repeated_patch_with_a_contradicting_request_raises(tmp_path, monkeypatch):
    opt = FakeLossOpt()
    from leantrain.optimization import NotAvailable

    fakes = {name: opt if name == "cggr" else NotAvailable(name) for name in leantrain.config.OPTIMIZATIONS}
    monkeypatch.setattr("leantrain.entry.registry", lambda: fakes)
    trainer = tiny_trainer(tmp_path)
    patch_trainer(trainer, environ=AUTO)  # cggr applied
    assert "already patched" in patch_trainer(trainer, cggr=True, environ=AUTO).notes[-1]  # the same request
    with pytest.raises(ValueError, match=r"cggr=False but cggr is applied\): call leantrain.unpatch_trainer"):
        patch_trainer(trainer, cggr=False, environ=AUTO)
    unpatch_trainer(trainer)  # the documented way: unpatch, then patch with the new request
    assert patch_trainer(trainer, cggr=False, environ=AUTO)["cggr"].status is Status.DISABLED
    with pytest.raises(ValueError, match="cggr=True but cggr is not applied"):
        patch_trainer(trainer, cggr=True, environ=AUTO)
    unpatch_trainer(trainer)


@pytest.mark.parametrize("call", [patch_trainer, unpatch_trainer])
def test_a_non_trainer_is_a_clear_type_error(call):
    with pytest.raises(
        TypeError, match=rf"{call.__name__}\(\) needs a transformers.Trainer or a TRL trainer, got int"
    ):
        call(42)


def test_contradictory_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as done:
        launch.parse(["--cggr", "--no-cggr", "train.py"], environ={})
    assert done.value.code == 2 and "--cggr and --no-cggr contradict each other" in capsys.readouterr().err


def test_bare_leantrain_prints_usage_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: leantrain") and "demo" in out and "compare" in out
    assert not list(tmp_path.iterdir())  # no ./leantrain-demo/


def test_layer_kernels_advice_on_cpu_is_the_device(tmp_path):
    """On a CPU the report names the device, never "pass layer_kernels=True", which could only fail there."""
    trainer = tiny_trainer(tmp_path)
    report = patch_trainer(trainer, environ={})
    reason = report["layer_kernels"].reasons[0]
    assert "Triton kernels for CUDA; this trainer runs on cpu" in reason and "layer_kernels=True" not in reason
    unpatch_trainer(trainer)


def test_no_warning_from_patching_a_plain_trainer(tmp_path):
    trainer = tiny_trainer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_trainer(trainer, environ={})
    unpatch_trainer(trainer)


NOTICES = """
import logging, warnings
bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: x")
logging.getLogger("DeepSpeed").warning(
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
)
for old, new in [("gradient_checkpointing", "activation_checkpointing"), ("is_gradient_checkpointing",
        "is_activation_checkpointing"), ("gradient_checkpointing_enable", "activation_checkpointing_enable"),
        ("gradient_checkpointing_disable", "activation_checkpointing_disable"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")]:
    warnings.warn(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning)
# their neighbours: the same sources, other words or another category
bnb.warning("another bitsandbytes warning")
logging.getLogger("DeepSpeed").warning("another DeepSpeed warning")
warnings.warn("`max_seq_length` is deprecated and will be removed in v6. Use `max_length` instead.", FutureWarning)
warnings.warn("`gradient_checkpointing` is deprecated and will be removed in v6.", UserWarning)
"""
DROPPED = (
    "gemm_4bit_forward",
    "Setting accelerator to CPU",
    "FutureWarning: `gradient_checkpointing",
    "FutureWarning: `is_gradient_checkpointing",
)
KEPT = (
    "another bitsandbytes warning",
    "another DeepSpeed warning",
    "FutureWarning: `max_seq_length` is deprecated",
    "UserWarning: `gradient_checkpointing` is deprecated",
)


def _stderr(prelude: str) -> str:
    done = subprocess.run([sys.executable, "-c", prelude + NOTICES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_commands_drop_the_third_party_notices_and_only_those():
    """bitsandbytes' missing-`kernels` notice, DeepSpeed's CPU-accelerator notice and transformers' checkpointing
    renames (TRL's defaults and calls, not the user's) say nothing about the user's job: the commands drop exactly
    those, by source and words, and let their neighbours through."""
    err = _stderr("from leantrain.cli.commands import quiet_third_party\nquiet_third_party()\n")
    assert not [d for d in DROPPED if d in err], err
    assert all(k in err for k in KEPT), err


def test_a_library_user_keeps_every_notice():
    """Importing leantrain and patching a trainer leave the process's warnings and logging as they were."""
    err = _stderr("import leantrain\nfrom leantrain import patch_trainer\nimport leantrain.cli\n")
    assert all(d in err for d in DROPPED) and all(k in err for k in KEPT), err


def test_an_unknown_name_nothing_is_close_to_lists_the_options(tmp_path):
    """A near miss gets its match; a name nothing resembles gets every option, not a guess or nothing."""
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(TypeError, match=r"'fusedce' \(did you mean fused_ce\?\)"):
        patch_trainer(trainer, fusedce=True)
    with pytest.raises(TypeError) as caught:
        patch_trainer(trainer, liger=True)
    names = [f.name for f in leantrain.LeantrainConfig.options()]
    assert str(caught.value).endswith("; the options are " + ", ".join(names))


def test_osft_on_a_classifier_names_its_own_layers_not_llama_defaults(tmp_path):
    """BERT has no OSFT defaults: the reason says so and suggests patterns from the model's own linears."""
    trainer = classifier_trainer(tmp_path)
    report = patch_trainer(trainer, environ={"LEANTRAIN_OSFT": "auto"})
    reason = report["osft"].reasons[0]
    assert report["osft"].status is Status.SKIPPED
    assert "model type 'bert' has no OSFT defaults" in reason, reason
    assert "its linear layers include attention.self.query, attention.self.key" in reason, reason
    unpatch_trainer(trainer)


def test_tiny_configs_raise_no_transformers_warning():
    """The demo's and the tests' tiny configs are valid as written (no RoPE-scaling or other config complaints)."""
    import logging

    from leantrain.cli import tiny

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        for family in tiny.FAMILIES:
            tiny.tiny_config(family)
    finally:
        root.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]
