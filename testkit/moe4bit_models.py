"""Test and benchmark scaffolding: 4-bit expert layouts built from stock transformers modules.

Community pre-quantized gpt-oss 4-bit checkpoints store experts as ``gate_up_projs`` / ``down_projs`` ModuleLists
of ``Linear4bit`` (weight = transpose of the 3-D slice, gate/up interleaved on rows, biases) and run a per-expert
loop: the package's :class:`leantrain.cli.tiny.Linear4bitMoeExperts` (the demo's stand-in, the one copy) reproduces
that layout and loop; :func:`linear4bit_experts_from` converts a stock gpt-oss (or Qwen3-MoE / Mixtral-style)
experts module into it. :func:`load_in_4bit_like` quantizes as ``from_pretrained(load_in_4bit=True)`` does, and
:class:`SparseMoeBlock4x` rebuilds the transformers 4.57 Qwen MoE block.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from leantrain.cli.tiny import Linear4bitMoeExperts


def _linear4bit(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quant_type: str,
    blocksize: int,
    compress_statistics: bool,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    quant = {"quant_type": quant_type, "compress_statistics": compress_statistics}
    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype, device="meta", **quant
    )
    layer.weight = bnb.nn.Params4bit(
        weight.detach().clone(), requires_grad=False, blocksize=blocksize, module=layer, **quant
    )
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    # On CPUs with AVX512-BF16, bitsandbytes repacks the weight for its own CPU kernel at the first eval-mode,
    # no-grad forward, whose sums differ from dequantize-then-matmul by ~1e-3: the reference would then depend on
    # the machine. The tests compare against the dequantize path every CPU takes.
    layer.support_avx512bf16_for_cpu = False
    return layer.to(weight.device)  # bitsandbytes quantizes on the first move to a device


def linear4bit_experts_from(
    experts: nn.Module, quant_type: str = "nf4", blocksize: int = 64, compress_statistics: bool = True
) -> Linear4bitMoeExperts:
    """Convert stock 3-D experts (gpt-oss ``[E, H, 2I]`` transposed, or ``[E, 2I, H]`` Qwen/Mixtral style) into
    per-expert ``Linear4bit`` lists holding the same weights (``weight[e] = W[e]`` in ``F.linear`` orientation)."""
    in_major = bool(getattr(experts, "is_transposed", False))
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if in_major:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    has_bias = bool(getattr(experts, "has_bias", False))
    quant = {"quant_type": quant_type, "blocksize": blocksize, "compress_statistics": compress_statistics}

    def layers(stack: torch.Tensor, bias_name: str) -> nn.ModuleList:
        biases = getattr(experts, bias_name) if has_bias else None
        return nn.ModuleList(
            _linear4bit(stack[e].contiguous(), None if biases is None else biases[e], **quant)
            for e in range(stack.shape[0])
        )

    gate_up_projs, down_projs = layers(gate_up, "gate_up_proj_bias"), layers(down, "down_proj_bias")
    if hasattr(experts, "alpha") and hasattr(experts, "limit"):
        return Linear4bitMoeExperts(gate_up_projs, down_projs, experts.alpha, experts.limit)
    return Linear4bitMoeExperts(gate_up_projs, down_projs, act_fn=experts.act_fn)


def convert_model_to_linear4bit_experts(model: nn.Module, **quant) -> list[str]:
    """Replace every stock experts module of ``model`` by its :class:`~leantrain.cli.tiny.Linear4bitMoeExperts` copy;
    returns their names."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if "gate_up_proj" in module._parameters and "down_proj" in module._parameters
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear4bit_experts_from(module, **quant))
    model.is_loaded_in_4bit = True  # as a 4-bit checkpoint loads: PEFT then wraps Linear4bit in its lora.Linear4bit
    return [name for name, _ in targets]


def load_in_4bit_like(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    compute_dtype: torch.dtype = torch.float32,
    double_quant: bool = False,
    skip: tuple[str, ...] = ("lm_head",),
    blocksize: int = 64,
) -> list[str]:
    """What ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` makes of a model
    (transformers 4.57's ``replace_with_bnb_linear`` + loading): every ``nn.Linear`` becomes a frozen
    ``bnb.nn.Linear4bit`` holding the same weights, except modules named in ``skip`` (``modules_to_not_convert`` /
    ``llm_int8_skip_modules``: a child name, a full name, or a prefix). ``compute_dtype`` is the config's
    ``bnb_4bit_compute_dtype`` (float32 when unset). Returns the replaced names."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and name.rpartition(".")[2] not in skip
        and not any(name == key or name.startswith(key + ".") or f".{key}." in f".{name}." for key in skip)
    ]
    quant = {"quant_type": quant_type, "blocksize": blocksize, "compress_statistics": double_quant}
    for name, module in targets:
        parent, _, child = name.rpartition(".")
        layer = _linear4bit(module.weight.detach(), module.bias, compute_dtype=compute_dtype, **quant)
        layer.source_cls = type(module)
        setattr(model.get_submodule(parent) if parent else model, child, layer.requires_grad_(False))
    model.is_loaded_in_4bit = True  # what from_pretrained sets: PEFT then wraps Linear4bit in its lora.Linear4bit
    return [name for name, _ in targets]


class ExpertMLP(nn.Module):
    """A transformers 4.x expert MLP: ``down(act(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock4x(nn.Module):
    """The transformers 4.57 Qwen2-MoE / Qwen3-MoE sparse MoE block, rebuilt for any transformers version (5.x has
    3-D experts only): a ``gate`` router, an ``experts`` ModuleList of :class:`ExpertMLP`, the per-expert loop over
    the experts a batch hits, the optional sigmoid-gated shared expert; returns ``(hidden, router_logits)``.
    Not a stock class, so the probe declines it: tests and benchmarks patch it with
    ``leantrain.moe4bit.patch.block_forward`` and this recipe directly (normalize per ``norm_topk_prob``)."""

    def __init__(
        self, hidden: int, inter: int, experts: int, top_k: int, norm_topk_prob: bool, shared_inter: int = 0
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter) for _ in range(experts))
        if shared_inter:
            self.shared_expert = ExpertMLP(hidden, shared_inter)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        router_logits = self.gate(x)
        weights = nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        mask = nn.functional.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, T]
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():  # the stock loop (host sync per step)
            slot, token = torch.where(mask[expert].squeeze(0))
            y = self.experts[expert](x[None, token].reshape(-1, hidden)) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x)
            out = out + nn.functional.sigmoid(self.shared_expert_gate(x)) * shared
        return out.reshape(batch, seq, hidden), router_logits


def patch_block_4x(block: nn.Module, undo, recompute: bool = True, strict: bool = True) -> None:
    """Install the grouped forward on a 4.x-style block (stock class or :class:`SparseMoeBlock4x`, with or without
    PEFT LoRA on its experts) through ``Moe4bit.apply``'s own ``patch.install``, recording on ``undo``; ``strict``:
    an error in the grouped path raises. :class:`SparseMoeBlock4x` gets the recipe of the 4.57 Qwen blocks."""
    import dataclasses

    from leantrain.fallback import RuntimeFallback
    from leantrain.moe4bit import _adapters, probe
    from leantrain.moe4bit.layouts import BlockRecipe, Found
    from leantrain.moe4bit.patch import install

    target = probe.target(Found("mlp", block, "expert_mlps"), _adapters.wrapped_map(block), recompute)
    if target.recipe is None:  # the test-local mirror of the 4.57 Qwen2/Qwen3-MoE blocks
        recipe = BlockRecipe("forward", "norm_topk_prob", hasattr(block, "shared_expert"))
        target = dataclasses.replace(target, owner=block, hook="forward", recipe=recipe)
    install(target, False, undo, RuntimeFallback("moe4bit", strict=strict))


def token_trainer(
    model: nn.Module, tmp_path, steps: int = 2, learning_rate: float = 1e-3, vocab: int = 256, seq: int = 16
) -> transformers.Trainer:
    """A plain CPU ``Trainer`` on 8 seeded rows of ``seq`` tokens (labels = inputs), batch 2, logging every step."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=learning_rate,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    ids = torch.randint(3, vocab, (8, seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    return transformers.Trainer(model=model, args=args, train_dataset=data)
