"""Dense SFT recipe: LoRA on every attention and MLP projection of a dense model (head frozen), bf16, activation
checkpointing, AdamW; TRL's SFTTrainer on its default loss path and a plain transformers Trainer (the model's own
loss over full ``[B, T, V]`` logits). Variants: stock; ``patch_trainer(trainer)`` with no arguments (whatever the
defaults apply: the report is recorded, never assumed); ``patch_trainer(trainer, layer_kernels=True)``; regional
``torch.compile`` of the decoder layers (a provider, not leantrain); Liger-Kernel through ``use_liger_kernel=True``.

Liger's own patch (applied by the trainer when ``train()`` starts) rebinds classes and ``apply_rotary_pos_emb`` in the
family's transformers modeling module for the whole process: its variant runs last in each group and the module's
names are put back afterwards, so no later variant runs Liger's code unknowingly."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .runner import (
    TOKENS,
    Budget,
    Variant,
    checkpointing,
    cleanup,
    filtered,
    log,
    run_group,
    selected,
    sft_trainer,
    token_dataset,
    trainer_args,
)
from .settings import Settings


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 2e-4
LIGER = "liger (use_liger_kernel)"


def build(spec: dict, s: Settings) -> torch.nn.Module:
    """A seeded random-init causal LM built on the device in the recipe's attention implementation."""
    import transformers

    config = getattr(transformers, spec["cls"])(**spec["fields"], **TOKENS)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=s.dtype, attn_implementation=spec["attention"]
        )
    return model.train()


def lora(s: Settings) -> Any:
    from peft import LoraConfig

    r = s.dense_lora_r
    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=LORA_TARGETS)


def sft_paths() -> list[tuple[str, dict[str, Any], str]]:
    """(config label, SFTConfig arguments, what the loss path is) for the installed TRL: 1.15+ runs its own fused
    LM head for ``nll`` (the default); 1.7-1.14 default to ``chunked_nll`` and keep ``nll`` on full logits; older
    releases take the full logits by default."""
    import trl.trainer.utils as trl_utils
    from trl import SFTConfig

    if hasattr(trl_utils, "add_fused_lm_head"):
        return [("sft", {}, "TRL's fused LM head (its default, nll)")]
    loss = {f.name: f for f in dataclasses.fields(SFTConfig)}.get("loss_type")
    if loss is not None and "chunked_nll" in repr(loss.metadata) + repr(loss.default):
        return [("sft", {}, "TRL's default (chunked_nll)"), ("sft nll logits", {"loss_type": "nll"}, "full logits")]
    return [("sft logits", {}, "full logits (TRL's default)")]


def plain_trainer(model: torch.nn.Module, data: Any, out: Path, steps: int, s: Settings, **extra: Any) -> Any:
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(0)  # the LoRA init: the same adapters in every variant (SFTTrainer seeds before it wraps the model)
    args = TrainingArguments(
        **trainer_args(out, steps, s),
        learning_rate=LR,
        per_device_train_batch_size=s.dense_batch,
        **checkpointing(s.cuda),
        **extra,
    )
    return Trainer(model=get_peft_model(model, lora(s)), args=args, train_dataset=data)


def compile_layers(backend: str) -> Callable[[Any], Any]:
    """The regional-compile provider: ``layer.compile()`` on every decoder layer of the built trainer's model."""

    def make(trainer: Any) -> Any:
        from leantrain.models import decoder_parts

        for layer in decoder_parts(trainer.model).layers:
            layer.compile(backend=backend)
        return trainer

    return make


@contextlib.contextmanager
def modeling_restored(model: torch.nn.Module) -> Iterator[None]:
    """Put back the names of ``model``'s transformers modeling module (and the loss module's cross-entropy) that a
    process-wide patch (Liger's) rebinds while the block runs."""
    from transformers.loss import loss_utils

    modeling = sys.modules[type(model).__module__]
    saved, cross_entropy = dict(vars(modeling)), loss_utils.nn.functional.cross_entropy
    try:
        yield
    finally:
        for name in [n for n in vars(modeling) if n not in saved]:
            delattr(modeling, name)
        changed = [n for n, v in saved.items() if vars(modeling).get(n) is not v]
        for name in changed:
            setattr(modeling, name, saved[name])
        loss_utils.nn.functional.cross_entropy = cross_entropy
        if changed:
            log(f"  restored {modeling.__name__}: {', '.join(changed)} (rebound by the previous variant)")


def patch_defaults(**options: Any) -> Callable[[Any], Any]:
    def patch(trainer: Any) -> Any:
        import leantrain

        return leantrain.patch_trainer(trainer, **options)

    return patch


def group_for(
    config: str, settings: dict, make: Callable[..., Any], s: Settings, compile_too: bool
) -> tuple[list[Variant], Variant]:
    """The variants of one (shape, trainer, loss path): leantrain and the providers against stock; Liger apart."""
    group = [
        Variant("dense_sft", config, "stock", "stock", None, make, settings=settings),
        Variant("dense_sft", config, "leantrain", "leantrain", "stock", make, patch_defaults(),
                settings={**settings, "patch": "patch_trainer(trainer)"}),
        Variant("dense_sft", config, "leantrain layer_kernels", "leantrain", "stock", make,
                patch_defaults(layer_kernels=True),
                settings={**settings, "patch": "patch_trainer(trainer, layer_kernels=True)"}),
    ]  # fmt: skip
    if compile_too:
        group.append(
            Variant("dense_sft", config, "regional compile", "reference", "stock",
                    lambda: compile_layers(s.dense_compile)(make()),
                    settings={**settings, "compile": f"layer.compile() per decoder layer, {s.dense_compile}"})
        )  # fmt: skip
    skip = None if s.cuda else "Liger-Kernel's kernels need CUDA (smoke run on the CPU)"
    liger = Variant("dense_sft", config, LIGER, "peer", "stock", lambda: make(use_liger_kernel=True),
                    settings={**settings, "use_liger_kernel": True}, skip=skip)  # fmt: skip
    return group, liger


def recipe_dense_sft(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    warmup, timed = s.dense_steps
    steps = warmup + timed
    records: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="recipes_dense_"))
    with _stand_ins(s):
        try:
            for shape, spec in selected(s.dense_shapes, args.shapes).items():
                records += _shape(shape, spec, s, budget, args, steps, tmp)
                cleanup()  # the shape's pristine model went with _shape's frame
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return records


def _shape(
    shape: str, spec: dict, s: Settings, budget: Budget, args: argparse.Namespace, steps: int, tmp: Path
) -> list[dict]:
    from datasets import Dataset

    pristine = build(spec, s)
    vocab = spec["fields"]["vocab_size"]
    tokens = token_dataset(vocab, steps * s.dense_batch, s.dense_seq)
    labeled = Dataset.from_dict({"input_ids": tokens["input_ids"], "labels": tokens["input_ids"]})
    size = f"{s.dense_batch}x{s.dense_seq}"
    base = dict(shape=shape, batch=s.dense_batch, seq=s.dense_seq, lr=LR, lora_r=s.dense_lora_r,
                lora_targets=",".join(LORA_TARGETS), checkpointing=s.cuda, attention=spec["attention"],
                optimizer="adamw_torch (default)")  # fmt: skip
    cases = []
    for label, sft_args, path in sft_paths():

        def make_sft(sft_args: dict = sft_args, **extra: Any) -> Any:
            return sft_trainer(
                copy.deepcopy(pristine), tokens, tmp, steps, s, peft_config=lora(s), learning_rate=LR,
                per_device_train_batch_size=s.dense_batch, max_length=s.dense_seq, **checkpointing(s.cuda),
                **sft_args, **extra,
            )  # fmt: skip

        settings = {**base, "trainer": "SFTTrainer", "loss_path": path, **sft_args}
        cases.append((f"{shape} {label} {size}", settings, make_sft, label == "sft"))

    def make_plain(**extra: Any) -> Any:
        return plain_trainer(copy.deepcopy(pristine), labeled, tmp, steps, s, **extra)

    settings = {**base, "trainer": "Trainer", "loss_path": "the model's own loss over full logits (fp32 upcast)"}
    # the plain Trainer first: the budget projects a group from the longest variant so far, and the compile
    # provider (last of the SFT group) would make every later group look too long
    cases.insert(0, (f"{shape} trainer logits {size}", settings, make_plain, False))
    records = []
    for config, settings, make, compile_too in cases:
        group, liger = group_for(config, settings, make, s, compile_too)
        records += run_group(filtered(group, args.only), s.dense_steps, s, budget)
        torch._dynamo.reset()  # the compiled layers of this group are not reused by the next
        with modeling_restored(pristine):
            records += run_group(filtered([liger], args.only), s.dense_steps, s, budget)
    return records


@contextlib.contextmanager
def _stand_ins(s: Settings) -> Iterator[None]:
    """The smoke run on the CPU: the layer kernels' torch stand-ins (testkit/layer_kernels_refs.py; Liger's kernels
    are CUDA-only), so leantrain's variants run the same code paths they run on the GPU."""
    if s.cuda:
        yield
        return
    from testkit.layer_kernels_refs import emulated

    with emulated():
        yield
