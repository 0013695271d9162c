"""Worker for the 2-process trainer tests (gloo, CPU): a tiny TRL SFT with CGGR, a GRPO step with fused log-probs
(and stock, as the DeepSpeed reference), an OSFT SFT and a plain Trainer on a tiny 4-bit MoE (moe4bit), under
accelerate's DDP (MULTI_CPU), FSDP2 or DeepSpeed ZeRO-2 / ZeRO-3, patched with ``leantrain.patch_trainer`` before
``train()`` wraps the model. With engine "single" (no process group) the same code is the single-process reference
on the same global batch: one process with ``WORLD * PER_RANK`` rows per step vs ``WORLD`` ranks with ``PER_RANK``.

Each case returns plain data: per-step loss and grad norm, full (gathered) parameters after ``STEPS`` optimizer
steps, the leantrain report after training (``patched``: at patch time, or the ``NotReadyError`` of a decline), and
case-specific records (CGGR label masks and ``num_items_in_batch``, GRPO completions, fused-op calls and the LM
head's layout, grouped MoE calls and the packed stacks' layout).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from testkit.optimizations import only


STEPS = 2
WORLD = 2
PER_RANK = 2  # SFT rows / GRPO completions per rank and step; the single-process run takes WORLD * PER_RANK
SEQ = 64  # SFT max_length: 4 of the 8 texts are shorter, so ranks hold different label counts at every step
COMPLETION = 8
BETA = 0.1  # GRPO's KL weight: > 0, so TRL builds (and DeepSpeed wraps) a reference model
LAYER_CLS = "LlamaDecoderLayer"
MOE_LAYER_CLS = "Qwen3MoeDecoderLayer"
MOE_VOCAB, MOE_SEQ, MOE_LAYERS = 256, 16, 2
ZERO_STAGES = {"zero2": 2, "zero3": 3}  # DeepSpeed engines


def deepspeed_config(stage: int) -> dict[str, Any]:
    """fp32 ZeRO on CPU; "auto" fields are filled from TrainingArguments (batch size, accumulation, clipping).
    ZeRO-3 keeps parameters under ``stage3_param_persistence_threshold`` elements (default 1e5) whole after their
    first gather: 0 partitions every parameter of the tiny models, as the large ones of a real model are."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
    }


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
    from leantrain.cli.tiny import corpus_texts

    texts = corpus_texts()
    sizes = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    long = [t for t, n in zip(texts, sizes) if n > SEQ + 16]
    short = [t for t, n in zip(texts, sizes) if n < SEQ - 8]
    # step 1: rank 0 (long, long), rank 1 (short, long); step 2: rank 0 (short, short), rank 1 (long, short)
    return [long[0], long[1], short[0], long[2], short[1], short[2], long[3], short[3]]


def common_args(engine: str, out: Path, batch: int, layer_cls: str = LAYER_CLS) -> dict[str, Any]:
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
        enable_fsdp_on_cpu(layer_cls)
        args.update(
            fsdp=True,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer_cls]},
            accelerator_config={"use_configured_state": True},
        )
    elif engine in ZERO_STAGES:
        args.update(deepspeed=deepspeed_config(ZERO_STAGES[engine]))
    return args


def start(config: Any, engine: str) -> None:
    """Set up the process group from the arguments, before any model is built. DeepSpeed on CPU: accelerate's
    ``PartialState(cpu=True)`` starts gloo but not ``deepspeed.comm``, and ZeRO-3's ``zero.Init`` (active while
    building a model once ``TrainingArguments(deepspeed=...)`` exists) would then partition over a world of 1."""
    _ = config.device
    if engine in ZERO_STAGES:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")


def enable_fsdp_on_cpu(layer_cls: str = LAYER_CLS) -> None:
    """accelerate 1.15 turns a FSDP plugin into ``DistributedType.FSDP`` only for GPU-like process groups; on CPU
    (MULTI_CPU, gloo) it drops the plugin silently and trains with DDP. So configure the shared state first,
    promoted to FSDP with the plugin the trainer would build, and let the trainer adopt it
    (``accelerator_config={"use_configured_state": True}``, a TrainingArguments option). From there on it is the
    stock FSDP2 path: fully_shard per decoder layer and root, DTensor parameters, optimizer built after prepare,
    clip_grad_norm over DTensors, TRL's prepare_fsdp for the GRPO reference model."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = Accelerator(cpu=True).state
    if state.distributed_type is not DistributedType.FSDP or state.fsdp_plugin.transformer_cls_names_to_wrap != [
        layer_cls
    ]:
        # both singletons: every AcceleratorState() re-reads the process-level fields from PartialState
        PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="TRANSFORMER_BASED_WRAP",
            transformer_cls_names_to_wrap=layer_cls,
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
            state_dict_type="FULL_STATE_DICT",
        )


def tiny_llama(tokenizer) -> Any:
    from leantrain.cli.tiny import tiny_model

    return tiny_model("llama", seed=0, vocab_size=len(tokenizer), hidden=64, layers=4).train()


def save_tiny_llama(out: Path, tokenizer) -> Path:
    """Save the seeded model (with its tokenizer) and return the path the trainers load it from.

    Before the training arguments and once (rank 0; RANK is set before any process group exists): under ZeRO-3 the
    arguments turn on zero.Init, whose model constructor is a collective that rank 0 alone would hang in, and a
    model built under it draws its initial weights differently from a plain one. Loaded by path (as TRL loads
    GRPO's reference model, beta > 0), the trainer's model is built under zero.Init with the saved weights: its
    parameters are partitioned from the start, as in a real ZeRO-3 fine-tune. Callers wait for rank 0 once the
    process group is up (``PartialState().wait_for_everyone()``)."""
    path = out / "init-model"
    if int(os.environ.get("RANK", "0")) == 0:
        tiny_llama(tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def full_params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor: FSDP2 DTensor shards and ZeRO-3 partitions gathered (collectives: all ranks
    call it)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with zero3_gathered(list(model.parameters())):
        out = {}
        for name, param in model.named_parameters():
            value = param.detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            out[name] = value.clone()
    return out


def zero3_gathered(params: list[torch.Tensor]):
    """DeepSpeed's gather of ZeRO-3 partitioned ``params`` (read only), a no-op context for any other parameter."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


def partition(trainer, name: str) -> dict[str, Any]:
    """How ``name`` is stored on this rank after training: local shape, and DeepSpeed's full element count (ZeRO-3
    partitions: the local tensor is empty outside a gather, the rank's slice is ``ds_tensor``)."""
    param = trainer.accelerator.unwrap_model(trainer.model_wrapped).get_parameter(name)
    local = getattr(param, "ds_tensor", None)
    return {
        "shape": tuple(param.shape),
        "requires_grad": param.requires_grad,
        "ds_status": str(getattr(param, "ds_status", None)),
        "ds_numel": getattr(param, "ds_numel", None),
        "ds_shape": tuple(param.ds_shape) if hasattr(param, "ds_shape") else None,
        "slice": None if local is None else local.numel(),
    }


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
        "zero_stage": zero_stage(trainer),
        **extra,
    }


def zero_stage(trainer) -> int | None:
    plugin = trainer.accelerator.state.deepspeed_plugin if trainer.is_deepspeed_enabled else None
    return None if plugin is None else plugin.zero_stage


def patch(trainer, **options: Any) -> dict[str, Any]:
    """``leantrain.patch_trainer`` with the optimization under test required: the report as a dict, or, where it is
    not ready (it raises ``NotReadyError`` and leaves the trainer untouched), ``{"declined": message}``: training
    then runs stock, as it would for a user who catches the error."""
    import leantrain

    try:
        return leantrain.patch_trainer(trainer, **options).to_dict()
    except leantrain.NotReadyError as error:
        return {"declined": str(error)}


def train_quietly(trainer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


# ---- SFT (CGGR / OSFT) -------------------------------------------------------------------------------------------
def sft_trainer(engine: str, out: Path, batch: int, **overrides: Any):
    from accelerate import PartialState
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from leantrain.cli.tiny import train_tokenizer

    tokenizer = train_tokenizer()
    args = common_args(engine, out, batch)
    args.update(max_length=SEQ, train_sampling_strategy="sequential", **overrides)
    path = save_tiny_llama(out, tokenizer)
    config = SFTConfig(**args)
    start(config, engine)
    PartialState().wait_for_everyone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(
            model=str(path),
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
    trainer = sft_trainer(engine, out, batch, **overrides)
    patched = patch(trainer, **only("cggr"), cggr_warmup_steps=0, cggr_min_tokens_ratio=0.5)
    records = record_cggr(trainer)
    train_quietly(trainer)
    return finish(trainer, patched=patched, **records)


def sft_cggr_local_norm(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """Negative control: each rank normalizes by its own label count (average_tokens_across_devices=False)."""
    return sft_cggr(engine, out, batch, average_tokens_across_devices=False)


def sft_stock(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """Unpatched SFT: what a declined optimization must leave."""
    trainer = sft_trainer(engine, out, batch)
    train_quietly(trainer)
    return finish(trainer)


def sft_fused_ce(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """SFT with the fused LM-head loss alone; counts the fused op's calls (every micro-batch's loss)."""
    from leantrain.lm_head import ops

    trainer = sft_trainer(engine, out, batch)
    patched = patch(trainer, **only("fused_ce"))
    calls: list[str] = []
    real = {name: getattr(ops, name) for name in ("token_stats", "head_loss")}
    for name, fn in real.items():

        def spy(*args: Any, _fn: Callable = fn, _name: str = name, **kwargs: Any):
            calls.append(_name)
            return _fn(*args, **kwargs)

        setattr(ops, name, spy)
    try:
        train_quietly(trainer)
    finally:
        for name, fn in real.items():
            setattr(ops, name, fn)
    return finish(trainer, patched=patched, fused_calls=calls)


CHECKPOINTED = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}


def sft_checkpointed(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """Unpatched SFT with activation checkpointing: what the offloaded checkpoints must equal."""
    trainer = sft_trainer(engine, out, batch, **CHECKPOINTED)
    train_quietly(trainer)
    return finish(trainer)


def sft_offload(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """SFT with activation checkpointing and offload_checkpoints alone; counts the inputs the hooks moved."""
    from leantrain.offload_checkpoints import stats

    trainer = sft_trainer(engine, out, batch, **CHECKPOINTED)
    patched = patch(trainer, **only("offload_checkpoints"))
    train_quietly(trainer)
    live = stats(trainer)
    return finish(trainer, patched=patched, packed=live.packed if live is not None else 0)


def sft_osft(engine: str, out: Path, batch: int) -> dict[str, Any]:
    from leantrain.osft import frozen_overlap, osft_layers

    trainer = sft_trainer(engine, out, batch)
    patched = patch(trainer, **only("osft"))
    train_quietly(trainer)
    trainable = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    layers = osft_layers(trainer.model).values()
    overlap = max((frozen_overlap(layer) for layer in layers), default=None)  # a collective if sharded
    return finish(trainer, patched=patched, trainable=trainable, overlap=overlap)


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


def grpo_trainer(engine: str, out: Path, batch: int, completions: list, generate: bool = False):
    """A GRPO trainer on the tiny Llama; its completions come from ``fixed_rollout`` (every engine scores the same
    ones), or, with ``generate``, from the model's own sampling (recorded in ``completions`` as texts)."""
    from accelerate import PartialState
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from leantrain.cli.tiny import corpus_texts, train_tokenizer

    tokenizer = train_tokenizer()
    tokenizer.padding_side = "left"
    path = save_tiny_llama(out, tokenizer)  # beta > 0: TRL loads the reference model by the policy's path
    args = common_args(engine, out, batch)
    args.update(
        num_generations=2,  # divides PER_RANK: a group never straddles ranks (TRL's RepeatSampler keeps it whole)
        max_completion_length=COMPLETION,
        beta=BETA,
        temperature=0.7,
        shuffle_dataset=False,
    )
    config = GRPOConfig(**args)
    start(config, engine)
    PartialState().wait_for_everyone()  # the saved model is complete
    prompts = [" ".join(t.split()[:8]) for t in corpus_texts()[: STEPS * WORLD * PER_RANK // 2]]

    record = completions

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        record.extend(completions)
        return letters_reward(completions)

    rollout = {} if generate else {"rollout_func": fixed_rollout(completions)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model=str(path),
            reward_funcs=reward if generate else letters_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            **rollout,
        )


def grpo_stock(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """TRL's own fused head, unpatched: the reference under DeepSpeed (TRL gathers the ZeRO-3 head itself)."""
    completions: list = []
    trainer = grpo_trainer(engine, out, batch, completions)
    train_quietly(trainer)
    return finish(trainer, completions=completions, head=partition(trainer, "lm_head.weight"))


def grpo_generate(engine: str, out: Path, batch: int, compiled: bool = False) -> dict[str, Any]:
    """GRPO sampling its own completions: stock generate, or (``compiled``) compile_generation on every rank, each
    compiling its own decode step (``aot_eager``: the same ops as eager, so the same tokens)."""
    from leantrain.compile_generation import stats

    completions: list = []
    trainer = grpo_trainer(engine, out, batch, completions, generate=True)
    options = {**only("compile_generation"), "compile_generation_backend": "aot_eager"}
    patched = patch(trainer, **options) if compiled else None
    train_quietly(trainer)
    counts = stats(trainer)
    compiles = None if counts is None else (counts.compiles, counts.calls)
    return finish(trainer, patched=patched, completions=completions, compiles=compiles)


def grpo_compiled_generate(engine: str, out: Path, batch: int) -> dict[str, Any]:
    return grpo_generate(engine, out, batch, compiled=True)


def grpo_fused(engine: str, out: Path, batch: int) -> dict[str, Any]:
    from leantrain.lm_head import ops

    completions: list = []
    trainer = grpo_trainer(engine, out, batch, completions)
    patched = patch(trainer, **only("grpo_logps"))
    calls: list = []
    recomputes: list = []
    real_op, real_recompute = ops.logp_entropy, ops._backward_recompute

    def spy(*a: Any, **k: Any):
        calls.append(tuple(a[1].shape))  # the LM-head weight as the op sees it: full [V, H] even under FSDP2 / ZeRO-3
        return real_op(*a, **k)

    def spy_recompute(*a: Any, **k: Any):
        recomputes.append(tuple(a[1].shape))  # the weight in the backward recompute (trainable head): full again
        return real_recompute(*a, **k)

    ops.logp_entropy, ops._backward_recompute = spy, spy_recompute
    try:
        train_quietly(trainer)
    finally:
        ops.logp_entropy, ops._backward_recompute = real_op, real_recompute
    return finish(
        trainer,
        patched=patched,
        completions=completions,
        op_calls=calls,
        recompute_calls=recomputes,
        head=partition(trainer, "lm_head.weight"),
    )


# ---- MoE with 4-bit experts (moe4bit) ----------------------------------------------------------------------------
def moe_model() -> Any:
    """Tiny Qwen3-MoE (6 experts, top-2), expert stacks quantized to frozen packed nf4 (uint8 parameters): hidden 128
    and expert intermediate 64, whole numbers of 64-element blocks per expert. Built before the training arguments
    exist, so never under ZeRO-3's zero.Init (which would leave no 3-D stacks to quantize)."""
    import leantrain
    from leantrain.cli.tiny import tiny_model

    model = tiny_model("qwen3_moe", seed=0, hidden=128, layers=MOE_LAYERS, vocab_size=MOE_VOCAB)
    model.set_experts_implementation("eager")  # the stock per-expert loop (the fallback)
    leantrain.quantize_experts_4bit(model)
    return model.train()


def moe_skip_reason() -> str | None:
    """Why the MoE case cannot run here: no bitsandbytes, or transformers without 3-D experts."""
    import importlib.util

    from leantrain._compat import TRANSFORMERS_3D_EXPERTS, needs

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes not installed"
    return needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D experts and set_experts_implementation")


def moe_rows() -> list[dict[str, torch.Tensor]]:
    """STEPS * WORLD * PER_RANK equal-length rows: every layout holds the same number of labels per row."""
    ids = torch.randint(3, MOE_VOCAB, (STEPS * WORLD * PER_RANK, MOE_SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def packed_stacks(trainer) -> dict[str, dict[str, Any]]:
    """How each packed expert stack is held on this rank after training: class, dtype, grad flag, global and local
    shape (FSDP2 DTensor: this rank's shard; ZeRO-3: DeepSpeed's partition)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    out = {}
    for name, param in model.named_parameters():
        if name.endswith(".original"):
            local = param.to_local() if hasattr(param, "to_local") else getattr(param, "ds_tensor", param)
            out[name] = {
                "type": type(param).__name__,
                "dtype": str(param.dtype),
                "requires_grad": param.requires_grad,
                "shape": tuple(param.shape),
                "ds_shape": tuple(param.ds_shape) if hasattr(param, "ds_shape") else None,
                "ds_status": str(getattr(param, "ds_status", None)),
                "local_numel": local.numel(),
            }
    return out


def moe4bit(engine: str, out: Path, batch: int) -> dict[str, Any]:
    """A plain transformers Trainer on the 4-bit MoE, patched with moe4bit; counts the grouped path's calls."""
    import transformers

    from leantrain.moe4bit import ops as _grouped  # the grouped math (was _grouped.py)

    model = moe_model()
    args = common_args(engine, out, batch, layer_cls=MOE_LAYER_CLS)
    args.update(train_sampling_strategy="sequential")
    config = transformers.TrainingArguments(**args)
    start(config, engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=config, train_dataset=moe_rows())
    grouped: list = []
    real = _grouped.grouped_forward

    def spy(plan: Any, hidden: torch.Tensor, *a: Any, **k: Any):
        grouped.append(tuple(hidden.shape))
        return real(plan, hidden, *a, **k)

    _grouped.grouped_forward = spy  # read when the patch is applied: the patched forward calls the spy
    try:
        patched = patch(trainer, **only("moe4bit"))
    finally:
        _grouped.grouped_forward = real
    train_quietly(trainer)
    return finish(trainer, patched=patched, grouped_calls=grouped, stacks=packed_stacks(trainer))


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "sft_cggr": sft_cggr,
    "sft_cggr_local_norm": sft_cggr_local_norm,
    "sft_fused_ce": sft_fused_ce,
    "grpo_fused": grpo_fused,
    "sft_osft": sft_osft,
    "sft_stock": sft_stock,
    "sft_checkpointed": sft_checkpointed,
    "sft_offload": sft_offload,
    "grpo_stock": grpo_stock,
    "grpo_generate": grpo_generate,
    "grpo_compiled_generate": grpo_compiled_generate,
    "moe4bit": moe4bit,
}


def single(case: str, out: Path) -> dict[str, Any]:
    """The reference: this process, no process group (call it without RANK / WORLD_SIZE in the environment),
    WORLD * PER_RANK rows per step."""
    out.mkdir(parents=True, exist_ok=True)
    return CASES[case]("single", out, WORLD * PER_RANK)


def forget_deepspeed_config() -> None:
    """Drop the previous case's ZeRO-3 setting: transformers keeps a reference to the last DeepSpeed config (alive as
    long as accelerate's state holds it), and a model built while it says ZeRO-3 is built under zero.Init."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def rank_log(out: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its stderr: C++ aborts ("terminate called ...") and faulthandler's Python stacks."""
    return out / f"rank{rank}.log"


def log_stderr(path: Path) -> None:
    """Send this process's stderr (file descriptor 2, so native code's messages too) to ``path`` and dump every
    thread's Python stack there on a fatal signal: a rank killed by SIGABRT/SIGSEGV says where it was."""
    log = open(path, "w", buffering=1)  # noqa: SIM115 (open for the life of the process)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(all_threads=True)


def end_process_group() -> None:
    """Leave together: a rank that exits while its peer's gloo connections are still open can make the peer's gloo
    thread throw on the closed socket and abort it. A barrier, then an orderly shutdown on every rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def save_atomically(result: dict[str, Any], path: Path) -> None:
    """A result file exists only whole: the parent reads an existing file as a finished case."""
    partial = path.with_suffix(".partial")
    torch.save(result, partial)
    partial.replace(path)


def run(rank: int, world: int, port: int, engine: str, cases: list[str], out: str) -> None:
    """``torch.multiprocessing.spawn`` entry: every case in turn on this rank; writes ``<case>_rank<r>.pt``."""
    root = Path(out)
    log_stderr(rank_log(root, rank))
    torch.set_num_threads(1)
    init_env(rank, world, port)
    for case in cases:
        forget_deepspeed_config()
        work = root / case
        work.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        result = CASES[case](engine, work, PER_RANK)
        result["seconds"] = time.perf_counter() - began
        save_atomically(result, root / f"{case}_rank{rank}.pt")
    end_process_group()
