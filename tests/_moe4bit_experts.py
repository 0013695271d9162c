"""Stock experts and their 4-bit copies at the moe4bit op tests' shapes, shared by the CPU and CUDA op tests.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers


bnb = pytest.importorskip("bitsandbytes")
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from leantrain.moe4bit import quantize_experts_4bit  # noqa: E402
from testkit.moe4bit_models import linear4bit_experts_from  # noqa: E402


HIDDEN, INTER = 128, 64  # hidden and expert intermediate sizes: multiples of the blocksize (see the module docstring)


def stock_experts(family: str, num_experts: int, dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    """A stock transformers experts module (eager implementation) with random weights large enough that the
    gpt-oss clamp at 7 is exercised."""
    if family == "gpt_oss":
        config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=num_experts)
        cls = GptOssExperts
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=num_experts)
        cls = Qwen3MoeExperts
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.25)
    return module.to(dtype).requires_grad_(False)


def four_bit(layout: str, stock: torch.nn.Module, nested: bool) -> torch.nn.Module:
    if layout == "linear4bit":
        return linear4bit_experts_from(stock, compress_statistics=nested)
    module = copy.deepcopy(stock)
    quantize_experts_4bit(module, compress_statistics=nested)
    return module
