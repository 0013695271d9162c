"""Shapes of public models that benchmarks, examples and tests build with random weights (nothing downloaded).

One table, the released configs' sizes: every consumer imports it (benchmarks put this folder on ``sys.path``
already; examples/_common.py and tests add it the same way) and adds only what is its own choice (position range,
attention implementation, a smaller layer count). Plain data, no imports: importing it costs nothing anywhere.

``fields`` are the transformers config keyword arguments that set the cost (sizes, heads, experts, tying); ``cls``
is the transformers config class. Rope settings, norms' epsilon and the position range are left to the consumer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Shape:
    cls: str  # transformers config class name
    source: str  # the released checkpoint these sizes come from
    fields: dict[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> dict[str, Any]:
        """The config keyword arguments with ``overrides`` applied (a copy)."""
        return {**self.fields, **overrides}

    @property
    def layers(self) -> int:
        return self.fields["num_hidden_layers"]


SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(
        "LlamaConfig",
        "HuggingFaceTB/SmolLM2-135M",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-0.5b": Shape(
        "Qwen2Config",
        "Qwen/Qwen2.5-0.5B",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-1.5b": Shape(
        "Qwen2Config",
        "Qwen/Qwen2.5-1.5B",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-3b": Shape(
        "Qwen2Config",
        "Qwen/Qwen2.5-3B",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-7b": Shape(
        "Qwen2Config",
        "Qwen/Qwen2.5-7B",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.2-1b": Shape(
        "LlamaConfig",
        "meta-llama/Llama-3.2-1B",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.1-8b": Shape(
        "LlamaConfig",
        "meta-llama/Llama-3.1-8B",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
    ),
    "gemma-2-2b": Shape(  # eager attention (its logit softcapping); the 256000-entry vocabulary ties the head
        "Gemma2Config",
        "google/gemma-2-2b",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
    "gpt-oss-20b": Shape(  # GptOssConfig defaults supply the rest (yarn rope, swiglu limit 7, attention bias)
        "GptOssConfig",
        "openai/gpt-oss-20b",
        dict(
            num_hidden_layers=24,
            num_local_experts=32,
            num_experts_per_tok=4,
            hidden_size=2880,
            intermediate_size=2880,
            vocab_size=201088,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=128,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": Shape(  # every layer sparse (decoder_sparse_step 1, no mlp_only_layers)
        "Qwen3MoeConfig",
        "Qwen/Qwen3-30B-A3B",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V2-Lite's experts (64 routed, top-6, H 2048, expert I 1408; 2 shared = one of I 2816) on a standard
    # MoE block: transformers' Qwen2-MoE class has the same expert GEMMs, with GQA-free attention instead of MLA
    "deepseek-v2-lite-like": Shape(
        "Qwen2MoeConfig",
        "deepseek-ai/DeepSeek-V2-Lite (routed experts only)",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=2816,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=6,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
}


def shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown shape {name!r}; known: {sorted(SHAPES)}") from None


def config(name: str, **overrides: Any) -> dict[str, Any]:
    """``SHAPES[name]``'s config keyword arguments with ``overrides`` applied."""
    return shape(name).config(**overrides)
