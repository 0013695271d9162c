"""The trainer-level optimizations under real DeepSpeed ZeRO-2 and ZeRO-3 engines (2 processes, gloo, CPU),
compared with one process on the same global batch, as ``test_trainers_distributed.py`` does for DDP and FSDP2:

- GRPO + fused log-probs (``grpo_logps``), full fine-tune with an untied, trainable LM head and a reference model
  (beta > 0): applies under both stages and matches the single-process run and the stock DeepSpeed run; under ZeRO-3
  the head is really partitioned and the op sees it whole, in the forward and in the backward recompute.
- SFT + CGGR: applies under both stages; same kept labels and loss normalization as the single process.
- SFT + OSFT: declines (DeepSpeed keeps gradients in its own partitions) and training runs stock.
- A plain Trainer on a tiny 4-bit MoE (``moe4bit``): applies under ZeRO-2 (frozen packed experts stay whole) and
  declines under ZeRO-3 (which partitions them), training stock.

Setup (``_trainer_worker``): ``TrainingArguments(deepspeed=<dict>)`` with fp32, ``use_cpu=True`` and
``deepspeed.init_distributed("gloo")`` before any model exists. The Llama cases load a saved seeded model by path,
so under ZeRO-3 ``zero.Init`` partitions it from the start (as a real ZeRO-3 fine-tune does); the MoE is quantized
before the arguments exist (a partitioned stack could not be quantized) and DeepSpeed partitions it at
``deepspeed.initialize``. Each stage is one ``torch.multiprocessing.spawn`` running every case.

Cost (2 CPU cores): about 55 s with the ``deepspeed_shm_comm`` extension cached (ZeRO-2 spawn + the single-process
references ~28 s, ZeRO-3 spawn ~23 s); the first run on a machine compiles it (g++, ~50 s more, cached under
``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import math

import pytest
import torch


pytest.importorskip("deepspeed")
pytest.importorskip("trl")
pytest.importorskip("datasets")

import _trainer_cases as base  # noqa: E402  (helpers and tolerances shared with test_trainers_distributed)
import _trainer_worker as worker  # noqa: E402


pytestmark = base.MARKS  # distributed, slow, needs torch.distributed

ENGINES = tuple(worker.ZERO_STAGES)
MOE_SKIP = worker.moe_skip_reason()
CASES = ("grpo_stock", "grpo_fused", "sft_cggr", "sft_osft", "sft_fused_ce") + (() if MOE_SKIP else ("moe4bit",))
REFERENCES = ("grpo_fused", "sft_cggr", "sft_stock", "sft_fused_ce") + (() if MOE_SKIP else ("moe4bit",))  # 1 process
# Tolerances: base's (derived in its module; MOE_PARAM_MAX_ATOL for the MoE). Measured under ZeRO-2 / ZeRO-3 vs one
# process: loss <= 1.2e-7 relative, grad norm <= 4.3e-6 relative, parameters max |diff| <= 8.2e-6 and mean <= 4.5e-10
# (GRPO, CGGR, stock SFT); MoE max 1.05e-4 (ZeRO-2) / 3.3e-5 (ZeRO-3), mean <= 4.6e-10.


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(engine)`` -> {case: [result per rank]} ('single': {case: result}), computed once per engine."""
    cache: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in cache:
            out = tmp_path_factory.mktemp(engine)
            if engine == "single":
                cache[engine] = base.single_runs(REFERENCES, out)
            else:
                with pytest.MonkeyPatch.context() as mpatch:
                    mpatch.setenv("DS_ACCELERATOR", "cpu")  # inherited by the spawned ranks
                    cache[engine] = base.spawn(engine, list(CASES), out)
        return cache[engine]

    return get


def assert_deepspeed(ranks: list[dict], engine: str) -> None:
    """A real DeepSpeed engine of this stage on 2 ranks, whose (gathered) parameters agree exactly."""
    for result in ranks:
        assert result["world"] == worker.WORLD
        assert result["distributed_type"] == "DistributedType.DEEPSPEED"
        assert result["zero_stage"] == worker.ZERO_STAGES[engine]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def assert_applied(ranks: list[dict], name: str) -> None:
    """Applied on every rank at patch time and still after training (no run-time fallback)."""
    for rank, result in enumerate(ranks):
        assert base.status(result["patched"], name) == "applied", (rank, base.status(result["patched"], name))
        assert base.status(result["report"], name) == "applied", (rank, result["report"])


@pytest.mark.parametrize("engine", ENGINES)
def test_stock_grpo_matches_single_process(runs, engine):
    """The engine itself: unpatched GRPO under ZeRO-2/3 follows the single-process (fused) trajectory, and under
    ZeRO-3 the trainable head is partitioned (an empty local tensor, each rank holding half of its elements)."""
    ranks = runs(engine)["grpo_stock"]
    assert_deepspeed(ranks, engine)
    reference = runs("single")["grpo_fused"]
    print(f"grpo_stock/{engine}: {base.summary(reference, ranks[0])}")
    assert base.trajectory_mismatches(reference, ranks[0]) == []
    vocab, hidden = reference["params"]["lm_head.weight"].shape
    for r in ranks:
        head = r["head"]
        assert head["requires_grad"]
        if engine == "zero3":
            assert head["shape"] == (0,) and head["ds_shape"] == (vocab, hidden) and head["ds_numel"] == vocab * hidden
            assert head["slice"] == vocab * hidden // worker.WORLD
        else:
            assert head["shape"] == (vocab, hidden) and head["ds_numel"] is None


@pytest.mark.parametrize("engine", ENGINES)
def test_grpo_logps_applies_and_matches_single_process_and_stock(runs, engine):
    """grpo_logps applies on both stages, with no run-time fallback; the op sees the full [V, H] head in every forward
    (policy and reference model) and in the trainable head's backward recompute, though ZeRO-3 keeps it partitioned
    outside; loss, grad norm and parameters after 2 steps match the single process and stock GRPO on this engine."""
    ranks = runs(engine)["grpo_fused"]
    assert_deepspeed(ranks, engine)
    assert_applied(ranks, "grpo_logps")
    reference = runs("single")["grpo_fused"]
    base.check_grpo_batch(reference, ranks)  # same completions, full head in every forward
    head = tuple(reference["params"]["lm_head.weight"].shape)
    for r in ranks:
        assert len(r["recompute_calls"]) == worker.STEPS and set(r["recompute_calls"]) == {head}
    stock = runs(engine)["grpo_stock"][0]
    print(f"grpo_fused/{engine}: vs single {base.summary(reference, ranks[0])}")
    print(f"grpo_fused/{engine}: vs stock {base.summary(stock, ranks[0])}")
    assert base.trajectory_mismatches(reference, ranks[0]) == []
    assert base.trajectory_mismatches(stock, ranks[0]) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_cggr_applies_and_matches_single_process(runs, engine):
    """CGGR applies on both stages; each rank keeps exactly the single process's labels of its rows, every rank
    divides by the global kept count, and the trajectory matches (ZeRO-3: the model is partitioned when patched)."""
    ranks = runs(engine)["sft_cggr"]
    assert_deepspeed(ranks, engine)
    assert_applied(ranks, "cggr")
    reference = runs("single")["sft_cggr"]
    base.check_cggr_routing(reference, ranks)
    print(f"sft_cggr/{engine}: {base.summary(reference, ranks[0])}")
    assert base.trajectory_mismatches(reference, ranks[0]) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_fused_ce_applies_and_matches_single_process_and_stock(runs, engine):
    """The fused LM-head loss applies on both stages and serves every micro-batch (ZeRO-3: the head is gathered for
    the op); the trajectory matches the single process and stock SFT (it keeps the math)."""
    ranks = runs(engine)["sft_fused_ce"]
    assert_deepspeed(ranks, engine)
    assert_applied(ranks, "fused_ce")
    reference = runs("single")["sft_fused_ce"]
    assert reference["fused_calls"] and all(r["fused_calls"] == reference["fused_calls"] for r in ranks)
    print(f"sft_fused_ce/{engine}: {base.summary(reference, ranks[0])}")
    assert base.trajectory_mismatches(reference, ranks[0]) == []
    assert base.trajectory_mismatches(runs("single")["sft_stock"], ranks[0]) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_osft_declines_naming_deepspeed_and_trains_stock(runs, engine):
    """OSFT declines at patch time with a reason naming DeepSpeed, leaves the model dense (every parameter trains,
    no factors) and the run follows stock single-process SFT."""
    ranks = runs(engine)["sft_osft"]
    assert_deepspeed(ranks, engine)
    reference = runs("single")["sft_stock"]
    for r in ranks:
        assert "declined" in r["patched"] and "DeepSpeed" in r["patched"]["declined"], r["patched"]
        assert r["trainable"] == sorted(reference["params"]) and r["overlap"] is None
    print(f"sft_osft/{engine}: {base.summary(reference, ranks[0])}")
    assert base.trajectory_mismatches(reference, ranks[0]) == []


@pytest.mark.skipif(bool(MOE_SKIP), reason=MOE_SKIP or "")
@pytest.mark.parametrize("engine", ENGINES)
def test_moe4bit_applies_under_zero2_declines_under_zero3(runs, engine):
    """ZeRO-2 leaves the frozen packed uint8 stacks whole on every rank: moe4bit applies and the grouped path runs in
    every experts forward. ZeRO-3 partitions them: moe4bit declines, naming ZeRO-3, and the stock loop trains.
    Either way the trajectory matches the single process (patched: the grouped path equals the loop in fp32)."""
    ranks = runs(engine)["moe4bit"]
    assert_deepspeed(ranks, engine)
    reference = runs("single")["moe4bit"]
    assert base.status(reference["report"], "moe4bit") == "applied"
    for r in ranks:
        stacks = r["stacks"].values()
        assert len(stacks) == 2 * worker.MOE_LAYERS
        assert all(s["dtype"] == "torch.uint8" and not s["requires_grad"] for s in stacks)
        numel = [math.prod(s["ds_shape"] or s["shape"]) for s in stacks]
        if engine == "zero2":
            assert [s["local_numel"] for s in stacks] == numel  # whole
            assert len(r["grouped_calls"]) == worker.MOE_LAYERS * worker.STEPS
        else:
            assert all(s["shape"] == (0,) for s in stacks)  # partitioned: released outside a gather
            assert [s["local_numel"] for s in stacks] == [n // worker.WORLD for n in numel]
            assert "declined" in r["patched"] and "ZeRO-3" in r["patched"]["declined"], r["patched"]
            assert r["grouped_calls"] == []
    if engine == "zero2":
        assert_applied(ranks, "moe4bit")
    print(f"moe4bit/{engine}: {base.summary(reference, ranks[0])}")
    assert base.trajectory_mismatches(reference, ranks[0], param_max_atol=base.MOE_PARAM_MAX_ATOL) == []
