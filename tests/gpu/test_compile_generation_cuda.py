"""Compiled decoding on CUDA (inductor with CUDA graphs, the default) against stock ``generate`` on the same trainer:
a tiny Qwen2 in bf16, greedy and sampled, GRPO with LoRA and gradient checkpointing, GRPO with a reference model,
RLOO, and a forced failure.

Rules (u = bf16's unit roundoff, 2^-8; L layers): one forward's logits carry at most 8u·√(2L+2)·max|z| of rounding
on each path (the parity suite's one-forward bound), so two paths agree within twice that, and greedy decoding may
take another token only where stock's top two logits are that close (a near-tie). After a near-tie the sequences
are different continuations and nothing more is compared. Sampling on CUDA is compared statistically: the mean
reward of many completions agrees within four standard errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import leantrain
from leantrain import Status
from leantrain.compile_generation import stats
from testkit import generation
from testkit.optimizations import only


pytestmark = pytest.mark.gpu
U = 2.0**-8
LAYERS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return generation.save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), hidden=128, layers=LAYERS)


def _bound(z: torch.Tensor) -> float:
    return 2 * 8 * U * math.sqrt(2 * LAYERS + 2) * z.abs().max().item()


def _generate(trainer, inputs, seed: int = 0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return trainer.model.generate(**inputs, generation_config=trainer.generation_config)


def test_greedy_bf16_same_tokens_until_the_first_near_tie(model_dir, tmp_path):
    t = generation.trainer(
        model_dir, tmp_path, device="cuda", dtype=torch.bfloat16, max_completion_length=32,
        generation_kwargs={"do_sample": False},
    )  # fmt: skip
    config = copy.deepcopy(t.generation_config)
    config.output_logits, config.return_dict_in_generate = True, True
    t.generation_config = config
    inputs = generation.batch(t.processing_class, generation.prompts(8), "cuda")
    stock = _generate(t, inputs)
    report = leantrain.patch_trainer(t, **only("compile_generation"))
    assert report["compile_generation"].status is Status.APPLIED
    ours = _generate(t, inputs)
    assert stats(t).calls == 1 and stats(t).compiles >= 1
    start = inputs["input_ids"].shape[1]
    seq_s, seq_o = stock.sequences[:, start:], ours.sequences[:, start:]
    compared = 0
    for row in range(seq_s.shape[0]):
        for k in range(min(seq_s.shape[1], seq_o.shape[1])):
            z_s, z_o = stock.logits[k][row].float(), ours.logits[k][row].float()
            bound = _bound(z_s)
            if seq_s[row, k] != seq_o[row, k]:
                top = z_s.topk(2).values
                assert (top[0] - top[1]).item() <= bound, f"row {row} step {k}: tokens differ without a near-tie"
                break
            assert (z_s - z_o).abs().max().item() <= bound, f"row {row} step {k}: logits beyond the bound"
            compared += 1
    assert compared >= seq_s.numel() // 2  # most of the greedy tokens were compared, not cut short by ties
    leantrain.unpatch_trainer(t)


def test_sampled_rewards_agree_within_their_sampling_error(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path, device="cuda", dtype=torch.bfloat16, max_completion_length=24)
    tok = t.processing_class
    texts = generation.prompts(64) * 4  # 256 completions a side
    inputs = generation.batch(tok, texts, "cuda")
    start = inputs["input_ids"].shape[1]

    def rewards(out: torch.Tensor) -> torch.Tensor:
        return torch.tensor(generation.reward(tok.batch_decode(out[:, start:], skip_special_tokens=True)))

    stock = rewards(_generate(t, inputs, seed=1))
    leantrain.patch_trainer(t, **only("compile_generation"))
    ours = rewards(_generate(t, inputs, seed=2))
    error = math.sqrt(stock.var().item() / len(stock) + ours.var().item() / len(ours))
    assert abs(stock.mean().item() - ours.mean().item()) <= 4 * error
    leantrain.unpatch_trainer(t)


@pytest.mark.parametrize(
    "case",
    [
        dict(lora=True, gradient_checkpointing=True),
        dict(beta=0.04),
        dict(kind="rloo"),
        dict(steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=2),
    ],
    ids=["lora-checkpointing", "reference-model", "rloo", "steps-per-generation"],
)
def test_trainer_compiles_the_decode_step_once(model_dir, tmp_path, case):
    """Prompts of varying width every step, LoRA weights changing every step: one compile serves every call."""
    t = generation.trainer(model_dir, tmp_path, device="cuda", dtype=torch.bfloat16, max_steps=4, **case)
    report = leantrain.patch_trainer(t, **only("compile_generation"))
    assert report["compile_generation"].status is Status.APPLIED, report
    t.train()
    st = stats(t)
    assert st.compiles == 1 and st.calls >= 2, (st.compiles, st.calls, st.lengths)
    assert all(math.isfinite(x) for x in generation.losses(t))
    assert leantrain.current_report(t)["compile_generation"].status is Status.APPLIED


@pytest.mark.expect_fallback
def test_a_failing_compile_falls_back_to_stock_generate(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path, device="cuda", dtype=torch.bfloat16, max_steps=2)
    leantrain.patch_trainer(t, **only("compile_generation"))

    def broken(gm, example_inputs):
        raise RuntimeError("capture failed")

    stats(t).inner = broken
    with pytest.warns(RuntimeWarning, match="compile_generation failed at run time"):
        t.train()
    outcome = leantrain.current_report(t)["compile_generation"]
    assert outcome.status is Status.FAILED and "capture failed" in outcome.reasons[0]
    assert len(generation.losses(t)) == 2
