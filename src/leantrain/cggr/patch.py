"""CGGR at run time: the router rides the training forward.

``compute_loss`` (wrapped on the trainer instance) clones the labels into a fresh inputs dict and leaves them in a
one-shot slot. A forward hook on decoder layer ``router_layers - 1`` takes that layer's detached output, scores the
tokens without autograd, and writes -100 into the slot's labels in place, before the loss (which runs after the
whole trunk) reads them. The slot is consumed once, so a gradient-checkpointing re-run never scores again.
Before the forward starts, compute_loss also copies the micro-batch's valid-label count to host memory without
blocking (``HostCount``); the hook waits for that copy only (queued ahead of the forward, so the GPU keeps running the
first layers meanwhile) and scores the valid positions alone, a static-size gather.
``get_batch_samples`` (wrapped too) sets ``num_items_in_batch`` to the exact kept count of the accumulation window,
counted by transformers' own ``_get_num_items_in_batch`` (so cross-device gathering stays the stock one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..fallback import RuntimeFallback
from ..models import DecoderParts
from . import ops as _ops
from .ops import IGNORE_INDEX, count_stand_in, groups_of, schedule_ratio, select_topk, targets_of


@dataclass
class Settings:
    ratio: float
    router_layers: int  # 1-based decoder layer whose output is scored (resolved: negative indices already mapped)
    scoring: str
    warmup: int
    schedule: str
    kept_only: bool  # the plain-Trainer loss path: LM head + CE on kept rows through `logits_to_keep`


class HostCount:
    """A device integer copied to (pinned) host memory without blocking; ``read`` waits for that copy only."""

    def __init__(self, value: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = value

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host)


@dataclass
class _Slot:
    """One micro-batch's selection job, filled by compute_loss and consumed by the hook."""

    targets: torch.Tensor  # [B, T'] view of the cloned labels, aligned with hidden positions 0..T'-1
    groups: torch.Tensor | None
    ratio: float
    head_index: torch.Tensor | None = None  # [B, K] hidden positions to project (kept-only loss, whole rows)
    head_mask: torch.Tensor | None = None  # [B, T] bool (kept-only loss, packed documents)
    n_valid: HostCount | None = None  # valid targets, copied to the host ahead of the forward
    done: bool = False


class Runtime:
    """Per-trainer CGGR state: the slot, the window's counts, and the statistics behind ``cggr/*`` logs."""

    def __init__(self, trainer: Any, parts: DecoderParts, settings: Settings, fallback: RuntimeFallback) -> None:
        self.trainer = trainer
        self.parts = parts
        self.settings = settings
        self.fallback = fallback
        self.slot: _Slot | None = None
        self.window: tuple[Any, Any] | None = None  # (kept count handed out, stock count) of the current window
        self._kept: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._score_ms: list[Any] = []
        self._generator: torch.Generator | None = None

    # ---- schedule -------------------------------------------------------------------------------------------
    def ratio_now(self) -> float:
        s = self.settings
        return schedule_ratio(self.trainer.state.global_step, s.ratio, s.warmup, s.schedule)

    # ---- the hook -------------------------------------------------------------------------------------------
    def hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        slot, self.slot = self.slot, None
        if slot is None:
            return
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        rows, width = slot.targets.shape
        if hidden.dim() != 3 or hidden.shape[0] != rows or hidden.shape[1] < width:
            raise RuntimeError(f"router hidden state {tuple(hidden.shape)} does not match labels {(rows, width)}")
        timer = self._start_timer(hidden.device)
        n_valid = slot.n_valid.read() if slot.n_valid is not None else None
        scores = _ops.score_tokens(self.parts, hidden, slot.targets, self.settings.scoring, n_valid=n_valid)
        self.select(slot, scores)
        self._stop_timer(timer)

    @torch.no_grad()
    def select(self, slot: _Slot, scores: torch.Tensor) -> None:
        valid = slot.targets != IGNORE_INDEX
        keep = select_topk(scores, valid, slot.groups, slot.ratio)
        slot.targets.masked_fill_(~keep, IGNORE_INDEX)
        if slot.head_index is not None:
            order = torch.argsort(keep.to(torch.uint8), dim=1, descending=True, stable=True)
            slot.head_index.copy_(order[:, : slot.head_index.shape[1]])
        if slot.head_mask is not None:
            slot.head_mask[:, : keep.shape[1]].copy_(keep)
        self._accumulate(keep.sum(), valid.sum())
        slot.done = True

    # ---- compute_loss ---------------------------------------------------------------------------------------
    def wrap_compute_loss(self, original):
        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
            ratio = self.ratio_now() if model.training else 1.0
            active = ratio < 1.0 and self.fallback.failed is None and "labels" in inputs
            # The window's stock count: a fallback in the middle of an accumulation window must divide the rest
            # of the window by the count of all labels, not by the kept count handed out at its start.
            window = self.window
            stock_items = window[1] if window is not None and num_items_in_batch is window[0] else num_items_in_batch
            if not active:
                if model.training and torch.is_tensor(inputs.get("labels")):
                    valid = targets_of(inputs) != IGNORE_INDEX
                    self._accumulate(valid.sum(), valid.sum())
                return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=stock_items)

            def stock(*_: Any) -> Any:
                return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=stock_items)

            args = (original, model, inputs, ratio, return_outputs, num_items_in_batch)
            return self.fallback.call(self._fast_loss, stock, *args)

        return compute_loss

    def _fast_loss(self, original, model, inputs, ratio, return_outputs, num_items_in_batch):
        batch = dict(inputs)
        for key in ("labels", "shift_labels"):
            if torch.is_tensor(batch.get(key)):
                batch[key] = batch[key].clone()
        targets = targets_of(batch)
        slot = _Slot(targets, groups_of(batch, targets.shape[1]), ratio)
        if self.settings.kept_only:
            self._prepare_head_selection(slot, batch)
        if self.settings.scoring == "random":
            self.select(slot, _ops.random_scores(tuple(targets.shape), self._rng(targets.device), targets.device))
        else:
            slot.n_valid = HostCount((targets != IGNORE_INDEX).sum())
            self.slot = slot
        try:
            if self.settings.kept_only:
                result = self._kept_only_loss(model, batch, slot, return_outputs, num_items_in_batch)
            else:
                result = original(model, batch, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        finally:
            self.slot = None
        if not slot.done:
            raise RuntimeError(f"decoder layer {self.settings.router_layers} did not run during the forward")
        return result

    def _prepare_head_selection(self, slot: _Slot, batch: dict) -> None:
        rows, width = slot.targets.shape
        if slot.groups is None:  # whole rows: the kept count per row is at most ceil(ratio * width), a static size
            bound = min(width, math.ceil(slot.ratio * width))
            slot.head_index = torch.zeros(rows, bound, dtype=torch.long, device=slot.targets.device)
        else:  # packed documents: no static bound, select with a mask (one host sync in the indexing)
            length = batch["input_ids"].shape[1] if "input_ids" in batch else width + 1
            slot.head_mask = torch.zeros(rows, length, dtype=torch.bool, device=slot.targets.device)

    def _kept_only_loss(self, model, batch, slot: _Slot, return_outputs, num_items_in_batch):
        """Trainer.compute_loss's default branch with the LM head and CE on kept rows only (same math, fewer rows)."""
        trainer = self.trainer
        model_inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        keep_arg = slot.head_index if slot.head_index is not None else slot.head_mask
        outputs = model(**model_inputs, logits_to_keep=keep_arg)
        if slot.head_index is not None:
            targets = slot.targets.gather(1, slot.head_index)
        else:
            targets = slot.targets[slot.head_mask[:, : slot.targets.shape[1]]]
        logits = outputs.logits.float()
        logits = logits.reshape(-1, logits.shape[-1])
        if num_items_in_batch is None:
            loss = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX)
        else:
            loss = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
            loss = loss / (
                num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            )
        aux_loss = getattr(outputs, "aux_loss", None)
        if aux_loss is not None:  # MoE load balancing, added like the model's own forward does with labels
            loss = loss + getattr(self.parts.model, "router_aux_loss_coef", 0.0) * aux_loss.to(loss.device)
        args = trainer.args
        if (
            args.average_tokens_across_devices
            and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func)
            and num_items_in_batch is not None
        ):
            scale = trainer.accelerator.num_processes // trainer.get_tp_size()
            loss = loss * (scale if args.n_gpu <= 1 else args.n_gpu)
        return (loss, outputs) if return_outputs else loss

    # ---- num_items_in_batch ---------------------------------------------------------------------------------
    def wrap_get_batch_samples(self, original):
        def get_batch_samples(epoch_iterator, num_batches, device):
            batches, count = original(epoch_iterator, num_batches, device)
            self.window = None
            ratio = self.ratio_now()
            if count is None or ratio >= 1.0 or self.fallback.failed is not None:
                return batches, count
            kept = self.fallback.call(self._kept_count, lambda *_: count, batches, ratio, device)
            self.window = (kept, count)
            return batches, kept

        return get_batch_samples

    def _kept_count(self, batches: list, ratio: float, device: torch.device) -> Any:
        stand_ins = []
        for batch in batches:
            targets = targets_of(batch)
            labels = count_stand_in(targets, groups_of(batch, targets.shape[1]), ratio)
            stand_ins.append({"labels": labels, "shift_labels": labels})
        return self.trainer._get_num_items_in_batch(stand_ins, device)

    # ---- logging --------------------------------------------------------------------------------------------
    def wrap_log(self, original):
        def log(logs, *args, **kwargs):
            if self._valid is not None and not any(key.startswith("eval_") for key in logs):
                logs = {**logs, **self.read_stats()}
            return original(logs, *args, **kwargs)

        return log

    def read_stats(self) -> dict[str, float]:
        """Kept fraction and mean scoring ms per micro-batch since the last call (the only host sync: once per log)."""
        kept, valid = self._kept.item(), self._valid.item()
        times = [_elapsed_ms(start, end) for start, end in self._score_ms]
        self._kept = self._valid = None
        self._score_ms = []
        stats = {"cggr/kept_fraction": kept / valid if valid else 1.0}
        stats["cggr/score_ms"] = sum(times) / len(times) if times else 0.0
        return stats

    def _accumulate(self, kept: torch.Tensor, valid: torch.Tensor) -> None:
        self._kept = kept if self._kept is None else self._kept + kept
        self._valid = valid if self._valid is None else self._valid + valid

    def _start_timer(self, device: torch.device) -> Any:
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _stop_timer(self, start: Any) -> None:
        if isinstance(start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._score_ms.append((start, end))
        else:
            self._score_ms.append((None, (time.perf_counter() - start) * 1e3))
        del self._score_ms[:-4096]  # bounded if nobody logs

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(int(getattr(self.trainer.args, "seed", 0)))
        return self._generator


def _elapsed_ms(start: Any, end: Any) -> float:
    if start is None:  # CPU: measured directly
        return end
    end.synchronize()
    return start.elapsed_time(end)
