"""The layouts by name, in the order a module is recognized (a 4.x block holds its expert MLPs, so it is tried
first), and what dispatches on them: finding every experts module of a model, and the per-call plan of a target."""

from __future__ import annotations

from torch import nn

from . import layout_expert_mlps, layout_linear4bit, layout_stacked
from ._stacks import Record
from .layouts import Found, Layout
from .ops import ExpertsPlan
from .plan import Check, PlanFor, Target, fixed


LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (layout_expert_mlps.LAYOUT, layout_linear4bit.LAYOUT, layout_stacked.LAYOUT)
}


def layout_of(found: Found) -> Layout:
    return LAYOUTS[found.layout]


def find_experts(model: nn.Module) -> list[Found]:
    """Every experts module of any layout (structural: needs no bitsandbytes)."""
    found = []
    for name, module in model.named_modules():
        layout = next((layout for layout in LAYOUTS.values() if layout.matches(module)), None)
        if layout is not None:
            found.append(Found(name, module, layout.name))
    return found


def build_plan(found: Found, record: Record, recompute: bool) -> tuple[ExpertsPlan, Check]:
    """The plan for one ready module plus a cheap per-call check that the module was not changed under it and that
    the inputs are on its device: a moved model takes the stock path (run-time fallback), never a kernel with
    mixed devices."""
    return layout_of(found).build_plan(found.module, record, recompute)


def plan_provider(target: Target, fsdp2: bool, record: Record) -> tuple[PlanFor, Check | None]:
    """Per call, the plan for ``target``: built now (consolidating per-expert stacks, each restore step going to
    ``record``) and checked per call, or under FSDP2 rebuilt per call around the unsharded stacks; with the check
    (None under FSDP2, whose per-call plan checks what it reads)."""
    if fsdp2:
        return layout_of(target).live_plan(target.module, target.recompute), None
    plan, check = build_plan(target, record, target.recompute)
    return fixed(plan, check), check
