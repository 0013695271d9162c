"""What the layer kernels serve per model family, and where they measured faster (data, read by the probe).

``FAMILIES``: the transformers classes a family's decoder is built from and the semantics Liger-Kernel's kernels
must reproduce for it (RMSNorm casting and weight offset, the gated activation). ``MEASURED``: the verdict of the
GPU recipe runs per family; auto mode (``layer_kernels`` unset) applies the kernels only where ``faster`` is True.
Update ``MEASURED`` from ``benchmarks/bench_recipes.py --recipe dense_sft`` (variant ``leantrain layer_kernels`` vs
``leantrain``, same run, same device): a family without a measured win stays off in auto mode and the report gives
the evidence; ``layer_kernels=True`` applies the kernels to every family in ``FAMILIES`` regardless.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import Evidence


@dataclass(frozen=True)
class Family:
    norm_class: str  # the family's RMSNorm class in its modeling module
    norm_eps: str  # the attribute holding that norm's epsilon
    casting: str  # Liger's RMSNorm casting mode that matches the family's forward: "llama" or "gemma"
    offset: float  # the norm scales by (offset + weight): Gemma's (1 + w)
    mlp_class: str
    gate: str  # "swiglu" (silu(gate) * up) or "geglu" (tanh-approximated gelu(gate) * up)
    act_attr: str  # the config field naming the MLP activation
    activations: tuple[str, ...]  # activation names the gated kernel computes exactly
    attention_class: str  # whose forward calls the modeling module's apply_rotary_pos_emb


_LLAMA_LIKE = dict(
    norm_eps="variance_epsilon",
    casting="llama",  # rstd in fp32, x·rstd cast back to the input dtype, then times the weight in that dtype
    offset=0.0,
    gate="swiglu",
    act_attr="hidden_act",
    activations=("silu", "swish"),
)

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaRMSNorm", mlp_class="LlamaMLP", attention_class="LlamaAttention", **_LLAMA_LIKE),
    "qwen2": Family("Qwen2RMSNorm", mlp_class="Qwen2MLP", attention_class="Qwen2Attention", **_LLAMA_LIKE),
    "gemma2": Family(
        "Gemma2RMSNorm",
        norm_eps="eps",
        casting="gemma",  # everything in fp32, (1 + w) included, one cast back at the end
        offset=1.0,
        mlp_class="Gemma2MLP",
        gate="geglu",
        act_attr="hidden_activation",
        activations=("gelu_pytorch_tanh",),
        attention_class="Gemma2Attention",
    ),
}


# LoRA r16 on every attention and MLP projection, head frozen, 4 x 2048 tokens, bf16, gradient checkpointing, AdamW,
# median of 8 steps (benchmarks/results/recipes.md, dense_sft_runs.md). Gemma 2: the same Liger kernels
# through TRL 1.16's use_liger_kernel against stock (its own fused head kept); Llama and Qwen2: patch_trainer with
# and without layer_kernels=True, the fused loss on in both, TRL 1.16 SFTTrainer, several runs.
MEASURED: dict[str, Evidence] = {
    "gemma2": Evidence("faster", "H100", "2026-11-25", "Gemma-2-2B LoRA SFT step 822.6 -> 672.8 ms"),
    "qwen2": Evidence(
        "not faster",
        "H200",
        "2026-11-26",
        "Qwen2.5-1.5B LoRA SFT step 372 / 356 / 362 -> 388 / 345 / 355 ms in three runs, inside the step-to-step "
        "spread (330-420 ms): no consistent win",
    ),
    # Faster at a fixed 4 x 2048 (257 -> 223 and 251 -> 206 ms, H200, 2026-11-26) but slower on real, varying
    # lengths, where the kernels are built again for new shapes: benchmarks/results/vs_unsloth.md, variable-length
    # set, the fused loss on in both runs (leantrain provider with LEANTRAIN_LAYER_KERNELS=0 vs its default).
    "llama": Evidence(
        "not faster",
        "H200",
        "2026-11-27",
        "Llama-3.2-1B LoRA SFT on varying lengths (lognormal, median ~500 tokens): 5104 tok/s without the kernels, "
        "4077 tok/s with them (stock 4453); faster only at a fixed 4 x 2048 (257 -> 223 ms)",
    ),
}
