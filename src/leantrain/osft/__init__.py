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

Files: ``probe.py`` (readiness, which linears: the plan), ``convert.py`` (model surgery and the dense export),
``patch.py`` (the trainer callback), ``ops.py`` (the factored projection math), ``linear.py`` (``OSFTLinear``),
``_triton.py`` (the tf32x3 GEMM), ``distributed.py`` (FSDP2 sharding helpers).
"""

from __future__ import annotations

from typing import Any

from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from .convert import Conversion, convert, dense_state_dict, merge, osft_layers
from .distributed import fully_shard, shard_placement_fn
from .linear import OSFTLinear
from .ops import Projector, frozen_overlap
from .probe import default_patterns, plan_targets, probe


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
        from .patch import OSFTCallback

        return OSFTCallback
    raise AttributeError(name)


@register
class OSFT(Optimization):
    name = "osft"
    trainer_kinds = ("sft", "trainer", "grpo")
    off_by_default_why = "changes the model (SVD-factored linears, updates kept off the frozen subspace)"
    saved_weights = (
        "save_model() writes dense weights that stock from_pretrained loads (export_state_dict); the checkpoints "
        "train() writes keep the six factors per target, so resume_from_checkpoint resumes exactly"
    )

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe(trainer, ctx)

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
        from .patch import OSFTCallback

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
