"""Compiled decoding against stock ``generate`` on CPU, fp32, the same trainer and seed: the decode step compiled
over leantrain's static cache (``compile_generation=True``; the auto rule skips CPU, where nothing is measured).

What is exact and why: fp32 on CPU, the compiled decode step runs the same aten ops as the eager one
(``aot_eager``: Dynamo's graph, no fusion), so greedy and sampled tokens are identical and the logits differ only
where the static cache's masked positions change the attention's summation blocks: within 8u·√(2L+2)·max|z| (the
parity suite's one-forward bound, u = 2^-24). Sampling draws from the same generator in the same order (the logits
processors and the draw stay eager), so whole GRPO runs give the same completions, losses and weights. Inductor (the
default backend) fuses, so its logits move by rounding: a slow test holds it to the same bound and the same tokens."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import leantrain
from leantrain import Status
from leantrain.compile_generation import stats
from leantrain.compile_generation.patch import COMPILE_STATE
from testkit import generation
from testkit.optimizations import only


trl = pytest.importorskip("trl")
pytestmark = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5, reason="compile_generation needs transformers >= 5"
)
U = 2.0**-24
LAYERS = 2
FAST = {"compile_generation_backend": "aot_eager"}  # the same ops as eager, compiled in seconds on CPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return generation.save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), layers=LAYERS)


def _bound(z: torch.Tensor) -> float:
    return 8 * U * math.sqrt(2 * LAYERS + 2) * z.abs().max().item()


def _patch(t, **options):
    report = leantrain.patch_trainer(t, **{**only("compile_generation"), **FAST, **options})
    assert report["compile_generation"].status is Status.APPLIED, report
    return report


def _generate(t, inputs, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return t.model.generate(**inputs, generation_config=t.generation_config)


def _greedy_pair(model_dir, tmp_path, **options):
    t = generation.trainer(model_dir, tmp_path, max_completion_length=16, generation_kwargs={"do_sample": False})
    config = copy.deepcopy(t.generation_config)
    config.output_logits, config.return_dict_in_generate = True, True
    t.generation_config = config
    inputs = generation.batch(t.processing_class, generation.prompts(6))
    stock = _generate(t, inputs)
    _patch(t, **options)
    ours = _generate(t, inputs)
    return t, stock, ours


def _assert_same_greedy(stock, ours):
    assert torch.equal(stock.sequences, ours.sequences)
    for k, (z_s, z_o) in enumerate(zip(stock.logits, ours.logits)):
        assert (z_s - z_o).abs().max().item() <= _bound(z_s), f"step {k}: logits beyond the bound"


def test_greedy_tokens_equal_and_logits_within_rounding(model_dir, tmp_path):
    t, stock, ours = _greedy_pair(model_dir, tmp_path)
    _assert_same_greedy(stock, ours)
    assert stats(t).calls == 1 and stats(t).compiles == 1


@pytest.mark.slow
def test_inductor_greedy_tokens_equal_and_logits_within_rounding(model_dir, tmp_path):
    t, stock, ours = _greedy_pair(model_dir, tmp_path, compile_generation_backend="inductor")
    _assert_same_greedy(stock, ours)


def _run(model_dir, tmp_path, patch: bool, **config):
    record: list[str] = []
    t = generation.trainer(model_dir, tmp_path, record=record, **config)
    if patch:
        _patch(t)
    t.train()
    return t, record


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(lora=True, gradient_checkpointing=True), id="lora-checkpointing"),
        pytest.param(dict(), id="full", marks=pytest.mark.slow),
        pytest.param(dict(beta=0.04), id="reference-model", marks=pytest.mark.slow),
        pytest.param(dict(kind="rloo"), id="rloo", marks=pytest.mark.slow),
    ],
)
def test_sampled_runs_equal_stock(model_dir, tmp_path, case):
    """Same seed: the same completions, losses and trained weights as stock, every step."""
    stock, stock_texts = _run(model_dir, tmp_path / "stock", False, **case)
    ours, our_texts = _run(model_dir, tmp_path / "ours", True, **case)
    assert our_texts == stock_texts
    for a, b in zip(generation.losses(stock), generation.losses(ours), strict=True):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (a, b)
    ref = generation.trainable(stock)
    for name, value in generation.trainable(ours).items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6)
    st = stats(ours)
    assert st.compiles == 1 and st.calls == 3  # prompts of varying width: one compile for every call


# Each option of the generation config TRL builds, changed alone: the completions stay stock's.
OPTION_MATRIX = [
    dict(temperature=1.3),
    dict(top_k=5),
    dict(top_p=0.8),
    dict(min_p=0.05),
    dict(repetition_penalty=1.3),
    dict(max_completion_length=5),
    dict(num_generations=2, per_device_train_batch_size=4),
    dict(steps_per_generation=2, gradient_accumulation_steps=2),
    dict(num_iterations=2),
    dict(generation_kwargs={"eos_token_id": [1, 17, 42]}),  # stop tokens: generation ends at the first one
]


@pytest.mark.slow
@pytest.mark.parametrize("case", OPTION_MATRIX, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())[:40])
def test_generation_options_equal_stock(model_dir, tmp_path, case):
    _, stock_texts = _run(model_dir, tmp_path / "stock", False, max_steps=2, **case)
    ours, our_texts = _run(model_dir, tmp_path / "ours", True, max_steps=2, **case)
    assert our_texts == stock_texts
    assert stats(ours).compiles == 1


def test_unpatch_restores_generate_and_drops_the_compiled_call(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path, max_steps=1)
    original = t.model.generate
    _patch(t)
    assert t.model.generate is not original
    t.train()
    base = t.model
    assert any(name in vars(base) for name in COMPILE_STATE)
    leantrain.unpatch_trainer(t)
    assert t.model.generate == original and "generate" not in vars(t.model)
    assert not any(name in vars(base) for name in COMPILE_STATE)


def test_other_generate_calls_pass_through(model_dir, tmp_path):
    """Evaluation or the user's own calls (another generation config) run stock generate."""
    t = generation.trainer(model_dir, tmp_path)
    _patch(t)
    inputs = generation.batch(t.processing_class, generation.prompts(2))
    with torch.no_grad():
        t.model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert stats(t).calls == 0


def test_a_longer_prompt_grows_the_cache_and_recompiles_within_the_limit(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path)
    _patch(t)
    tok = t.processing_class
    short = generation.batch(tok, ["a b c"] * 4)
    long = generation.batch(tok, [" ".join(["word"] * 90)] * 4)
    _generate(t, short)
    _generate(t, short)
    assert stats(t).lengths == {4: 64} and stats(t).compiles == 1
    _generate(t, long)
    assert stats(t).lengths[4] >= long["input_ids"].shape[1] + 12 and stats(t).compiles == 2


@pytest.mark.expect_fallback
def test_past_the_recompile_limit_stock_generate_serves(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path)
    _patch(t, compile_generation_max_recompiles=0)
    tok = t.processing_class
    _generate(t, generation.batch(tok, ["a b c"] * 4))
    with pytest.warns(RuntimeWarning, match="recompiled 1 times"):
        _generate(t, generation.batch(tok, ["a b c"] * 2))  # a new batch size: a recompile past the limit
    outcome = leantrain.current_report(t)["compile_generation"]
    assert outcome.status is Status.FAILED and "compile_generation_max_recompiles=0" in outcome.reasons[0]


@pytest.mark.slow
@pytest.mark.expect_fallback
def test_a_failing_compile_warns_once_and_training_goes_on(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path, max_steps=2)
    _patch(t)

    def broken(gm, example_inputs):
        raise RuntimeError("capture failed")

    stats(t).inner = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train()
    ours = [w for w in caught if "compile_generation failed at run time" in str(w.message)]
    assert len(ours) == 1 and len(generation.losses(t)) == 2
    assert leantrain.current_report(t)["compile_generation"].status is Status.FAILED


def test_auto_skips_cpu_with_the_reason_and_strict_has_nothing_to_hold(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path)
    report = leantrain.patch_trainer(t, strict=True, environ={})
    outcome = report["compile_generation"]
    assert outcome.status is Status.SKIPPED
    assert outcome.reasons[0].startswith("not measured on cpu (measured faster on CUDA only: qwen2 on H200")


@pytest.mark.parametrize(
    "config, reason",
    [
        (dict(cache_implementation="offloaded"), "cache_implementation='offloaded'"),
        (dict(generation_kwargs={"num_beams": 2}), "num_beams=2"),
    ],
)
def test_declines_what_it_cannot_serve(model_dir, tmp_path, config, reason):
    t = generation.trainer(model_dir, tmp_path, **config)
    with pytest.raises(leantrain.NotReadyError, match=reason):
        leantrain.patch_trainer(t, compile_generation=True)


def test_declines_vllm_with_the_reason(model_dir, tmp_path):
    t = generation.trainer(model_dir, tmp_path)
    t.use_vllm = True  # what GRPOConfig(use_vllm=True) sets (vLLM itself is not installed here)
    with pytest.raises(leantrain.NotReadyError, match="use_vllm=True: vLLM generates"):
        leantrain.patch_trainer(t, compile_generation=True)


@pytest.mark.slow
def test_trl_static_cache_flag_is_served(model_dir, tmp_path):
    """TRL's own cache_implementation='static' (a static cache, no compile): leantrain's cache and compile serve it."""
    stock, stock_texts = _run(model_dir, tmp_path / "stock", False, cache_implementation="static", max_steps=2)
    ours, our_texts = _run(model_dir, tmp_path / "ours", True, cache_implementation="static", max_steps=2)
    assert our_texts == stock_texts and stats(ours).compiles == 1


def test_patching_warms_inductors_compile_workers_with_its_backend_and_model(model_dir, tmp_path, monkeypatch):
    """The decode step's first compile comes at the first generation: the compile workers start at patch time
    (``compiling.warm_compile_workers``; only inductor on CUDA starts any, tests/unit/test_compile_workers.py)."""
    from leantrain.compile_generation import patch as generation_patch
    from leantrain.models import unwrap_model

    seen = []
    monkeypatch.setattr(generation_patch, "warm_compile_workers", lambda backend, model: seen.append((backend, model)))
    t = generation.trainer(model_dir, tmp_path, max_steps=1)
    _patch(t)
    assert seen == [("aot_eager", unwrap_model(t.model))]
    leantrain.unpatch_trainer(t)
