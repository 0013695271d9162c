"""compile_layers' version gate, on every CI set: on transformers 4.x each decoder layer compiled its own graph (no
code shared between layers), so the probe declines there with the reason; on transformers >= 5 it does not."""

from __future__ import annotations

import pytest
import transformers
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import NotReadyError, Status
from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import probe as compile_probe
from testkit.optimizations import only


def trainer(tmp_path) -> Trainer:
    model = tiny_model("llama", vocab_size=128, hidden=32, layers=2).train()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, save_strategy="no")
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0"])
def test_declines_on_transformers_4(tmp_path, monkeypatch, version):
    monkeypatch.setattr(compile_probe, "_transformers_version", lambda: version)
    if version.startswith("4."):
        with pytest.raises(NotReadyError, match="needs transformers >= 5"):
            leantrain.patch_trainer(trainer(tmp_path), **only("compile_layers"), compile_layers_backend="aot_eager")
        return
    report = leantrain.patch_trainer(trainer(tmp_path), **only("compile_layers"), compile_layers_backend="aot_eager")
    assert report["compile_layers"].status is Status.APPLIED


def test_the_installed_version_decides(tmp_path):
    report = leantrain.patch_trainer(trainer(tmp_path), **only("compile_layers", None))
    reasons = " ".join(report["compile_layers"].reasons)
    assert ("needs transformers >= 5" in reasons) == transformers.__version__.startswith("4.")
