"""The ModuleList (transformers 4.x style) MoE block families, their tiny 4-bit models, trainers and tolerances,
shared by the block and the block-LoRA parity tests.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import torch
import transformers

from leantrain.fallback import RuntimeFallback  # noqa: E402
from leantrain.moe4bit import (
    _adapters,  # noqa: E402
)
from leantrain.moe4bit import probe as moe_probe  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.patch import install  # noqa: E402
from leantrain.moe4bit.registry import find_experts  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import load_in_4bit_like, token_trainer  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402


HIDDEN, INTER, EXPERTS = 128, 64, 6


FP32_EPS, BF16_EPS = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps


ONLY_MOE = others_off("moe4bit")


VOCAB, SEQ = 256, 16


def config(family: str, top_k: int = 2, **extra) -> transformers.PretrainedConfig:
    """A tiny config of one family; ``extra`` overrides fields (e.g. norm_topk_prob, router_jitter_noise)."""
    common = {
        "hidden_size": HIDDEN,
        "num_experts_per_tok": top_k,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "output_router_logits": True,  # the router logits feed the aux loss: part of the block's contract
    }
    fields = {
        "qwen2_moe": dict(
            moe_intermediate_size=INTER,
            shared_expert_intermediate_size=INTER,
            intermediate_size=INTER,
            num_experts=EXPERTS,
            norm_topk_prob=False,
        ),
        "qwen3_moe": dict(
            moe_intermediate_size=INTER, intermediate_size=INTER, num_experts=EXPERTS, norm_topk_prob=True, head_dim=32
        ),
        "mixtral": dict(intermediate_size=INTER, num_local_experts=EXPERTS, router_jitter_noise=0.0),
        "olmoe": dict(intermediate_size=INTER, num_experts=EXPERTS, norm_topk_prob=False),
        "deepseek_v2": dict(
            moe_intermediate_size=INTER,
            intermediate_size=INTER,
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            topk_method="greedy",
            first_k_dense_replace=0,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=32,
            num_key_value_heads=4,
        ),
    }[family]
    return transformers.AutoConfig.for_model(family, **{**common, **fields, **extra})


def block_of(family: str, dtype: torch.dtype = torch.float32, **extra) -> torch.nn.Module:
    """One stock 4.57 sparse MoE block, random weights (seeded), every Linear 4-bit as BitsAndBytesConfig makes it
    except the router (``llm_int8_skip_modules=["gate"]``, so the router's weight gradient can be compared)."""
    cfg = config(family, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    block = find_experts(model)[0].module  # layers[0].mlp (Mixtral: block_sparse_moe)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    load_in_4bit_like(block, skip=("gate",), compute_dtype=dtype, **QUANT.get(family, {}))
    return block.train()


QUANT = {"qwen3_moe": {"double_quant": True}, "olmoe": {"quant_type": "fp4"}}  # vary the 4-bit formats by family


BLOCK_FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]  # the block forward is replaced


ALL_FAMILIES = [*BLOCK_FAMILIES, "deepseek_v2"]  # DeepSeek-V2: its experts step ``moe`` is replaced


def patch_block(block: torch.nn.Module, undo: Undo, recompute: bool = True) -> None:
    """What ``Moe4bit.apply`` installs on one block (its own ``patch.install``), with a strict fallback (an error
    fails the test)."""
    found, wrapped = Found("mlp", block, "expert_mlps"), _adapters.wrapped_map(block)
    assert moe_probe.module_reason(found, wrapped) is None
    install(moe_probe.target(found, wrapped, recompute), False, undo, RuntimeFallback("moe4bit", strict=True))


DEEPSEEK_FP32 = (HIDDEN + INTER) * FP32_EPS * 4 * HIDDEN**0.5  # see the test below


def tiny_4bit(family: str) -> transformers.PreTrainedModel:
    """A whole tiny model as a user loads it: from_config (seeded), every Linear but lm_head and the routers in
    4-bit (``llm_int8_skip_modules=["gate", "lm_head"]``); trainable: embeddings, norms, routers (no adapters)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family), attn_implementation="eager")
    load_in_4bit_like(model, skip=("gate", "lm_head"))
    return model.train()


def make_trainer(model, tmp_path, steps: int = 2) -> transformers.Trainer:
    return token_trainer(model, tmp_path, steps, learning_rate=1e-2, vocab=VOCAB, seq=SEQ)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# A gradient reached through a later block's input grad carries that grad's reassociation error (<= 2I * eps per
# unit of sum|terms|, test_fp32_block_matches_stock), further summed over later layers (2). Norm-wise, sum|terms| of
# random-sign data runs about sqrt(2I) times the result: relative bound 2 * 2I * eps * sqrt(2I).
FP32_GRAD_REL = 2 * (2 * INTER) * FP32_EPS * (2 * INTER) ** 0.5
