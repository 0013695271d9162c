"""PEFT LoRA on 4-bit experts (stacked and per-expert lists): the tiny models, batches and pairing helpers shared
by the CPU and CUDA LoRA tests.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import re

import pytest
import torch
import transformers


peft = pytest.importorskip("peft")
import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts  # noqa: E402


VOCAB, SEQ = 256, 16


STACK_SUFFIXES = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


LIST_TARGETS = r".*experts\.(gate_up_projs|down_projs)\.\d+"


def base_model(family: str, dtype=torch.float32) -> transformers.PreTrainedModel:
    model = tiny_model(family, seed=0, hidden=128, layers=2, vocab_size=VOCAB, dtype=dtype)
    model.set_experts_implementation("eager")  # the stock per-expert loop
    return model.train()


def experts_modules(model) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts") and hasattr(m, "parametrizations")]


def stacked_pair(family: str, dtype=torch.float32, **lora_kwargs):
    """(4-bit model with target_parameters LoRA, plain model with the dequantized stacks and the same LoRA)."""
    quantized = base_model(family, dtype)
    leantrain.quantize_experts_4bit(quantized)
    plain = base_model(family, dtype)
    with torch.no_grad():
        for q, p in zip(
            experts_modules(quantized), (m for n, m in plain.named_modules() if n.endswith("mlp.experts"))
        ):
            for name in ("gate_up_proj", "down_proj"):
                getattr(p, name).copy_(getattr(q, name))  # bitsandbytes' parametrization dequantizes on access
    cfg = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False) | lora_kwargs
    torch.manual_seed(1)
    quantized = peft.get_peft_model(
        quantized, peft.LoraConfig(target_parameters=leantrain.expert_lora_targets(quantized), **cfg)
    )
    plain = peft.get_peft_model(plain, peft.LoraConfig(target_parameters=STACK_SUFFIXES, **cfg))
    copy_lora(quantized, plain)
    return quantized, plain


def wrappers(model) -> dict[tuple[str, str], torch.nn.Module]:
    """Every target_parameters LoRA wrapper by (experts module name, parameter name): the nesting order of the
    wrappers differs between full-name and suffix targets, the adapters' identity does not."""
    found = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            found[(name.split(".mlp.")[0].split("layers.")[-1], module.parameter_name)] = module
    return found


def copy_lora(src, dst) -> None:
    with torch.no_grad():
        theirs = wrappers(dst)
        for key, ours in wrappers(src).items():
            for adapter in ours.lora_A:
                theirs[key].lora_A[adapter].weight.copy_(ours.lora_A[adapter].weight)
                theirs[key].lora_B[adapter].weight.copy_(ours.lora_B[adapter].weight)
        src_state = {k: v for k, v in src.state_dict().items() if "lora" in k and "experts" not in k}
        dst.load_state_dict(src_state, strict=False)


def batch(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def routers_trainable(model) -> None:
    """The router gradient is part of the parity (PEFT freezes it; the grouped path must still produce it)."""
    for name, param in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
            param.requires_grad_(True)


def _keys(model) -> dict[int, str]:
    """Expert LoRA parameters named by (layer, stack, factor, adapter): PEFT's wrapper nesting differs between the
    two models."""
    keys = {}
    for (layer, stack), wrapper in wrappers(model).items():
        for adapter in wrapper.lora_A:
            keys[id(wrapper.lora_A[adapter].weight)] = f"{layer}.experts.{stack}.lora_A.{adapter}"
            keys[id(wrapper.lora_B[adapter].weight)] = f"{layer}.experts.{stack}.lora_B.{adapter}"
    return keys


def list_targets(model) -> list[str]:
    """Every expert Linear4bit by full name (what ``target_modules="all-linear"`` reaches on a 4-bit model)."""
    return [n for n, _ in model.named_modules() if re.fullmatch(LIST_TARGETS, n)]


def lists_model(family: str = "gpt_oss", **lora_kwargs):
    model = base_model(family)
    convert_model_to_linear4bit_experts(model)
    cfg = dict(r=16, lora_alpha=32, target_modules=list_targets(model), init_lora_weights=False) | lora_kwargs
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(**cfg))
