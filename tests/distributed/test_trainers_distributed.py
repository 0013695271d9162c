"""Every trainer-level optimization under a real 2-process gloo engine on CPU, compared with one process on the same
global batch: TRL SFT + CGGR, GRPO + fused log-probs, SFT + OSFT, each under accelerate's DDP (MULTI_CPU) and FSDP2,
patched with ``leantrain.patch_trainer`` before ``train()`` wraps the model.

Same global batch: 2 ranks x 2 rows vs 1 process x 4 rows, sequential order (accelerate hands rank r the r-th
per-device slice of each global batch), same seed, fp32, no dropout; GRPO completions are a fixed function of the
prompt (see ``_trainer_worker.fixed_rollout``). The worker is in ``_trainer_worker.py``; each engine is one
``torch.multiprocessing.spawn`` that runs all its cases, and the single-process references run in this process.

FSDP2 on CPU: accelerate 1.15 only enables FSDP for GPU process groups, so the worker promotes the shared state to
FSDP before the trainer adopts it (``enable_fsdp_on_cpu``); the tests check that the parameters really are DTensors.
"""

from __future__ import annotations

import pytest
import torch


pytest.importorskip("trl")
pytest.importorskip("datasets")

from _trainer_cases import (  # noqa: E402
    MARKS,
    PARAM_MAX_ATOL,
    PARAM_MEAN_ATOL,
    assert_engine,
    check_cggr_routing,
    check_grpo_batch,
    param_diff,
    single_runs,
    spawn,
    status,
    summary,
    trajectory_mismatches,
)


pytestmark = MARKS

CASES = {"sft_cggr": "cggr", "grpo_fused": "grpo_logps", "sft_osft": "osft", "sft_fused_ce": "fused_ce"}
# (case -> the optimization it applies, every other one off)
ENGINES = ("ddp", "fsdp2")
CONTROL = "sft_cggr_local_norm"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(engine)`` -> {case: [result per rank]} ('single': one result), computed once per engine."""
    cache: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in cache:
            out = tmp_path_factory.mktemp(engine)
            if engine == "single":
                cache[engine] = single_runs(CASES, out)
            else:
                cases = list(CASES) + ([CONTROL] if engine == "ddp" else [])
                cache[engine] = spawn(engine, cases, out)
        return cache[engine]

    return get


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(runs, case, engine):
    """Loss and grad norm per step and all parameters after 2 optimizer steps equal the single-process run; the
    optimization was applied on every rank and still is after training (no run-time fallback)."""
    reference = runs("single")[case]
    ranks = runs(engine)[case]
    name = CASES[case]
    assert status(reference["report"], name) == "applied"
    for rank, result in enumerate(ranks):
        assert_engine(result, engine)
        assert status(result["patched"], name) == "applied", (rank, result["patched"])
        assert status(result["report"], name) == "applied", (rank, result["report"])  # after train(): no fallback
    for name_, value in ranks[0]["params"].items():  # replicas (DDP) / gathered shards (FSDP2) agree exactly
        assert torch.equal(value, ranks[1]["params"][name_]), name_
    print(f"{case}/{engine}: {summary(reference, ranks[0])}")
    assert trajectory_mismatches(reference, ranks[0]) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_fused_ce_serves_every_micro_batch_on_every_rank(runs, engine):
    """The fused LM-head loss computes each rank's loss in every training forward, as many calls as the single
    process makes (same steps and accumulation; each rank holds half of the rows)."""
    reference = runs("single")["sft_fused_ce"]["fused_calls"]
    assert reference and set(reference) <= {"token_stats", "head_loss"}, reference
    for rank, result in enumerate(runs(engine)["sft_fused_ce"]):
        assert result["fused_calls"] == reference, rank


@pytest.mark.parametrize("engine", ENGINES)
def test_cggr_routes_locally_and_normalizes_like_the_trainer(runs, engine):
    """Each rank masks its own rows exactly as the single process masks them, and every rank's loss is divided by
    the kept-label count of the whole global batch (``average_tokens_across_devices``), like stock SFT."""
    check_cggr_routing(runs("single")["sft_cggr"], runs(engine)["sft_cggr"])


@pytest.mark.parametrize("engine", ENGINES)
def test_grpo_same_global_batch_and_full_head(runs, engine):
    """The ranks together scored exactly the single process's prompts and completions, and the fused op ran on every
    rank with the full [V, H] LM-head weight (FSDP2 shards it: TRL hands over ``full_tensor()``)."""
    check_grpo_batch(runs("single")["grpo_fused"], runs(engine)["grpo_fused"])


@pytest.mark.parametrize("engine", ENGINES)
def test_osft_trains_the_low_factors_orthogonally(runs, engine):
    """Every rank trains the same factors (the low singular triplets of each target, no dense target weight) and
    after 2 steps they are still orthogonal to the frozen ones, whatever shard layout accelerate chose."""
    reference = runs("single")["sft_osft"]
    targets = next(o["targets"] for o in reference["report"]["outcomes"] if o["name"] == "osft")
    assert targets
    for r in runs(engine)["sft_osft"]:
        assert r["trainable"] == reference["trainable"]
        for target in targets:
            assert {f"{target}.{f}" for f in ("U_low", "S_low", "V_low")} <= set(r["trainable"]), target
            assert f"{target}.weight" not in r["trainable"] and f"{target}.U_high" not in r["trainable"]
        assert r["overlap"] <= 1e-5  # |cos| frozen vs trained directions, fp32 factors (single: ~1e-6)


def test_negative_control_per_rank_normalization_is_caught(runs):
    """With ``average_tokens_across_devices=False`` each rank divides by its own kept count: the same comparison
    must fail, by far, on loss, grad norm and parameters."""
    reference = runs("single")["sft_cggr"]
    control = runs("ddp")[CONTROL]
    assert [r["num_items"] for r in control] == [[int(k.sum()) for k in r["kept"]] for r in control]
    bad = trajectory_mismatches(reference, control[0])
    assert any(b.startswith("loss") for b in bad) and any(b.startswith("params") for b in bad), bad
    largest, mean, _ = param_diff(reference["params"], control[0]["params"])
    assert largest > 20 * PARAM_MAX_ATOL and mean > 20 * PARAM_MEAN_ATOL
