"""The fused loss's probe: which loss path the trainer runs, the model whose forward serves it, the head's settings
and the measured dispatch: the plan ``apply`` executes.

Paths (what each replaces):

- ``trl_fused``: TRL >= 1.15's SFTTrainer, whose ``add_fused_lm_head`` forward (``fused_lm_head=True``) gives
  log-probs, entropies and ``is_top1`` to its own ``compute_loss`` (``nll`` and ``dft``); leantrain wraps that forward.
- ``chunked_nll``: TRL 1.4-1.14's ``loss_type="chunked_nll"`` (1.7-1.14's default) forward; leantrain wraps it.
- ``full_logits`` / ``dft``: TRL <= 1.14's ``loss_type="nll"`` (the model's own loss over ``[B, T, V]`` logits, then
  entropy and token accuracy from those logits) and ``"dft"`` (TRL's ``dft_loss`` over the same logits); leantrain
  replaces ``compute_loss`` with the same loss and metrics from its op.
- ``trainer``: a plain transformers Trainer on a causal LM (the model's own loss, ``num_items_in_batch``); leantrain
  serves the model's loss from its op inside the stock ``compute_loss``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import trl_head
from ..lm_head import ops
from ..models import data_parallel_reason, head_weight_reasons, is_peft_model, logit_transform, unwrap_model
from ..optimization import PatchContext, Readiness
from ..trl_head import HeadSettings
from . import dispatch


PATHS = ("trl_fused", "chunked_nll", "full_logits", "dft", "trainer")
# The loss each path replaces, as the dispatch rule names it
DISPATCH_PATH = {
    "trl_fused": "trl_fused",
    "chunked_nll": "chunked_nll",
    "full_logits": "full_logits",
    "dft": "full_logits",
    "trainer": "full_logits",
}
TRL_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")
# Read from TRL 1.4 - 1.14's sft_trainer.py: the fields of the chunked_nll forward's output class
_CHUNKED_FIELDS = ("num_correct_tokens", "entropy_sum", "num_valid_tokens", "aux_loss")
# How TRL <= 1.14's SFTTrainer.compute_loss computes its metrics from the full logits (its source says which)
_ENTROPY_OVER_ATTENTION = "torch.sum(per_token_entropy * attention_mask)"  # 0.x: every attended position
_ENTROPY_OVER_LABELS = "(per_token_entropy * mask).sum()"  # 1.x: the positions with a label
_ROUTER_LOGITS_INPUT = 'inputs["output_router_logits"] = True'
# TRL >= 1.15's SFTTrainer.compute_loss takes the fused log-probs only through a weighted sum (nll / dft)
_TRL_LINEAR_LOSS = (
    "per_token_loss = -outputs.log_probs",
    "per_token_loss = per_token_loss * outputs.log_probs.exp().detach()",
    "loss = per_token_loss.sum() /",
)


@dataclass(frozen=True)
class SftVariant:
    """How a TRL <= 1.14 SFTTrainer computes its loss and metrics from the full logits (read by the probe)."""

    entropy_scope: str  # "attention": every attended position (TRL 0.x); "labels": the labelled positions (1.x)
    router_input: bool  # compute_loss passes output_router_logits=True when the aux loss is on
    dft: bool  # loss_type="dft" (TRL's dft_loss) rather than the model's own loss
    dft_clamp: bool  # dft_loss clamps its normalizer to >= 1


@dataclass
class CePlan:
    """The probe's plan: the path, the model whose forward is wrapped, the head settings and the dispatch."""

    path: str
    model: nn.Module
    settings: HeadSettings
    head: str  # "frozen" or "trainable"
    dispatch_why: str
    dispatch: str = "leantrain"  # what the measured rule chose here: "leantrain", or "stock" (applied on request)
    variant: SftVariant | None = None  # full_logits / dft: how this TRL logs its metrics
    output_class: Any = None  # trl_fused / chunked_nll: TRL's output class
    moe: bool = False  # the model's forward takes output_router_logits (an MoE aux loss)
    aux_loss: Any = None  # full_logits / dft / trainer: the model module's load_balancing_loss_func
    reasons: list[str] = field(default_factory=list)


def base_model(trainer: Any) -> nn.Module:
    """The model instance whose forward the loss runs through: the PEFT base model, else the model itself."""
    model = trainer.model
    return model.get_base_model() if is_peft_model(model) else unwrap_model(model)


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    model = base_model(trainer)
    if _not_a_language_model(model):  # a classifier, an encoder: nothing here for the loss (strict ignores it)
        return Readiness.not_applicable(f"{type(model).__name__} is not a language model: no LM head, no LM loss")
    path = path_of(trainer, ctx.trainer_kind, model)
    if path not in PATHS:
        return Readiness.no(path).with_auto_rule(auto_rule(trainer, None, model))
    reasons = trainer_reasons(trainer, path) + model_reasons(model, path)
    if reasons:
        return Readiness.no(*reasons).with_auto_rule(auto_rule(trainer, path, model))
    plan = _plan(trainer, path, model)
    if plan.reasons:
        return Readiness.no(*plan.reasons).with_auto_rule(auto_rule(trainer, path, model, plan))
    verdict, plan.dispatch_why = _dispatch(trainer, path, model, plan.head, plan.settings)
    plan.dispatch = verdict
    if verdict == "stock":  # auto keeps the stock loss (not measured faster here); fused_ce=True applies the op anyway
        return Readiness.slower(_stock_evidence(path, plan.dispatch_why), detail(plan), plan)
    if getattr(trainer, "is_fsdp_enabled", False):  # the whole FSDP2 step measured slower with the op
        return Readiness.slower(_FSDP_EVIDENCE, detail(plan), plan)
    return Readiness(detail=detail(plan), plan=plan)


_FSDP_EVIDENCE = f"under FSDP the training step measured slower with the fused loss ({dispatch.FSDP2_EVIDENCE})"


def auto_rule(trainer: Any, path: str | None, model: nn.Module, plan: CePlan | None = None) -> str | None:
    """Where the probe found blockers: the auto rule's evidence as far as it can be read (None: auto mode would
    apply the op here), so that strict mode does not raise for an op auto mode would not apply anyway. Without a
    known path or a readable head only the device class decides; the head settings TRL could not give are read
    from the training arguments."""
    device = trainer.args.device.type
    measured_here = dispatch.device_reason(device)
    if measured_here:
        return _stock_evidence(path, measured_here)
    head = trl_head.head_shape(model)
    if path is None or head is None:
        return None
    cast = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    settings = plan.settings if plan is not None else HeadSettings(cast_lm_head_to_fp32=cast)
    trainable = "trainable" if getattr(head[0], "requires_grad", False) else "frozen"
    verdict, why = _dispatch(trainer, path, model, trainable, settings)
    if verdict == "stock":
        return _stock_evidence(path, why)
    return _FSDP_EVIDENCE if getattr(trainer, "is_fsdp_enabled", False) else None


def _dispatch(trainer: Any, path: str, model: nn.Module, head: str, settings: HeadSettings) -> tuple[str, str]:
    h, v = _head_shape(model)
    dtype = _dtype_name(trainer, settings)
    return dispatch.choose(DISPATCH_PATH[path], head, h, v, dtype, device=trainer.args.device.type)


def _stock_evidence(path: str | None, why: str) -> str:
    return f"{why} ({_replaced(path)})" if path is not None else why


def _not_a_language_model(model: nn.Module) -> bool:
    """A transformers model that cannot generate and has no LM head (a sequence classifier, an encoder). A causal LM
    whose head is hidden is a language model the loss cannot serve: its probe says why (declined, not absent)."""
    from transformers import GenerationMixin, PreTrainedModel

    if not isinstance(model, PreTrainedModel) or isinstance(model, GenerationMixin):
        return False
    try:
        return model.get_output_embeddings() is None
    except (AttributeError, NotImplementedError):
        return False


# ------------------------------------------------------------------------------------------------- the path
def path_of(trainer: Any, kind: str, model: nn.Module) -> str:
    """One of ``PATHS``, or the reason none serves this trainer."""
    if kind == "trainer":
        return "trainer"
    forward = model.__dict__.get("forward")
    if trl_head.find_code(forward, trl_head.FUSED_FORWARD) is not None:
        return "trl_fused"
    if trl_head.find_code(forward, trl_head.CHUNKED_FORWARD) is not None:
        return "chunked_nll"
    args = trainer.args
    if getattr(args, "use_liger_kernel", False):
        return (
            "use_liger_kernel=True: this TRL computes the SFT loss with Liger's fused linear cross-entropy, already "
            "without the full logits; set use_liger_kernel=False to use leantrain's fused loss"
        )
    if trl_head.trl_has_fused_head():
        return "TRL has add_fused_lm_head but the model's forward is not its fused head: TRL not recognised"
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type == "dft" and _is_trl_dft(trainer.compute_loss_func):
        return "dft"
    if loss_type == "nll":
        return "full_logits"
    return f"loss_type={loss_type!r} is not one leantrain serves (nll, chunked_nll, dft)"


def _is_trl_dft(func: Any) -> bool:
    module = sys.modules.get("trl.trainer.sft_trainer")
    return func is not None and func is getattr(module, "dft_loss", object())


def _replaced(path: str) -> str:
    return {
        "trl_fused": "TRL's own fused LM head",
        "chunked_nll": "TRL's chunked cross-entropy",
    }.get(path, "the full-logits loss")


# ------------------------------------------------------------------------------------------- the declines
def trainer_reasons(trainer: Any, path: str) -> list[str]:
    """What in the trainer's setup the fused loss cannot serve (each a sentence naming the next step)."""
    reasons = []
    if trainer.label_smoother is not None:
        reasons.append(
            "label_smoothing_factor > 0: label smoothing needs every logit (not implemented in the fused loss); "
            "set label_smoothing_factor=0 to use it"
        )
    if trainer.compute_loss_func is not None and not (path == "dft" and _is_trl_dft(trainer.compute_loss_func)):
        reasons.append(
            "a compute_loss_func is set: it receives the model's full logits, which the fused loss never builds; "
            "drop compute_loss_func (or fold it into a compute_loss override) to use it"
        )
    stock = _stock_compute_loss(path)
    if stock is not None and type(trainer).compute_loss is not stock:
        reasons.append(
            f"{type(trainer).__name__} overrides compute_loss: it may read the logits the fused loss does not return"
        )
    replicas = data_parallel_reason(trainer, "the fused loss's forward is bound to the original model")
    if replicas:
        reasons.append(replicas)
    reasons += _parallel_reasons(trainer)
    if getattr(trainer, "num_virtual_tokens", 0):
        reasons.append(
            "a prompt-learning PEFT adapter adds virtual tokens the metrics skip: not served by the fused loss"
        )
    if path in ("full_logits", "dft", "trainer") and getattr(trainer.args, "past_index", -1) >= 0:
        reasons.append("args.past_index >= 0 reads the model's outputs by position: set past_index=-1")
    return reasons


def _stock_compute_loss(path: str) -> Any:
    if path == "trainer":
        from transformers import Trainer

        return Trainer.compute_loss
    from trl import SFTTrainer

    return SFTTrainer.compute_loss


def _parallel_reasons(trainer: Any) -> list[str]:
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    reasons = []
    if pc is not None and bool(getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        reasons.append("sequence/context parallelism splits the labels across ranks: not served by the fused loss")
    get_tp = getattr(trainer, "get_tp_size", None)
    if callable(get_tp) and get_tp() > 1:
        reasons.append("tensor parallelism shards the LM head: not served by the fused loss")
    return reasons


def model_reasons(model: nn.Module, path: str) -> list[str]:
    config = model.config
    if getattr(config, "get_text_config", None) and config.get_text_config() is not config:
        return [
            f"{type(model).__name__} is a vision-language model: its forward merges image features into the "
            "decoder input; the fused loss serves text-only causal LMs"
        ]
    head = model.get_output_embeddings()
    if head is None:
        return [f"{type(model).__name__} has no output embeddings (LM head) the fused loss can read"]
    backbone = getattr(model, "base_model", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        return [f"{type(model).__name__} has no decoder trunk at `{model.base_model_prefix}`"]
    reasons = []
    if "_original_forward" in model.__dict__:
        # accelerate's mixed-precision forward (autocast) wraps the model once train() or evaluate() prepared it; a
        # wrapper installed over it would run the fused loss outside that autocast
        reasons.append(
            f"{type(model).__name__}.forward is already wrapped by accelerate (train() or evaluate() ran): call "
            "patch_trainer before the first train()"
        )
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        reasons.append("the LM head carries a PEFT adapter (LoRA on lm_head): remove 'lm_head' from target_modules")
    else:
        reasons += [f"{r}: the stock loss runs" for r in head_weight_reasons(getattr(head, "weight", None))]
    if path in ("full_logits", "dft", "trainer"):
        reasons += _own_loss_reasons(model, path)
    return reasons


def _own_loss_reasons(model: nn.Module, path: str) -> list[str]:
    """The full-logits paths reproduce the model's own forward: its loss function, its output scaling, its aux loss."""
    cls = type(model)
    forward = model.__dict__.get("forward")
    if forward is not None and "_original_forward" not in model.__dict__:
        name = getattr(forward, "__qualname__", type(forward).__name__)
        return [f"{cls.__name__}.forward is replaced on the instance ({name}): another library patches it"]
    reasons = []
    if path != "dft":  # TRL's dft_loss takes the logits, not the model's loss
        from transformers.loss.loss_utils import ForCausalLMLoss

        uses_loss_function = "self.loss_function(" in _source(cls.forward)
        if getattr(model, "loss_function", None) is not ForCausalLMLoss or not uses_loss_function:
            reasons.append(f"{cls.__name__}'s loss is not transformers' causal-LM cross-entropy (ForCausalLMLoss)")
    try:
        logit_transform(model.config)
    except ValueError as error:
        reasons.append(f"unknown output scaling: {error}")
    if "output_router_logits" in inspect.signature(cls.forward).parameters and _aux_loss_function(model) is None:
        reasons.append(f"{cls.__name__}: its module has no load_balancing_loss_func for the MoE aux loss")
    return reasons


def _source(func: Any) -> str:
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def _aux_loss_function(model: nn.Module) -> Any:
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


# ------------------------------------------------------------------------------------------------ the plan
def _plan(trainer: Any, path: str, model: nn.Module) -> CePlan:
    head = model.get_output_embeddings()
    trainable = bool(getattr(head.weight, "requires_grad", False))
    moe = "output_router_logits" in inspect.signature(type(model).forward).parameters
    plan = CePlan(path, model, HeadSettings(), "trainable" if trainable else "frozen", "", moe=moe)
    if path == "trl_fused":
        _read_trl_fused(plan, model, trainer)
    elif path == "chunked_nll":
        _read_trl_chunked(plan, model)
    else:
        scale, softcap = logit_transform(model.config)
        plan.settings = HeadSettings(logit_scale=scale, softcap=softcap, text_config=model.config)
        plan.aux_loss = _aux_loss_function(model)
        if path != "trainer":
            variant = sft_variant(trainer, path)
            if isinstance(variant, str):
                plan.reasons.append(variant)
            else:
                plan.variant = variant
    return plan


def _read_trl_fused(plan: CePlan, model: nn.Module, trainer: Any) -> None:
    settings = trl_head.fused_settings(model)
    if isinstance(settings, str):
        plan.reasons.append(settings)
        return
    extra = trl_head.outputs_reason(settings, TRL_FUSED_OUTPUTS)
    if extra:
        plan.reasons.append(extra)
    plan.settings = dataclasses.replace(settings, trl_loss_type=_trl_linear_loss(trainer))
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError:
        plan.reasons.append("trl.trainer.utils has no FusedCausalLMOutput: TRL not recognised")
        return
    plan.output_class = FusedCausalLMOutput
    _check_scaling(plan, model)


def _trl_linear_loss(trainer: Any) -> str | None:
    """TRL's loss type when its compute_loss sums the log-probs linearly (the op's scalar loss can then serve it),
    else None (per-token log-probs with their own gradient)."""
    from trl import SFTTrainer

    source = _source(SFTTrainer.compute_loss)
    loss_type = getattr(trainer.args, "loss_type", None)
    return loss_type if loss_type in ("nll", "dft") and all(m in source for m in _TRL_LINEAR_LOSS) else None


def _read_trl_chunked(plan: CePlan, model: nn.Module) -> None:
    fwd = trl_head.find_code(model.__dict__.get("forward"), trl_head.CHUNKED_FORWARD)
    names = trl_head.closure(fwd, trl_head.CHUNKED_CLOSURE)
    module = sys.modules.get(fwd.__module__)
    output_class = getattr(module, "_ChunkedCELMHeadOutput", None)
    fields = getattr(output_class, "__dataclass_fields__", {})
    if isinstance(names, str) or any(f not in fields for f in _CHUNKED_FIELDS):
        plan.reasons.append("TRL's chunked_nll forward changed (closure or output fields): TRL not recognised")
        return
    softcap = names["final_logit_softcapping"]
    plan.settings = HeadSettings(
        logit_scale=float(names["logit_scale"]),
        softcap=float(softcap) if softcap else None,
        text_config=names["text_config"],
    )
    plan.output_class = output_class
    _check_scaling(plan, model)


def _check_scaling(plan: CePlan, model: nn.Module) -> None:
    reason = trl_head.scaling_reason(plan.settings, model.config)
    if reason:
        plan.reasons.append(reason)


def sft_variant(trainer: Any, path: str) -> SftVariant | str:
    """How this TRL's SFTTrainer.compute_loss logs entropy and token accuracy from the full logits, or a reason."""
    from trl import SFTTrainer

    source = _source(SFTTrainer.compute_loss)
    if _ENTROPY_OVER_ATTENTION in source:
        scope = "attention"
    elif _ENTROPY_OVER_LABELS in source:
        scope = "labels"
    else:
        return "TRL's SFTTrainer.compute_loss logs its metrics in a way leantrain does not know: TRL not recognised"
    dft_clamp = "clamp(min=1)" in _source(getattr(sys.modules["trl.trainer.sft_trainer"], "dft_loss", None))
    return SftVariant(
        entropy_scope=scope, router_input=_ROUTER_LOGITS_INPUT in source, dft=path == "dft", dft_clamp=dft_clamp
    )


# ----------------------------------------------------------------------------------------------- the report
def _head_shape(model: nn.Module) -> tuple[int, int]:
    _, v, h = trl_head.head_shape(model)
    return h, v


def _dtype_name(trainer: Any, st: HeadSettings) -> str:
    """The logits tiles' dtype in training: fp32 when TRL casts the head, else the autocast dtype, else the head's."""
    args = trainer.args
    if st.cast_lm_head_to_fp32:
        dtype = torch.float32
    elif getattr(args, "bf16", False):
        dtype = torch.bfloat16
    elif getattr(args, "fp16", False):
        dtype = torch.float16
    else:
        dtype = base_model(trainer).get_output_embeddings().weight.dtype
    return str(dtype).removeprefix("torch.")


def kernel_name() -> str:
    return "triton" if torch.cuda.is_available() and ops.triton_available() else "torch chunked"


def detail(plan: CePlan) -> str:
    how = {
        "trl_fused": "TRL >= 1.15 fused LM head (add_fused_lm_head forward) wrapped",
        "chunked_nll": "TRL chunked_nll forward (_chunked_ce_forward) wrapped",
        "full_logits": "TRL SFTTrainer.compute_loss (nll over full logits) replaced",
        "dft": "TRL SFTTrainer.compute_loss (dft over full logits) replaced",
        "trainer": "Trainer.compute_loss with the model's causal-LM loss",
    }[plan.path]
    what = "loss" if plan.path == "trainer" else "loss, entropy and mean_token_accuracy"
    if plan.path == "trl_fused":
        what += "; the log-probs hold the op's scalar-loss gradient" if plan.settings.trl_loss_type else ""
    if plan.path in ("full_logits", "dft", "trainer"):
        what += "; an evaluation that reads logits runs the stock forward"
    model = plan.model
    tied = model.get_output_embeddings().weight is getattr(model.get_input_embeddings(), "weight", None)
    text = f"{how} ({what} from the fused op); {plan.head} {'tied ' if tied else ''}head; kernel: {kernel_name()}"
    # where the rule chose the stock loss, the report adds its evidence beside "applied on request" once
    return text + (f"; dispatch: {plan.dispatch_why}" if plan.dispatch == "leantrain" else "")
