"""A tiny plain Trainer and fake optimizations for testing the patching machinery itself."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from leantrain.cli.tiny import tiny_model
from leantrain.optimization import Applied, Optimization, PatchContext, Readiness


def tiny_trainer(tmp_path, steps: int = 3, eval_dataset: Any = None, layers: int = 2, **args: Any) -> Trainer:
    model = tiny_model("llama", vocab_size=128, hidden=64, layers=layers).train()
    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 128, (16, 12))]
    defaults = dict(save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-3)
    config = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        **{**defaults, **args},
    )
    return Trainer(model=model, args=config, train_dataset=rows, eval_dataset=eval_dataset)


class FakeLossOpt(Optimization):
    """Wraps compute_loss; its fast path can be told to fail, to exercise the run-time fallback."""

    name = "cggr"
    trainer_kinds = ("trainer", "sft")
    reasons: tuple[str, ...] = ()
    applicable = True
    slower: str = ""  # the auto rule's evidence (measured slower, not measured faster), with or without reasons
    fail_at_call: int | None = None

    def __init__(self) -> None:
        self.calls = 0

    def probe(self, trainer, ctx: PatchContext) -> Readiness:
        if not self.applicable:
            return Readiness.not_applicable("nothing to optimize here")
        return Readiness(self.reasons, detail="fake path", plan="the fake plan").with_auto_rule(self.slower)

    def apply(self, trainer, plan, ctx: PatchContext) -> Applied:
        assert plan == "the fake plan"  # the probe's plan reaches apply
        undo = ctx.undo

        def make(original):
            def fast(*args, **kwargs):
                self.calls += 1
                if self.fail_at_call is not None and self.calls >= self.fail_at_call:
                    raise RuntimeError("injected failure")
                return original(*args, **kwargs)

            def compute_loss(*args, **kwargs):
                return ctx.fallback.call(fast, original, *args, **kwargs)

            return compute_loss

        undo.wrap_method(trainer, "compute_loss", make)
        return Applied(targets=("trainer.compute_loss",), detail="fake path")
