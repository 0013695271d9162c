"""MoE experts layouts: what they share (the found module, the interface every layout implements) and the structure
they are recognized by (no bitsandbytes needed).

Three layouts, one module each behind :class:`Layout` (``registry.LAYOUTS`` by name, in recognition order):
- ``expert_mlps`` (``layout_expert_mlps``): transformers 4.x sparse MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral,
  OLMoE, DeepSeek-V2): an ``experts`` ModuleList of gated MLPs (``gate_proj``/``up_proj``/``down_proj`` or Mixtral's
  ``w1``/``w3``/``w2``) next to the block's ``gate`` router; ``BitsAndBytesConfig(load_in_4bit=True)`` makes each
  projection a ``bnb.nn.Linear4bit``. The found module is the block (its forward, or DeepSeek-V2's ``moe``, is what
  gets replaced).
- ``linear4bit`` (``layout_linear4bit``): ``gate_up_projs`` / ``down_projs`` ModuleLists of ``bnb.nn.Linear4bit``
  (community pre-quantized gpt-oss checkpoints; ``F.linear`` orientation, gate/up interleaved, biases, dense
  ``[T, E]`` routing weights).
- ``stacked`` (``layout_stacked``): stock transformers 5.x experts whose 3-D ``gate_up_proj`` / ``down_proj`` were
  quantized by :func:`leantrain.quantize_experts_4bit` (bitsandbytes' 4-bit parametrization).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._stacks import EXPERT_MLP_NAMES, STACK_NAMES


@dataclass
class Found:
    name: str
    module: nn.Module
    layout: str  # a name in registry.LAYOUTS: "expert_mlps" | "linear4bit" | "stacked"


NOT_4BIT_REASON = "MoE experts are not 4-bit: run leantrain.quantize_experts_4bit(model) first"
Wrapped = dict[int, nn.Module]  # id(module) -> the PEFT tuner wrapping it (``_adapters.wrapped_map``)


class Layout:
    """What differs between layouts, asked by the probe, the plan and ``apply`` (none of them switches on a name).

    Each method takes the experts module found in this layout (``Found.module``). The per-expert layouts consolidate
    their ``Linear4bit`` layers into packed stacks when the plan is built; the stacked layout reads its stacks."""

    name: str = ""
    not_4bit_reason: str = NOT_4BIT_REASON  # found in this layout but not quantized: what to do
    fsdp2: bool = False  # served under FSDP2 (the plan rebuilt per call around the unsharded stacks: live_plan)
    transformers4: bool = False  # served on transformers 4.x (its stock forwards reproduced and tested there)

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is an experts module of this layout (structure only)."""
        raise NotImplementedError

    def is_4bit(self, module: nn.Module) -> bool:
        """Whether its expert weights are bitsandbytes 4-bit (otherwise ``not_4bit_reason``)."""
        raise NotImplementedError

    def num_experts(self, module: nn.Module) -> int:
        """How many experts it holds (structure only: read without bitsandbytes, quantized or not)."""
        raise NotImplementedError

    def lora_reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        """Why PEFT adapters on it keep it off the grouped path; None: no adapters, or servable ones."""
        raise NotImplementedError

    def reason(self, module: nn.Module, wrapped: Wrapped) -> str | None:
        """Why it cannot take the grouped path; None: it can (``probe.module_reason`` caches it)."""
        raise NotImplementedError

    def signature(self, module: nn.Module, wrapped: Wrapped) -> tuple:
        """Cheap identity of what ``reason`` looked at (modules, tensors with their devices, states, grads)."""
        raise NotImplementedError

    def compute_dtype(self, module: nn.Module) -> tuple[torch.device, torch.dtype]:
        """The device its kernels run on and the dtype its stacks dequantize to."""
        raise NotImplementedError

    def stack_elements(self, module: nn.Module) -> int:
        """Elements of its larger dequantized stack (gate_up: ``[E, 2I, H]``)."""
        raise NotImplementedError

    def recipe(self, module: nn.Module) -> BlockRecipe | None:
        """What a replaced block forward reproduces around the experts (None: the experts' own forward is replaced)."""
        return None

    def adapters(self, module: nn.Module, wrapped: Wrapped) -> Any:
        """Where a ready module's PEFT adapters are (``_adapters.AdapterSpec``; None: it carries none)."""
        raise NotImplementedError

    def build_plan(self, module: nn.Module, record: Any, recompute: bool) -> tuple[Any, Any]:
        """(``ops.ExpertsPlan``, per-call check) for a ready module; consolidation restore steps go to ``record``."""
        raise NotImplementedError

    def live_plan(self, module: nn.Module, recompute: bool) -> Any:
        """For FSDP2 (``fsdp2`` layouts only): the plan rebuilt on every call around the module's live stacks."""
        raise NotImplementedError(f"the {self.name} layout is not served under FSDP2")

    def stock(self, forward: Any) -> Any:
        """The stock forward as the run-time fallback calls it while patched (by default, as it is)."""
        return forward

    def share(self, modules: list[nn.Module], record: Any, fsdp2: bool) -> None:
        """While patched, make the served modules of this layout look alike to ``torch.compile`` (one compiled code
        for every decoder layer), each change's restore step going to ``record``; by default nothing differs."""


def expert_mlp_names(expert: nn.Module) -> tuple[str, str, str] | None:
    """The (gate, up, down) projection names of one expert MLP, or None when it is not a gated MLP."""
    for names in EXPERT_MLP_NAMES:
        if all(isinstance(getattr(expert, n, None), nn.Module) for n in names):
            return names
    return None


def is_expert_mlps(module: nn.Module) -> bool:
    """A sparse MoE block of transformers 4.x: a ``gate`` router next to a ModuleList of same-named gated MLPs."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0 or not isinstance(module.gate, nn.Module):
        return False
    names = expert_mlp_names(experts[0])
    return names is not None and all(expert_mlp_names(e) == names for e in experts)


def expert_projections(block: nn.Module) -> tuple[list[nn.Module], list[nn.Module], list[nn.Module]]:
    """Per-expert (gate, up, down) projection modules of an ``expert_mlps`` block, in expert order."""
    names = expert_mlp_names(block.experts[0])
    return tuple([getattr(e, n) for e in block.experts] for n in names)  # type: ignore[return-value]


def is_lists(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_projs", None), nn.ModuleList) and isinstance(
        getattr(module, "down_projs", None), nn.ModuleList
    )


def is_stacked(module: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    def ok(name: str) -> bool:
        param = module._parameters.get(name)
        return (param is not None and param.dim() == 3) or parametrize.is_parametrized(module, name)

    return all(ok(name) for name in STACK_NAMES)


def bnb_parametrization(module: nn.Module, name: str):
    """The parametrization list of a stack bitsandbytes quantized (one 4-bit parametrization with its state), or
    None."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from torch.nn.utils import parametrize

    if not parametrize.is_parametrized(module, name):
        return None
    plist = module.parametrizations[name]
    if len(plist) != 1 or not isinstance(plist[0], Bnb4bitParametrization) or plist[0].quant_state is None:
        return None
    return plist


@dataclass(frozen=True)
class BlockRecipe:
    """What a stock transformers 4.x sparse MoE block computes around its experts, reproduced by the replaced forward:
    ``hook`` is the method replaced (``forward``: router, routing, experts, shared expert; ``moe``: DeepSeek-V2's
    experts step, whose router stays stock), ``normalize`` whether top-k weights are renormalized (``"always"``,
    ``"norm_topk_prob"``: per the block's attribute), ``shared`` whether a gated shared expert is added."""

    hook: str
    normalize: str = "norm_topk_prob"
    shared: bool = False


_TF = "transformers.models"
# The stock forwards (module, qualname) whose exact math the replaced forward reproduces (transformers 4.57):
# routing is code, not structure, so a block whose forward is not one of these is declined.
STOCK_BLOCKS: dict[tuple[str, str], BlockRecipe] = {
    (f"{_TF}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock.forward"): BlockRecipe("forward", shared=True),
    (f"{_TF}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock.forward"): BlockRecipe("forward"),
    (f"{_TF}.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock.forward"): BlockRecipe("forward"),
    (f"{_TF}.mixtral.modeling_mixtral", "MixtralSparseMoeBlock.forward"): BlockRecipe("forward", normalize="always"),
    (f"{_TF}.deepseek_v2.modeling_deepseek_v2", "DeepseekV2MoE.moe"): BlockRecipe("moe"),
}
# Stock expert MLPs computing down(act(gate(x)) * up(x)) with their own ``act_fn``.
STOCK_EXPERT_MLPS = {
    (f"{_TF}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeMLP.forward"),
    (f"{_TF}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeMLP.forward"),
    (f"{_TF}.olmoe.modeling_olmoe", "OlmoeMLP.forward"),
    (f"{_TF}.mixtral.modeling_mixtral", "MixtralBlockSparseTop2MLP.forward"),
    (f"{_TF}.deepseek_v2.modeling_deepseek_v2", "DeepseekV2MLP.forward"),
}


def _method_key(module: nn.Module, name: str) -> tuple[str, str]:
    method = getattr(type(module), name, None)
    return getattr(method, "__module__", ""), getattr(method, "__qualname__", "")


def block_recipe(block: nn.Module) -> BlockRecipe | None:
    """The recipe of a stock block's class (None: a forward leantrain does not reproduce)."""
    for hook in ("forward", "moe"):
        recipe = STOCK_BLOCKS.get(_method_key(block, hook))
        if recipe is not None and recipe.hook == hook:
            return recipe
    return None


def replaced(module: nn.Module, name: str) -> bool:
    """Whether the instance holds its own ``name`` method, other than the class's own bound to it (transformers 4.x's
    output recording binds ``module.forward`` on the instance around a call and leaves the class's method there)."""
    method = module.__dict__.get(name)
    if method is None:
        return False
    own = getattr(type(module), name, None)
    return not (getattr(method, "__func__", None) is own and getattr(method, "__self__", None) is module)


def is_stock_expert_mlp(expert: nn.Module) -> bool:
    return _method_key(expert, "forward") in STOCK_EXPERT_MLPS
