"""Find MoE experts modules by structure (no bitsandbytes needed to find them).

Three layouts:
- ``linear4bit``: ``gate_up_projs`` / ``down_projs`` ModuleLists of ``bnb.nn.Linear4bit`` (community pre-quantized
  gpt-oss checkpoints; ``F.linear`` orientation, gate/up interleaved, biases, dense ``[T, E]`` routing weights).
- ``stacked``: stock transformers 5.x experts whose 3-D ``gate_up_proj`` / ``down_proj`` were quantized by
  :func:`leantrain.quantize_experts_4bit` (bitsandbytes' 4-bit parametrization).
- ``expert_mlps``: transformers 4.x sparse MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2): an
  ``experts`` ModuleList of gated MLPs (``gate_proj``/``up_proj``/``down_proj`` or Mixtral's ``w1``/``w3``/``w2``)
  next to the block's ``gate`` router; ``BitsAndBytesConfig(load_in_4bit=True)`` makes each projection a
  ``bnb.nn.Linear4bit``. The found module is the block (its forward, or DeepSeek-V2's ``moe``, is what gets replaced).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .quantize import STACK_NAMES


@dataclass
class Found:
    name: str
    module: nn.Module
    layout: str  # "linear4bit" | "stacked" | "expert_mlps"


# Gated expert MLPs as (gate, up, down) attribute names: act(gate(x)) * up(x) -> down.
EXPERT_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def expert_mlp_names(expert: nn.Module) -> tuple[str, str, str] | None:
    """The (gate, up, down) projection names of one expert MLP, or None when it is not a gated MLP."""
    for names in EXPERT_MLP_NAMES:
        if all(isinstance(getattr(expert, n, None), nn.Module) for n in names):
            return names
    return None


def _is_expert_mlps(module: nn.Module) -> bool:
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


def _is_lists(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_projs", None), nn.ModuleList) and isinstance(
        getattr(module, "down_projs", None), nn.ModuleList
    )


def _is_stacked(module: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    def ok(name: str) -> bool:
        param = module._parameters.get(name)
        return (param is not None and param.dim() == 3) or parametrize.is_parametrized(module, name)

    return all(ok(name) for name in STACK_NAMES)


def find_experts(model: nn.Module) -> list[Found]:
    """Every experts module of any layout (structural: needs no bitsandbytes)."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "gate") and _is_expert_mlps(module):
            found.append(Found(name, module, "expert_mlps"))
        elif _is_lists(module):
            found.append(Found(name, module, "linear4bit"))
        elif _is_stacked(module):
            found.append(Found(name, module, "stacked"))
    return found


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


def is_4bit(found: Found) -> bool:
    import bitsandbytes as bnb

    if found.layout == "stacked":
        return all(bnb_parametrization(found.module, n) is not None for n in STACK_NAMES)
    if found.layout == "expert_mlps":
        layers = [m for group in expert_projections(found.module) for m in group]
    else:
        layers = list(found.module.gate_up_projs) + list(found.module.down_projs)
    return bool(layers) and all(isinstance(getattr(m, "base_layer", m), bnb.nn.Linear4bit) for m in layers)


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
