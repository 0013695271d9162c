"""Worker for the 2-process trainer tests (gloo, CPU): a tiny TRL SFT with CGGR, a GRPO step with fused log-probs
and an OSFT SFT, under accelerate's DDP (MULTI_CPU) or FSDP2, patched with ``leantrain.patch_trainer`` before
``train()`` wraps the model. With engine "single" (no process group) the same code is the single-process reference
on the same global batch: one process with ``WORLD * PER_RANK`` rows per step vs ``WORLD`` ranks with ``PER_RANK``.

Each case returns plain data: per-step loss and grad norm, full (gathered) parameters after ``STEPS`` optimizer
steps, the leantrain report after training, and case-specific records (CGGR label masks and ``num_items_in_batch``,
GRPO completions, fused-op calls).
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


STEPS = 2
WORLD = 2
PER_RANK = 2  # SFT rows / GRPO completions per rank and step; the single-process run takes WORLD * PER_RANK
SEQ = 64  # SFT max_length: 4 of the 8 texts are shorter, so ranks hold different label counts at every step
COMPLETION = 8
LAYER_CLS = "LlamaDecoderLayer"


def init_env(rank: int, world: int, port: int) -> None:
    """What torchrun would export: accelerate reads it and builds the gloo process group (MULTI_CPU / FSDP)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )


def sft_texts(tokenizer) -> list[str]:
    """STEPS * WORLD * PER_RANK texts in training order: step s, rank r takes rows [s*4 + 2r, s*4 + 2r + 2). Long
    texts (> SEQ tokens: truncated) and short ones (< SEQ - 8: padded) are mixed so that the two ranks hold different
    label counts at every step: a per-rank loss normalization would then be visibly wrong."""
    from leantrain.tiny import corpus_texts

    texts = corpus_texts()
    sizes = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    long = [t for t, n in zip(texts, sizes) if n > SEQ + 16]
    short = [t for t, n in zip(texts, sizes) if n < SEQ - 8]
    # step 1: rank 0 (long, long), rank 1 (short, long); step 2: rank 0 (short, short), rank 1 (long, short)
    return [long[0], long[1], short[0], long[2], short[1], short[2], long[3], short[3]]


def common_args(engine: str, out: Path, batch: int) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 (CPU autocast): the comparison is in fp32
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        ddp_timeout=180,  # a rank that dies must not leave the other waiting for 30 minutes
    )
    if engine == "fsdp2":
        enable_fsdp_on_cpu()
        args.update(
            fsdp=True,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [LAYER_CLS]},
            accelerator_config={"use_configured_state": True},
        )
    return args


def enable_fsdp_on_cpu() -> None:
    """accelerate 1.15 turns a FSDP plugin into ``DistributedType.FSDP`` only for GPU-like process groups; on CPU
    (MULTI_CPU, gloo) it drops the plugin silently and trains with DDP. So configure the shared state first,
    promoted to FSDP with the plugin the trainer would build, and let the trainer adopt it
    (``accelerator_config={"use_configured_state": True}``, a TrainingArguments option). From there on it is the
    stock FSDP2 path: fully_shard per decoder layer and root, DTensor parameters, optimizer built after prepare,
    clip_grad_norm over DTensors, TRL's prepare_fsdp for the GRPO reference model."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = Accelerator(cpu=True).state
    if state.distributed_type is not DistributedType.FSDP:
        # both singletons: every AcceleratorState() re-reads the process-level fields from PartialState
        PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="TRANSFORMER_BASED_WRAP",
            transformer_cls_names_to_wrap=LAYER_CLS,
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
            state_dict_type="FULL_STATE_DICT",
        )


def tiny_llama(tokenizer) -> Any:
    from leantrain.tiny import tiny_model

    return tiny_model("llama", seed=0, vocab_size=len(tokenizer), hidden=64, layers=4).train()


def full_params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter as a full fp32 tensor (FSDP2 DTensor shards gathered: a collective, all ranks call it)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    out = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.clone()
    return out


def history(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry and key in entry]


def finish(trainer, **extra: Any) -> dict[str, Any]:
    import leantrain

    report = leantrain.current_report(trainer)
    return {
        "loss": history(trainer, "loss"),
        "grad_norm": history(trainer, "grad_norm"),
        "params": full_params(trainer),
        "report": report.to_dict() if report else None,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "world": trainer.args.world_size,
        "fsdp2": any(hasattr(p, "full_tensor") for p in trainer.model_wrapped.parameters()),
        **extra,
    }


def train_quietly(trainer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


# ---- SFT (CGGR / OSFT) -------------------------------------------------------------------------------------------
def sft_trainer(engine: str, out: Path, batch: int, **overrides: Any):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from leantrain.tiny import train_tokenizer

    tokenizer = train_tokenizer()
    args = common_args(engine, out, batch)
    args.update(max_length=SEQ, train_sampling_strategy="sequential", **overrides)
    config = SFTConfig(**args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(
            model=tiny_llama(tokenizer),
            args=config,
            train_dataset=Dataset.from_dict({"text": sft_texts(tokenizer)}),
            processing_class=tokenizer,
        )


def record_cggr(trainer) -> dict[str, list]:
    """This rank's kept-label mask per micro-batch (read after the forward: CGGR writes -100 in place during it) and
    the ``num_items_in_batch`` that compute_loss receives."""
    records: dict[str, list] = {"kept": [], "valid": [], "num_items": []}
    model = trainer.model

    def after_forward(module, args, kwargs, output):
        labels = kwargs.get("labels")
        if module.training and labels is not None:
            records["kept"].append((labels[:, 1:] != -100).clone())

    model.register_forward_hook(after_forward, with_kwargs=True)
    patched = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            records["num_items"].append(int(num_items_in_batch))
            records["valid"].append((inputs["labels"][:, 1:] != -100).clone())
        return patched(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    trainer.compute_loss = compute_loss
    return records


def sft_cggr(engine: str, out: Path, batch: int, **overrides: Any) -> dict[str, Any]:
    import leantrain

    trainer = sft_trainer(engine, out, batch, **overrides)
    report = leantrain.patch_trainer(trainer, cggr=True, cggr_warmup_steps=0, cggr_min_tokens_ratio=0.5)
    records = record_cggr(trainer)
    train_quietly(trainer)
    return finish(trainer, patched=report.to_dict(), **records)


def sft_cggr_local_norm(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """Negative control: each rank normalizes by its own label count (average_tokens_across_devices=False)."""
    return sft_cggr(engine, out, batch, average_tokens_across_devices=False)


def sft_osft(engine: str, out: Path, batch: int) -> dict[str, Any]:
    import leantrain
    from leantrain.osft import frozen_overlap, osft_layers

    trainer = sft_trainer(engine, out, batch)
    report = leantrain.patch_trainer(trainer, osft=True)
    train_quietly(trainer)
    trainable = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    overlap = max(frozen_overlap(layer) for layer in osft_layers(trainer.model).values())  # a collective if sharded
    return finish(trainer, patched=report.to_dict(), trainable=trainable, overlap=overlap)


# ---- GRPO (fused log-probs) --------------------------------------------------------------------------------------
def fixed_rollout(record: list) -> Callable[[list, Any], dict[str, Any]]:
    """Completions as a deterministic function of (prompt, index within its group), not of the rank's RNG.

    Sampled generation cannot match across layouts: each process draws one RNG stream over its local rows, so
    2 ranks x B rows never reproduce 1 process x 2B rows; greedy decoding makes a group's completions identical,
    so every advantage is 0 and the loss carries no signal. Fixed completions of varied length (some ending in EOS)
    keep everything after generation (rewards, advantages, log-probs, KL, loss normalization) under test.
    """

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        seen: Counter = Counter()
        completions = []
        for ids in prompt_ids:
            key = tuple(ids)
            g = torch.Generator().manual_seed(zlib.crc32(repr((key, seen[key])).encode()))
            seen[key] += 1
            n = int(torch.randint(2, COMPLETION + 1, (1,), generator=g))
            tokens = torch.randint(3, len(tokenizer), (n,), generator=g).tolist()
            if n % 2:  # about half end in EOS, the others are "truncated"
                tokens[-1] = tokenizer.eos_token_id
            completions.append(tokens)
        record.extend(zip(map(tuple, prompt_ids), map(tuple, completions)))
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    return rollout


def letters_reward(completions: list[str], **_: Any) -> list[float]:
    return [sum(c.isalpha() for c in text) / max(1, len(text)) + 0.1 * len(text.split()) for text in completions]


def grpo_fused(engine: str, out: Path, batch: int) -> dict[str, Any]:
    from accelerate import PartialState
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import leantrain
    from leantrain.grpo_logps import ops
    from leantrain.tiny import corpus_texts, train_tokenizer

    tokenizer = train_tokenizer()
    tokenizer.padding_side = "left"
    args = common_args(engine, out, batch)
    args.update(
        num_generations=2,  # divides PER_RANK: a group never straddles ranks (TRL's RepeatSampler keeps it whole)
        max_completion_length=COMPLETION,
        beta=0.1,
        temperature=0.7,
        shuffle_dataset=False,
    )
    config = GRPOConfig(**args)  # sets up the process group (if any)
    # beta > 0: TRL builds the reference model from the policy's path, so save the seeded model first (only rank 0
    # writes files once torch.distributed is up)
    path = out / "init-model"
    state = PartialState()
    if state.is_main_process:
        tiny_llama(tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
    state.wait_for_everyone()
    completions: list = []
    prompts = [" ".join(t.split()[:8]) for t in corpus_texts()[: STEPS * WORLD * PER_RANK // 2]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(path),
            reward_funcs=letters_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            rollout_func=fixed_rollout(completions),
        )
    report = leantrain.patch_trainer(trainer, grpo_logps=True)
    calls = []
    real_op = ops.logp_entropy

    def spy(*a: Any, **k: Any):
        calls.append(tuple(a[1].shape))  # the LM-head weight as the op sees it: full [V, H] even under FSDP2
        return real_op(*a, **k)

    ops.logp_entropy = spy
    try:
        train_quietly(trainer)
    finally:
        ops.logp_entropy = real_op
    return finish(trainer, patched=report.to_dict(), completions=completions, op_calls=calls)


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "sft_cggr": sft_cggr,
    "sft_cggr_local_norm": sft_cggr_local_norm,
    "grpo_fused": grpo_fused,
    "sft_osft": sft_osft,
}


def single(case: str, out: Path) -> dict[str, Any]:
    """The reference: this process, no process group (call it without RANK / WORLD_SIZE in the environment),
    WORLD * PER_RANK rows per step."""
    out.mkdir(parents=True, exist_ok=True)
    return CASES[case]("single", out, WORLD * PER_RANK)


def run(rank: int, world: int, port: int, engine: str, cases: list[str], out: str) -> None:
    """``torch.multiprocessing.spawn`` entry: every case in turn on this rank; writes ``<case>_rank<r>.pt``."""
    torch.set_num_threads(1)
    init_env(rank, world, port)
    root = Path(out)
    for case in cases:
        work = root / case
        work.mkdir(parents=True, exist_ok=True)
        result = CASES[case](engine, work, PER_RANK)
        torch.save(result, root / f"{case}_rank{rank}.pt")
