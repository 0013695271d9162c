"""What ``apply`` executes: the model plan the probe returns (one :class:`Target` per experts module, with
everything apply needs), and what every layout's per-module plan is built with (``Layout.build_plan`` in the
``layout_*`` modules): host-side identities of tensors and quantization states, the device check, the per-call
guard that the module still holds what the plan was built from, and saving consolidated stacks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fallback import compiling
from ._stacks import Record, state_tensors
from .layouts import BlockRecipe, Found
from .ops import ExpertsPlan
from .saved import clone_shared_on_save


PlanFor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], ExpertsPlan]


@dataclass
class Target(Found):
    """One ready experts module and everything ``apply`` needs for it: which method of which module is replaced
    (``owner.hook``: the 4.x block's forward or DeepSeek-V2's ``moe``, the experts' forward, or under
    ``target_parameters`` LoRA the outermost ParamWrapper's forward), the block recipe (4.x), where its PEFT adapters
    are (``_adapters.AdapterSpec``), and recompute or saved stacks with the reason for the report."""

    owner: nn.Module = None  # type: ignore[assignment]
    hook: str = "forward"
    recipe: BlockRecipe | None = None
    adapters: Any = None  # _adapters.AdapterSpec | None
    recompute: bool = True
    recompute_why: str = ""


@dataclass
class ModelPlan:
    """What the probe hands to ``apply``: the targets, whether FSDP2 swaps their stacks per call, the report's
    detail."""

    targets: list[Target]
    detail: str
    fsdp2: bool = False


# ------------------------------------------------------------------------------ host-side identity and devices


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """Host-side identity of a tensor's storage: object, pointer, device, dtype, grad flag (attribute reads only:
    no device sync). No in-place version: DDP's start-up broadcast rewrites frozen parameters in place."""
    return None if t is None else (id(t), t.data_ptr(), t.device, t.dtype, t.requires_grad)


def state_key(qs) -> tuple | None:
    """A quantization state's identity, with the in-place versions of its tensors (not parameters, so no framework
    rewrites them; an in-place ``load_state_dict`` does, and a plan may hold padded copies of them)."""
    if qs is None:
        return None
    tensors = state_tensors(qs).values()
    versions = tuple(-1 if t.is_inference() else t._version for t in tensors)  # inference tensors have no counter
    return (id(qs), qs.dtype, getattr(qs, "packing_format_for_cpu", False), versions) + tuple(
        tensor_key(t) for t in tensors
    )


def device_mix_reason(tensors: dict[str, torch.Tensor]) -> str | None:
    """A reason when the tensors a dequantize / grouped GEMM reads are not all on one device (a CUDA kernel handed a
    foreign pointer is an illegal memory access, which no fallback survives). Smallest groups are named first."""
    by_device: dict[str, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(str(t.device), []).append(name)
    if len(by_device) < 2:
        return None
    groups = sorted(by_device.items(), key=lambda kv: len(kv[1]))
    where = "; ".join(
        f"{', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''} on {device}"
        for device, names in groups
    )
    return (
        f"4-bit expert tensors are on different devices ({where}): move the whole model with .to() / .cuda() "
        "(leantrain.quantize_experts_4bit stacks move their quantization state with it)"
    )


# ------------------------------------------------------------------------------------------ per-module plans


def _plan_device(plan: ExpertsPlan) -> torch.device:
    """The one device of every tensor the plan's kernels read (the probe declined device mixes; this re-asserts it
    before any kernel can see a foreign pointer)."""
    tensors = {}
    for label, proj in (("gate_up", plan.gate_up), ("down", plan.down)):
        tensors.update({f"{label} stack tensor {i}": t for i, t in enumerate(proj.stack.tensors())})
        if proj.bias is not None:
            tensors[f"{label} bias"] = proj.bias
    reason = device_mix_reason(tensors)
    if reason:
        raise RuntimeError(reason)
    return plan.gate_up.stack.data.device


class PlanCheck:
    """The per-call guard run before any kernel: the module still holds exactly the tensors the plan was built from
    (same objects, pointers, devices, dtypes, versions) and the inputs are on the plan's device. Host-side
    attribute reads only (no device sync). :meth:`unchanged` is the module half alone (no inputs needed): what a
    compiled layer runs eagerly before its compiled code (Dynamo cannot trace pointer and version reads)."""

    def __init__(self, plan: ExpertsPlan, snapshot: Callable[[], tuple], frozen: Callable[[], bool], what: str):
        self.device, self.base = _plan_device(plan), snapshot()
        self.snapshot, self.frozen, self.what = snapshot, frozen, what

    def unchanged(self) -> None:
        if self.snapshot() != self.base:
            if not self.frozen():
                raise RuntimeError(f"{self.what} were unfrozen after patching")
            raise RuntimeError(f"{self.what} were moved, cast, reloaded or replaced after patching")

    def __call__(self, hidden_states: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> None:
        self.unchanged()
        device = self.device
        if hidden_states.device != device or indices.device != device or weights.device != device:
            raise RuntimeError(
                f"experts inputs on {hidden_states.device} / {indices.device} / {weights.device}, experts on {device}"
            )


Check = PlanCheck


def make_check(plan: ExpertsPlan, snapshot: Callable[[], tuple], frozen: Callable[[], bool], what: str) -> Check:
    """The per-call check of a plan built from what ``snapshot`` reads (``frozen``: whether the stacks still are)."""
    return PlanCheck(plan, snapshot, frozen, what)


def clone_stacks_on_save(module: nn.Module, stacks: list, record: Record) -> None:
    """Consolidated experts share storage: ``saved.clone_shared_on_save`` over every buffer of the stacks."""
    buffers = [t for s in stacks for t in (s.data, s.absmax) if t is not None]
    buffers += [t for s in stacks if s.nested is not None for t in (s.nested.codes, s.nested.absmax2)]
    clone_shared_on_save(module, buffers, record)


def fixed(plan: ExpertsPlan, check: Callable) -> PlanFor:
    """A plan built at patch time, served after the per-call check (a moved model takes the stock path). While
    Dynamo traces, the check is skipped: its host-side reads cannot be traced, and a guard on the plan's tensors
    would not catch what it exists for (the plan holds the old tensors). A compiled layer runs
    :meth:`PlanCheck.unchanged` eagerly before its compiled code instead (``fallback.EAGER_CHECK_ATTR``)."""

    def plan_for(hidden_states, indices, weights):
        if not compiling():
            check(hidden_states, indices, weights)
        return plan

    return plan_for
