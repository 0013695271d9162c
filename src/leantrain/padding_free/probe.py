"""The padding-free probe: is the trainer's collator TRL's language-modeling collator, batching padded rows (not
packed, more than one row a batch); does the model's attention keep packed rows apart from their position ids; does
the trainer count the loss's tokens after the shift (so the loss is normalized as for the padded batch); and does the
collator's padding-free output hold what that needs (checked on a two-row batch). Where CUDA runs the model in 16 bits,
the plan also swaps SDPA for flash attention over the rows' boundaries (``varlen_reasons``). Auto mode applies it with
that swap where the padded batches would carry ``AUTO_PADDING`` or more padding (``auto_rule``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..models import unwrap_model
from ..optimization import PatchContext, Readiness
from .ops import packed_batch_problems, packed_causal_attention, padding_share, varlen_kernel


# transformers builds the mask of packed rows from the position ids (masking_utils) for these
MASKED_FROM_POSITIONS = ("sdpa", "eager", "flex_attention")
# decoder families whose attention modules call the attention function with causal full attention (no sinks, no
# soft-capping), so flash attention over the rows' boundaries computes what SDPA over their mask does
VARLEN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
HALF = (torch.bfloat16, torch.float16)
# Auto mode turns padding-free batches on with the varlen plan where the padded batches would hold this share of
# padding or more. Measured on an H200 (Llama-3.2-1B LoRA, bf16, 4 rows a batch; benchmarks/results/padding_free*.md,
# one trainer alternating both): 0.94x a step at no padding (4 x 2048: flash attention over one 8192-token row
# against SDPA's per-row kernel), 1.12x at 46% padding (1.21x with compiled layers and offloaded checkpoints); the
# line between the two crosses 1.0 near 15%: 25% keeps a margin.
AUTO_PADDING = 0.25
MEASURED = "H200: 0.94x a step at no padding, 1.12x at 46% (Llama-3.2-1B LoRA, 4 rows a batch)"
LENGTH_SAMPLE = 1024  # rows whose lengths estimate the padding (evenly spaced over the dataset)


@dataclass(frozen=True)
class PaddingFreePlan:
    trainer: Any
    collator: Any  # TRL's DataCollatorForLanguageModeling, whose padding_free flag apply turns on
    trainer_flag: bool  # the trainer has its own padding_free attribute (SFTTrainer)
    attention: str  # the model's attention implementation
    varlen: bool  # SDPA swapped for flash attention over the rows' boundaries (``packed_attention``)
    why_not_varlen: str  # why not, where it is not (the report's detail)


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    collator = trainer.data_collator
    if type(collator).__name__ != "DataCollatorForLanguageModeling" or not hasattr(collator, "padding_free"):
        return Readiness.not_applicable(
            f"the trainer's collator is {type(collator).__name__}, not TRL's DataCollatorForLanguageModeling: "
            "padding_free switches that collator's batches"
        )
    if collator.padding_free:
        return Readiness.not_applicable("the trainer batches padding-free already (SFTConfig padding_free or packing)")
    if getattr(trainer.args, "packing", False):
        return Readiness.not_applicable("packing=True: the trainer packs rows itself")
    if trainer.args.per_device_train_batch_size < 2:
        return Readiness.not_applicable("one row a batch (per_device_train_batch_size=1): no padding to drop")
    model = unwrap_model(trainer.model)
    reasons = model_reasons(model) + count_reasons(trainer) + collator_reasons(collator)
    why_not = "; ".join(varlen_reasons(model, trainer.args))
    rule = auto_rule(why_not, trainer)
    if reasons:
        return Readiness.no(*reasons).with_auto_rule(rule)
    plan = PaddingFreePlan(
        trainer, collator, hasattr(trainer, "padding_free"), attention_of(model), not why_not, why_not
    )
    return Readiness(detail=describe(plan), plan=plan).with_auto_rule(rule)


def auto_rule(why_not_varlen: str, trainer: Any) -> str:
    """Why auto mode leaves padded batches (empty: it turns padding-free on): only with flash attention over the
    rows' boundaries, and only where the padded batches would carry ``AUTO_PADDING`` or more padding."""
    if why_not_varlen:
        return (
            f"padding-free batches are measured faster only with flash attention over the rows' boundaries, which "
            f"this run does not get ({why_not_varlen})"
        )
    sampling = getattr(trainer.args, "train_sampling_strategy", None) or (
        "group_by_length" if getattr(trainer.args, "group_by_length", False) else "random"
    )
    if sampling != "random":
        return (
            f"train_sampling_strategy={sampling!r}: auto mode estimates the padding of shuffled batches only "
            "(padding_free=True applies it)"
        )
    lengths = sampled_lengths(trainer.train_dataset)
    if lengths is None:
        return "the dataset's lengths are not known before training (no input_ids by index): padding unknown"
    share = padding_share(lengths, trainer.args.per_device_train_batch_size)
    if share < AUTO_PADDING:
        return (
            f"the padded batches would hold {share:.0%} padding (estimated from {len(lengths)} rows), under the "
            f"{AUTO_PADDING:.0%} from which padding-free batches are measured faster ({MEASURED})"
        )
    return ""


def sampled_lengths(dataset: Any) -> torch.Tensor | None:
    """Token counts of up to ``LENGTH_SAMPLE`` rows spread evenly over ``dataset`` (a sorted dataset is sampled
    whole), or None where rows cannot be read by index."""
    try:
        total = len(dataset)
        step = max(1, total // LENGTH_SAMPLE)
        lengths = [len(dataset[i]["input_ids"]) for i in range(0, total, step)][:LENGTH_SAMPLE]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None
    return torch.tensor(lengths) if lengths else None


def attention_of(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None))


def model_reasons(model: Any) -> list[str]:
    """Why the model's attention would not keep packed rows apart (or could not take position ids)."""
    attention = attention_of(model)
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params:
        return [f"{type(model).__name__}.forward takes no position_ids: packed rows would share one position range"]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return [f"{type(model).__name__}.forward takes no **kwargs for the collator's sequence boundaries"]
    if attention.startswith("flash_attention"):
        return []  # flash attention's varlen path reads the collator's sequence boundaries
    if attention not in MASKED_FROM_POSITIONS:
        return [f"attention {attention!r}: padding_free serves {', '.join(MASKED_FROM_POSITIONS)} and flash attention"]
    masking = sys.modules.get("transformers.masking_utils")
    module = sys.modules.get(type(model).__module__)
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return ["this transformers builds no masks of packed rows from position ids (masking_utils)"]
    if module is None or not hasattr(module, "create_causal_mask"):
        return [
            f"{type(model).__name__} does not build its mask with transformers' create_causal_mask: packed rows "
            "would attend to each other"
        ]
    return []


def count_reasons(trainer: Any) -> list[str]:
    """The trainer's token count for the loss must be the one of the padded batch: counted after the causal shift
    (the padding-free batch ignores every row's first label, which the shift drops from the padded one)."""
    counts = getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)
    if counts and getattr(trainer, "_loss_shifts_labels", None) is not True:
        return [
            "this transformers Trainer counts the loss's tokens before the causal shift: padding-free batches "
            "(every row's first label ignored) would scale the loss unlike padded ones"
        ]
    return []


def collator_reasons(collator: Any) -> list[str]:
    """The collator's padding-free output on two examples, checked by ``ops.packed_batch_problems``."""
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    try:
        out = dataclasses.replace(collator, padding_free=True)(examples)
    except Exception as error:  # a collator of another version or shape: say so rather than guess
        return [f"TRL's collator failed on a padding-free check batch ({type(error).__name__}: {error})"]
    problems = packed_batch_problems(out, [len(e["input_ids"]) for e in examples])
    return [f"TRL's padding-free batches do not train as padded ones: {p}" for p in problems]


def varlen_reasons(model: Any, args: Any) -> list[str]:
    """Why the model's SDPA would not be swapped for flash attention over the rows' boundaries (torch's
    ``varlen_attn``): it serves causal full attention without dropout on CUDA in 16 bits, checked here on the device
    against SDPA with the rows' mask (``varlen_check``); elsewhere the masks from the position ids stay."""
    config = getattr(model, "config", None)
    if attention_of(model) != "sdpa":
        return [f"attention {attention_of(model)!r}, not sdpa"]
    if getattr(config, "model_type", None) not in VARLEN_FAMILIES:
        return [f"model type {getattr(config, 'model_type', None)!r}: varlen serves {', '.join(VARLEN_FAMILIES)}"]
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return ["sliding-window attention"]
    if getattr(config, "attention_dropout", 0.0):
        return ["attention dropout"]
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    if weight is None or weight.device.type != "cuda":
        return ["the model is not on a CUDA device"]
    dtype = (
        weight.dtype if weight.dtype in HALF else torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    )
    if dtype is None:
        return [f"{weight.dtype} compute: flash attention runs in 16 bits"]
    problem = varlen_check(
        weight.device, dtype, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    return [problem] if problem else []


@functools.cache
def varlen_check(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Empty where torch's varlen flash attention runs here and agrees with SDPA over the rows' mask on a two-row
    batch (forward and gradients, within the rounding of ``dtype``); else why not."""
    kernel = varlen_kernel()
    if kernel is None:
        return "this torch has no torch.nn.attention.varlen.varlen_attn taking a scale"
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, 24, head_dim, device=device, dtype=dtype, requires_grad=True)
               for heads in (4, 2, 2))  # fmt: skip
    cu = torch.tensor([0, 9, 24], device=device, dtype=torch.int32)
    try:
        outs = [packed_causal_attention(q, k, v, cu, head_dim**-0.5, way) for way in (kernel, None)]
        grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in outs]
    except Exception as error:  # a kernel this GPU or build lacks: the masks stay
        return f"torch's varlen flash attention failed here ({type(error).__name__}: {str(error)[:200]})"
    tol = 16 * torch.finfo(dtype).eps
    pairs = [(outs[0], outs[1]), *zip(grads[0], grads[1])]
    if any((a.float() - b.float()).abs().max() > tol * b.float().abs().max() for a, b in pairs):
        return "torch's varlen flash attention disagrees with SDPA over the rows' mask on a check batch"
    return ""


def describe(plan: PaddingFreePlan) -> str:
    if plan.varlen:
        how = "SDPA swapped for flash attention over the rows' boundaries (torch's varlen_attn): no (T, T) mask"
    elif plan.attention.startswith("flash_attention"):
        how = "sequence boundaries"
    else:
        how = f"masks from the position ids; not varlen flash attention: {plan.why_not_varlen}"
    return f"{type(plan.collator).__name__}: each batch one row of real tokens; {plan.attention} attention ({how})"
