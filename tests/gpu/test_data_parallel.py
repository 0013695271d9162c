"""One process, two visible GPUs: HF ``Trainer`` wraps the model in ``nn.DataParallel``. Each optimization either
applies correctly on every replica or declines with a reason that names DataParallel.

How DataParallel sees a patched model (torch/nn/parallel/replicate.py): every forward, each module is copied with
``_replicate_for_data_parallel`` — a shallow copy of its ``__dict__`` — and parameters/buffers are broadcast onto
the copies. So an instance-level ``forward`` set on a module (leantrain's ``Undo.wrap_method``) survives on every
replica but stays a closure over the ORIGINAL module (its parameters and any plan built from them live on
``device_ids[0]``), and forward hooks (``_forward_hooks``, one dict shared by all replicas) fire on every replica,
concurrently, each seeing its slice of the batch. Plain tensor attributes are not broadcast.

Run on a machine with 2+ GPUs: ``MULTI_GPU_TESTS=1 bash benchmarks/gpu_run.sh multi_gpu`` (issue #29). Skipped
below two visible CUDA devices (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from leantrain import NotReadyError, Status, patch_trainer
from leantrain.cli import tiny
from leantrain.config import OPTIMIZATIONS


pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

VOCAB, SEQ, ROWS, STEPS = 512, 64, 32, 3
# Both runs see the same global batches (per-device 4 x 2 replicas vs 8 on one GPU), every row full length, so the
# DataParallel mean of the two replicas' mean losses equals the one-device mean over all tokens. fp32 with TF32 off:
# the replicas' partial sums differ from one GPU's in order only, a few ulps (1.2e-7) of each reduced quantity, and
# Adam carries that through STEPS steps; 1e-4 of the loss (~6 at random init) is ~100x that, far below the change
# a wrong replica makes (a missing or doubled update moves the loss by ~1e-2 at lr 1e-3).
LOSS_RTOL = 1e-4


def _rows() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
    return [{"input_ids": row.tolist(), "attention_mask": [1] * SEQ, "labels": row.tolist()} for row in ids]


def _model(family: str) -> torch.nn.Module:
    if family == "gpt_oss":
        pytest.importorskip("bitsandbytes")
        model = tiny.tiny_model(
            "gpt_oss", vocab_size=VOCAB, hidden=64, layers=2, num_local_experts=8, intermediate_size=64
        ).to("cuda:0")
        tiny.linear4bit_experts(model)  # frozen nf4 per-expert Linear4bit lists, quantized on cuda:0
        return model.train()
    return tiny.tiny_model(family, vocab_size=VOCAB, hidden=128, layers=2).to("cuda:0").train()


def _trainer(family: str, tmp_path, one_device: bool):
    """A plain transformers Trainer; with ``one_device`` the same global batch on cuda:0 alone (n_gpu forced to 1)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / ("one" if one_device else "dp")),
        per_device_train_batch_size=8 if one_device else 4,
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    assert args.n_gpu >= 2, "this test needs Trainer to see 2+ GPUs"  # also runs the cached device setup
    if one_device:
        args._n_gpu = 1  # the reference: Trainer reads n_gpu (after the setup above) to decide on DataParallel
    return Trainer(model=_model(family), args=args, train_dataset=_rows())


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _only(name: str) -> dict[str, bool]:
    """``name`` required, every other optimization off: the two runs differ in ``name`` alone (the defaults fused_ce
    and layer_kernels would apply on one GPU and decline under DataParallel)."""
    return {other: other == name for other in OPTIMIZATIONS}


def _applies_on_every_replica_or_declines(name: str, family: str, tmp_path, **options) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    dp = _trainer(family, tmp_path, one_device=False)
    try:
        outcome = patch_trainer(dp, **_only(name), **options)[name]
    except NotReadyError as error:  # required and declined: the reason must name DataParallel
        assert "DataParallel" in str(error), f"{name} declined without naming DataParallel: {error}"
        return
    if outcome.status is Status.SKIPPED:
        reason = " ".join(outcome.reasons)
        assert "DataParallel" in reason, f"{name} declined without naming DataParallel: {reason}"
        return
    assert outcome.status is Status.APPLIED, outcome
    dp.train()
    assert isinstance(dp.model_wrapped, torch.nn.DataParallel)
    from leantrain import current_report

    after = current_report(dp)[name]
    assert after.status is Status.APPLIED, f"{name} fell back under DataParallel: {after.reasons}"
    one = _trainer(family, tmp_path, one_device=True)
    assert patch_trainer(one, **_only(name), **options)[name].status is Status.APPLIED
    one.train()
    got, want = _losses(dp), _losses(one)
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{name} step {step}: DataParallel loss {a} vs one GPU {b}"


def test_trainer_wraps_in_data_parallel(tmp_path):
    """The premise: with 2 visible GPUs and no launcher, a plain Trainer trains through nn.DataParallel."""
    trainer = _trainer("llama", tmp_path, one_device=False)
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.DataParallel)


def test_cggr_under_data_parallel(tmp_path):
    # Its router forward hook fires on every replica with half the rows, while the batch's selection slot is one
    # per step for the whole batch: applying it unchanged would misselect; it must score per replica or decline.
    _applies_on_every_replica_or_declines("cggr", "llama", tmp_path, cggr_warmup_steps=0)


def test_osft_under_data_parallel(tmp_path):
    # OSFTLinear keeps its factors as parameters (broadcast to every replica); the gradient projection runs in the
    # optimizer step on the original parameters, after DataParallel reduced the replicas' gradients onto them.
    _applies_on_every_replica_or_declines("osft", "llama", tmp_path)


def test_moe4bit_under_data_parallel(tmp_path):
    # The patched experts forward is an instance attribute closing over the original module and a plan of
    # consolidated 4-bit stacks on cuda:0: replica 1 would run it with cuda:1 inputs.
    _applies_on_every_replica_or_declines("moe4bit", "gpt_oss", tmp_path)


def test_grpo_trainers_refuse_data_parallel(tmp_path):
    """grpo_logps serves GRPO/RLOO trainers only, and TRL refuses to build them with 2+ GPUs in one process (their
    replicas would all run the forward bound to the original model), so it never meets a DataParallel model."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1, report_to="none"
    )
    assert args.n_gpu >= 2
    from datasets import Dataset

    prompts = Dataset.from_dict({"prompt": ["a b c"] * 8})
    with pytest.raises(ValueError, match="DataParallel"):
        GRPOTrainer(
            model=_model("llama"),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=prompts,
            processing_class=tiny.train_tokenizer(VOCAB),
        )
