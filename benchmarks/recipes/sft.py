"""SFT recipe: TRL SFTTrainer, stock vs CGGR."""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .runner import (
    Budget,
    Variant,
    checkpointing,
    cleanup,
    dense_model,
    filtered,
    leantrain_patch,
    run_group,
    selected,
    sft_trainer,
    short_shape,
    token_dataset,
)
from .settings import Settings


def recipe_sft(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    warmup, timed = s.sft_steps
    records: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="recipes_sft_"))
    try:
        for shape, fields in selected(s.sft_shapes, args.shapes).items():
            pristine = dense_model("Qwen2Config", fields, s)
            data = token_dataset(fields["vocab_size"], (warmup + timed) * s.sft_batch, s.sft_seq)
            config = f"{short_shape(shape)} {s.sft_batch}x{s.sft_seq}"
            settings = dict(shape=shape, batch=s.sft_batch, seq=s.sft_seq, lr=1e-5, checkpointing=s.cuda)

            def make() -> Any:
                return sft_trainer(
                    copy.deepcopy(pristine),
                    data,
                    tmp,
                    warmup + timed,
                    s,
                    learning_rate=1e-5,
                    per_device_train_batch_size=s.sft_batch,
                    max_length=s.sft_seq,
                    **checkpointing(s.cuda),
                )

            group = [Variant("sft", config, "stock", "stock", None, make, settings=settings)]
            for ratio in s.sft_ratios:
                patch = leantrain_patch(cggr=True, cggr_min_tokens_ratio=ratio, cggr_warmup_steps=0)
                group.append(
                    Variant(
                        "sft",
                        config,
                        f"leantrain cggr {ratio:g}",
                        "leantrain",
                        "stock",
                        make,
                        patch,
                        settings={**settings, "cggr_ratio": ratio},
                    )
                )
            records += run_group(filtered(group, args.only), s.sft_steps, s, budget)
            pristine = None
            cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records
