"""The GRPOTrainer scaffolding that the GRPO log-prob tests share (CPU parity, no-grad dispatch, CUDA): the tiny
Llama trainer, the op spy, and the bf16 trajectory bounds derived from the unit roundoff.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import math
import warnings

import pytest
import torch


trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
import transformers  # noqa: E402

from leantrain._compat import TRL_FUSED_LM_HEAD  # noqa: E402
from leantrain.cli.tiny import corpus_texts  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402


HAS_FUSED_HEAD = hasattr(__import__("trl.trainer.utils", fromlist=["_"]), "add_fused_lm_head")


needs_fused_head = pytest.mark.skipif(
    not HAS_FUSED_HEAD, reason=f"needs trl >= {TRL_FUSED_LM_HEAD} (add_fused_lm_head); installed {trl.__version__}"
)


def make_trainer(model_dir, tmp_path, *, beta=0.0, lora=False, record=None, **overrides):
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [" ".join(t.split()[:6]) for t in corpus_texts()[:8]]

    def reward(completions, **kwargs):
        if record is not None:
            record.extend(completions)
        return [len(c) / 10 + c.count("e") for c in completions]

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        beta=beta,
        seed=0,
        learning_rate=1e-2,
        save_strategy="no",
        temperature=0.7,
        **overrides,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            peft_config=peft_config,
        )


def count_op_calls(monkeypatch, scales=None):
    """Spy on leantrain's op: the backend of each call; with ``scales``, also each call's logit scales."""
    calls = []
    real = ops.logp_entropy

    def spy(hidden, weight, targets, **kwargs):
        calls.append(kwargs.get("backend"))
        if scales is not None:
            scales.append(logit_scales(hidden, weight, targets, **kwargs))
        return real(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(ops, "logp_entropy", spy)
    return calls


def logit_scales(hidden, weight, targets, temperature=1.0, logit_scale=1.0, softcap=None, **_) -> tuple[float, float]:
    """How far one bf16 rounding of every logit can move a token's logp and entropy (per unit roundoff u).

    The head's only 16-bit rounding is the ``h·Wᵀ`` tile (statistics and normalizer are fp32), so logit j moves by
    at most u·|z_j| (z = logit_scale·h·Wᵀ/T; a softcap only shrinks it). First order, logp = z_y - logZ moves by
    u·a with a = |z_y| + Σ_j p_j|z_j|, and H = logZ - Σ p z by u·b with b = Σ_j p_j |z_j| |z_j - μ|.
    Returns (rms of a, mean of b) over the scored tokens, in fp64."""
    valid = targets >= 0
    if not valid.any():
        return 0.0, 0.0
    with torch.no_grad():
        z = (hidden[valid].double() @ weight.double().T) * (logit_scale / temperature)
        p = torch.softmax(z, -1)
        mu = (p * z).sum(-1, keepdim=True)
        a = z.gather(1, targets[valid][:, None]).abs().squeeze(1) + (p * z.abs()).sum(-1)
        b = (p * z.abs() * (z - mu).abs()).sum(-1)
    return a.square().mean().sqrt().item(), b.mean().item()


U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits): one rounding moves a value by <= 2^-8 of itself


def bf16_bounds(stock_step: dict, first_step: dict, beta: float, scales: list[tuple[float, float]]) -> dict:
    """Derived per-step bounds on |stock - ours| under bf16 autocast (frozen head, LoRA, or full fine-tuning).

    Both heads round each logit of the same bf16 ``h·Wᵀ`` product once, and each rounds its backward operand once
    (TRL dL/dz, leantrain p·f) with fp32 statistics and accumulation; the backbone is shared code. So between the two
    paths, per token (see ``logit_scales``; A = rms a, B = mean b, maximized over the op's calls):
    - logp differs by <= 2u·a (one rounding each side), the log-ratio d = ref - logp by <= 4u·a (policy and ref);
    - the per-step parameter drift differs by <= 2u relative (Adam's update is scale-free, so each side's relative
      gradient rounding u maps to a relative update difference; two sides).
    kl = mean(e^d - d - 1) ≈ mean(d²)/2 is quadratic in d: its sensitivity to a per-token change δ is |e^d - 1| ≈ |d|,
    and mean(|d|·δ) <= sqrt(2·kl)·rms(δ) (Cauchy-Schwarz), plus δ²/2; the drift term moves kl by 2·2u relative.
    Deliberately, not relative to the small kl alone (the issue: 0.7% apart on an AVX512-BF16 EPYC vs a 0.5% bound),
    and not u·mean|logp| either: |logp| ≈ log V here is the fp32 normalizer, which carries no bf16 error, and that
    bound would exceed kl itself (a test that cannot fail).
    The GRPO loss with old logps = logps.detach() is -mean(A) + beta·kl exactly (ratio e^0 = 1, same completions,
    same advantages), so it gets beta times the kl bound plus fp32 summation slack. grad_norm: one operand rounding
    per side plus the drift, 4u relative. Entropy H = logZ - Σ p z: 2u·B from the logits, plus the 2·2u relative
    drift of its change since the first step.
    Measured (this tiny Llama, beta 0.1, LoRA, AVX2 and default kernels): the bounds are 8-110x the differences; the
    EPYC AVX512-BF16 kl gap of 1.5e-5 is 33x inside its 4.9e-4. Manual fail checks, same setup: beta 0.15 in the
    stock run → loss 2x over its bound at step 3; the temperature left out of our op → grad_norm 20x, entropy 65x,
    kl 3x over; a dropped kl term in the loss would move it by beta·kl = 2.1e-4, 4x its bound.
    """
    a_rms = max(a for a, _ in scales)
    b_mean = max(b for _, b in scales)
    kl = stock_step.get("kl", 0.0)
    delta_d = 4 * U_BF16 * a_rms
    kl_bound = math.sqrt(2 * kl) * delta_d + delta_d**2 / 2 + 4 * U_BF16 * kl
    drift = abs(stock_step["entropy"] - first_step["entropy"])
    return {
        "kl": kl_bound,
        "loss": beta * kl_bound + 1e-6,  # 1e-6: fp32 sums of the (identical) advantages, |loss| < 1
        "grad_norm": 4 * U_BF16 * stock_step["grad_norm"],
        "entropy": 2 * U_BF16 * b_mean + 4 * U_BF16 * drift,
    }


def assert_bf16_trajectory(stock, ours, beta, scales, steps=3):
    assert len(stock) == len(ours) == steps and scales
    for step, (a, b) in enumerate(zip(stock, ours)):
        assert a.keys() == b.keys()
        bounds = bf16_bounds(a, stock[0], beta, scales)
        for key in a:
            assert abs(a[key] - b[key]) <= bounds[key], (step, key, a[key], b[key], bounds[key])
