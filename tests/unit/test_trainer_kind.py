"""Deciding what a trainer is imports no trainer module: TRL classes are read off the trainer's MRO, so an optional
TRL module that fails to import (GRPO's needs `requests` in some releases) cannot break patching an SFTTrainer, and
a plain Trainer is patched without importing TRL at all. A failing import inside a probe declines, with the reason.

The import tests run in a fresh interpreter: this process has imported TRL's trainer modules already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import leantrain
from leantrain.entry import trainer_kind


REPO = Path(__file__).resolve().parents[2]

# Builds an SFTTrainer with TRL's GRPO module unimportable (BLOCK: a meta-path finder that raises ImportError as a
# missing dependency would, or a None entry in sys.modules), patches it, trains one step, prints what happened.
SFT_WITHOUT_GRPO = """
import importlib.abc, json, sys, tempfile
BLOCKED, BLOCK = "trl.trainer.grpo_trainer", sys.argv[1]
if BLOCK == "finder":
    class Unimportable(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == BLOCKED:
                raise ImportError("No module named 'requests'")
    sys.meta_path.insert(0, Unimportable())
else:
    sys.modules[BLOCKED] = None
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
import leantrain
from leantrain.cli.tiny import tiny_model, train_tokenizer
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=4, report_to="none",
                 use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True)
trainer = SFTTrainer(model=tiny_model("llama", vocab_size=256, hidden=64, layers=2), args=args,
                     train_dataset=Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]] * 8}),
                     processing_class=train_tokenizer(256))
report = leantrain.patch_trainer(trainer, environ={})
trainer.train()
print(json.dumps({"report": report.to_dict(), "step": trainer.state.global_step,
                  "grpo_imported": sys.modules.get(BLOCKED) is not None}))
"""

PLAIN_TRAINER = """
import json, sys, tempfile
import leantrain
from tests.unit._fakes import tiny_trainer
report = leantrain.patch_trainer(tiny_trainer(tempfile.mkdtemp()), environ={})
print(json.dumps({"kind": report.trainer_kind, "trl": sorted(m for m in sys.modules if m.partition(".")[0] == "trl")}))
"""


def _run(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", ["finder", "none_in_sys_modules"])
def test_sft_trainer_patches_with_trl_grpo_module_unimportable(block):
    got = _run(SFT_WITHOUT_GRPO, block)
    report = got["report"]
    assert report["trainer_kind"] == "sft" and got["step"] == 1 and not got["grpo_imported"]
    statuses = {o["name"]: (o["status"], o["reasons"]) for o in report["outcomes"]}
    assert statuses["grpo_logps"] == ("skipped", ["does not apply to sft trainers"])
    assert statuses["cggr"][0] == "disabled" and statuses["moe4bit"][0] == "skipped"


def test_plain_trainer_is_patched_without_importing_trl():
    assert _run(PLAIN_TRAINER) == {"kind": "trainer", "trl": []}


def test_kind_read_off_the_mro():
    import transformers
    import trl

    class MySFT(trl.SFTTrainer):  # a user's subclass is still an SFT trainer
        pass

    class GRPOTrainer(transformers.Trainer):  # a user's class of the same name is not TRL's
        pass

    assert trainer_kind(object.__new__(MySFT)) == "sft"
    assert trainer_kind(object.__new__(trl.RLOOTrainer)) == "grpo"
    assert trainer_kind(object.__new__(GRPOTrainer)) == "trainer"
    with pytest.raises(TypeError, match="unsupported trainer DPOTrainer"):
        leantrain.trainer_kind(object.__new__(trl.DPOTrainer))
    with pytest.raises(TypeError, match="needs a transformers.Trainer"):
        trainer_kind(object())
