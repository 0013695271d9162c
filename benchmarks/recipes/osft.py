"""OSFT recipe: dense full fine-tuning vs leantrain osft=True vs mini_trainer's OSFT."""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .runner import (
    Budget,
    StepClock,
    Variant,
    checkpointing,
    cleanup,
    dense_model,
    filtered,
    leantrain_patch,
    log,
    run_group,
    sft_trainer,
    token_dataset,
)
from .settings import Settings


def recipe_osft(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    from bench_osft import load_mini_trainer, mini_trainer_model
    from transformers import TrainerCallback

    from leantrain.osft import osft_layers

    warmup, timed = s.osft_steps
    fields = s.osft_shape
    base = dense_model("LlamaConfig", fields, s, dtype=torch.float32)  # fp32 master weights, bf16 autocast
    data = token_dataset(fields["vocab_size"], (warmup + timed) * s.osft_batch, s.osft_seq)
    mt, mt_reason = load_mini_trainer()
    log(f"mini_trainer: {mt_reason if mt is not None else 'unavailable: ' + mt_reason}")
    tmp = Path(tempfile.mkdtemp(prefix="recipes_osft_"))
    config = f"{s.osft_name} {s.osft_batch}x{s.osft_seq}"
    settings = dict(
        shape=s.osft_name,
        batch=s.osft_batch,
        seq=s.osft_seq,
        lr=1e-5,
        unfrozen_rank_ratio=0.5,
        weights="fp32, bf16 autocast",
        checkpointing=False,
    )
    factors: dict[str, Any] = {}  # leantrain's initial factors (CPU copies) for mini_trainer: no second SVD

    def trainer_for(model) -> Any:
        return sft_trainer(
            model,
            data,
            tmp,
            warmup + timed,
            s,
            learning_rate=1e-5,
            max_length=s.osft_seq,
            per_device_train_batch_size=s.osft_batch,
            **checkpointing(False),
        )

    def patch_osft(trainer: Any) -> Any:
        report = leantrain_patch(osft=True)(trainer)
        factors.update({n: copy.deepcopy(layer).cpu() for n, layer in osft_layers(trainer.model).items()})
        return report

    class Projections(TrainerCallback):  # mini_trainer's own calls around optimizer.step()
        def __init__(self, model) -> None:
            self.model = model

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.model.project_gradients()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.model.project_parameters()

    def make_mt() -> Any:
        if not factors:
            raise RuntimeError("leantrain's OSFT variant did not run, so there are no factors to start from")
        model = mini_trainer_model(mt, base, factors).train()
        model.upcast_dtype = torch.float32
        return trainer_for(model)

    def mt_hooks(trainer: Any, clock: StepClock) -> None:
        trainer.callback_handler.callbacks.insert(-1, Projections(trainer.model))  # inside the optimizer timer

    variants = [
        Variant(
            "osft", config, "dense full FT", "stock", None, lambda: trainer_for(copy.deepcopy(base)), settings=settings
        ),
        Variant(
            "osft",
            config,
            "leantrain osft",
            "leantrain",
            "dense full FT",
            lambda: trainer_for(copy.deepcopy(base)),
            patch_osft,
            settings=settings,
        ),
        Variant(
            "osft",
            config,
            "mini_trainer 0.9.0 osft",
            "peer",
            "dense full FT",
            make_mt,
            None,
            mt_hooks,
            settings=settings,
            skip=None if mt is not None else f"mini_trainer: {mt_reason}",
        ),
    ]
    try:
        return run_group(filtered(variants, args.only), s.osft_steps, s, budget)
    finally:
        factors.clear()
        base = None
        cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
