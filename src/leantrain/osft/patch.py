"""The Trainer callback that runs the projection at the two points of the optimizer step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from .ops import Projector


class OSFTCallback(TrainerCallback):
    """Projects gradients after clipping and before ``optimizer.step()``, parameters right after it (sync steps)."""

    def __init__(self, projector: Projector, simple: Projector, fallback: Any) -> None:
        self.projector, self.simple, self.fallback = projector, simple, fallback

    def _run(self, fast: Callable[[], None], stock: Callable[[], None]) -> None:
        if self.projector.uses_collectives():
            fast()  # a fallback taken on one rank only would mismatch the collectives of the others: fail loudly
        else:
            self.fallback.call(fast, stock)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._run(self.projector.project_gradients, self.simple.project_gradients)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._run(self.projector.project_parameters, self.simple.project_parameters)
