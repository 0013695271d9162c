"""OSFT: orthogonal subspace fine-tuning (Nayak et al. 2025; reference implementation: mini_trainer).

``patch_trainer(trainer, osft=True, osft_unfrozen_rank_ratio=0.5, osft_targets=None)`` factors each target linear
into its thin SVD, freezes the top ``k_high = floor(min(N, M)·(1 − ratio))`` singular triplets and trains the rest,
keeping their gradients (before ``optimizer.step()``) and values (after it) orthogonal to the frozen subspace.

- Must run before the optimizer exists: a trainer that already has one is refused (its optimizer would hold the
  dense weights OSFT removes); build the trainer without ``optimizers=`` or patch before ``train()``.
- ``trainer.save_model()`` writes dense weights that stock ``from_pretrained`` loads; the checkpoints that
  ``train()`` writes hold the factors, so ``train(resume_from_checkpoint=...)`` after ``patch_trainer`` resumes.
- ``merge(model)`` turns the factors back into dense ``nn.Linear`` / ``Conv1D`` modules (weights rebuilt in fp32).
- ``unpatch_trainer`` puts the original module objects back, holding the merged (trained) weights: OSFT releases
  the dense weights when it factors them, so the original values come back only up to the reconstruction error.
- FSDP2: shard with :func:`fully_shard` (V factors on ``Shard(1)``: one flat all-reduce per step covers all U and V
  coefficients) or let accelerate shard (``Shard(0)``: V_high is all-gathered, in buckets); DDP needs nothing.
"""

from __future__ import annotations

from typing import Any

from .._registry import Applied, Optimization, PatchContext, Readiness, register
from ..models import unwrap_model
from .core import Conversion, convert, dense_state_dict, merge, osft_layers, plan_targets
from .distributed import fully_shard, shard_placement_fn
from .linear import OSFTLinear
from .projection import Projector, frozen_overlap
from .targets import default_patterns


__all__ = [
    "OSFT",
    "OSFTCallback",
    "OSFTLinear",
    "Conversion",
    "Projector",
    "convert",
    "dense_state_dict",
    "default_patterns",
    "frozen_overlap",
    "fully_shard",
    "merge",
    "osft_layers",
    "shard_placement_fn",
]


def __getattr__(name: str) -> Any:
    if name == "OSFTCallback":  # lazy: transformers' trainer stack is heavy to import (spawned workers, CLI)
        from .callback import OSFTCallback

        return OSFTCallback
    raise AttributeError(name)


def _readiness_problem(trainer: Any) -> str | None:
    if getattr(trainer, "optimizer", None) is not None:
        return (
            "the trainer already has an optimizer (passed with optimizers= or created by an earlier train()); it "
            "holds the dense weights that OSFT replaces: build the trainer without optimizers= and call "
            "patch_trainer before train()"
        )
    if getattr(trainer, "model_init", None) is not None:
        return "model_init re-creates the model inside train(), dropping the factored layers: pass model= instead"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed keeps gradients in its own partitions, out of reach of the projection: use FSDP2 or DDP"
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) != 2:
            return "FSDP1 flattens parameters, out of reach of the projection: use FSDP2 (fsdp_version: 2)"
    args = getattr(trainer, "args", None)
    if getattr(args, "use_vllm", False):
        return "vLLM weight sync needs dense weights and OSFT holds factors: set use_vllm=False"
    return None


@register
class OSFT(Optimization):
    name = "osft"
    trainer_kinds = ("sft", "trainer", "grpo")
    saved_weights = (
        "save_model() writes dense weights that stock from_pretrained loads (export_state_dict); the checkpoints "
        "train() writes keep the six factors per target, so resume_from_checkpoint resumes exactly"
    )

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        problem = _readiness_problem(trainer)
        if problem:
            return Readiness.no(problem)
        model = unwrap_model(trainer.model)
        named, skipped = plan_targets(model, ctx.config.osft_targets)  # unmatched user pattern: ValueError
        if not named:
            if skipped:
                name, why = next(iter(skipped.items()))
                return Readiness.no(f"no usable OSFT target: {name}: {why} ({len(skipped)} such)")
            config_obj = getattr(model, "config", None)
            return Readiness.not_applicable(
                f"no OSFT target linears in {type(model).__name__} (defaults for model type "
                f"{getattr(config_obj, 'model_type', '?')!r}: {', '.join(default_patterns(config_obj))}); "
                "pass osft_targets=[...] name patterns"
            )
        if any(hasattr(module.weight, "device_mesh") for _, module in named):
            return Readiness.no(
                "the model is already sharded (DTensor weights, e.g. loaded with tp_plan or a device mesh): OSFT "
                "must factor dense weights before sharding"
            )
        return Readiness(detail=f"{len(named)} target linears", plan=(named, skipped))

    def apply(self, trainer: Any, plan: tuple[list, dict], ctx: PatchContext) -> Applied:
        cfg = ctx.config
        conversion = convert(
            trainer.model,
            unfrozen_rank_ratio=cfg.osft_unfrozen_rank_ratio,
            targets=cfg.osft_targets,
            progress=trainer.is_world_process_zero(),
            planned=plan,
        )
        undo = ctx.undo
        # Any optimizer that exists at unpatch time was built on the factors: drop it so a later train() builds a
        # fresh one on the restored dense weights.
        undo.push(lambda: setattr(trainer, "optimizer", None) or setattr(trainer, "lr_scheduler", None))
        undo.extend(conversion.undo)
        layers = list(conversion.layers.values())
        precision = cfg.config.osft_projection_precision  # validated by the config at patch time
        from .callback import OSFTCallback

        projector = Projector(layers, precision=precision, cache_v_high=cfg.config.osft_cache_v_high)
        callback = OSFTCallback(projector, Projector(layers, batched=False), ctx.fallback)
        undo.add_callback(trainer, callback)
        short = sorted({name.rsplit(".", 1)[-1] for name in conversion.layers})
        detail = (
            f"{len(layers)} OSFTLinear ({', '.join(short)}), k_high = floor(min(N, M)·"
            f"{1 - cfg.osft_unfrozen_rank_ratio:.3g}), max reconstruction error {conversion.max_error:.2e} "
            f"(relative Frobenius, {layers[0].U_low.dtype if layers else 'n/a'} factors); factored projection "
            f"({precision} GEMMs for fp32 factors on CUDA) before and after optimizer.step(), batched, shard layout "
            "detected per step" + ("; gathered V_high cached" if cfg.config.osft_cache_v_high else "")
        )
        if conversion.skipped:
            detail += f"; skipped {len(conversion.skipped)}: " + "; ".join(
                f"{n}: {why}" for n, why in list(conversion.skipped.items())[:3]
            )
        return Applied(tuple(conversion.layers), detail)

    def export_state_dict(self, trainer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dense_state_dict(state_dict, trainer.model)
