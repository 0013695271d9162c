"""The trainer cases' runs, tolerances and checks that test_trainers_distributed, test_moe4bit_distributed and
test_deepspeed share (a helper: a test module is never imported as one)."""

from __future__ import annotations

import math
import socket
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


pytest.importorskip("trl")
pytest.importorskip("datasets")

import _trainer_worker as worker  # noqa: E402


MARKS = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed"),
]


LR = 1e-3  # the worker's learning rate


# Tolerances (fp32). Measured on CPU (torch 2.13): loss <= 1.3e-7 relative, grad norm <= 2.8e-6 relative, parameters
# max |diff| <= 8.8e-6 and mean |diff| <= 2.5e-9; the negative control (per-rank normalization) is off by 1.5e-4
# relative in loss, 5e-3 in grad norm, 4e-3 max and 5e-5 mean in parameters.
# - loss: the global mean of two ranks' partial sums vs one sum differs in summation order only.
LOSS_RTOL, LOSS_ATOL = 2e-6, 1e-7


# - grad norm: DDP's all-reduce / FSDP2's reduce-scatter add the two halves in another order, and FSDP2 sums the
#   norm over shards; a few ulps of each gradient element add up in the norm.
NORM_RTOL = 2e-5


# - parameters after 2 AdamW steps: Adam divides each element by its own RMS, so an element whose gradient is at the
#   rounding level of the others (|g| ~ 1e-10..1e-8, near eps) still moves by up to ~1% of lr, and that move is set by
#   rounding. Bound the worst element at 5% of one step, and the mean, which averages the noise, tightly.
PARAM_MAX_ATOL = 0.05 * LR


PARAM_MEAN_ATOL = 1e-7


# - the 4-bit MoE (test_moe4bit_distributed.py, test_deepspeed.py): one embedding element (token 198 first appears at
#   step 2, where its gradient is a rounding-level ~1e-9 sum) takes Adam's first bias-corrected update,
#   lr * 0.53 g / (0.71 |g| + 1e-8), whose size and sign rounding decides: measured 1.05e-4 = 0.105 lr from the single
#   process under FSDP2 and ZeRO-2 (DDP 5.0e-5, ZeRO-3 3.3e-5), every other element within 1e-5. A quarter step
#   bounds it; the mean (measured <= 4.6e-10) keeps PARAM_MEAN_ATOL, which a real error (an expert output or
#   gradient off) exceeds by orders of magnitude.
MOE_PARAM_MAX_ATOL = 0.25 * LR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(engine: str, cases: list[str], out: Path, entry: Callable[..., None] = worker.run) -> dict[str, list[dict]]:
    """Run ``cases`` on ``worker.WORLD`` ranks under ``engine``: {case: [result per rank]}.

    A rank that raises fails here with its traceback (torch's ``ProcessRaisedException``). A rank killed by a signal
    fails with every rank's stderr tail, unless every result was already written: then the crash was in the
    process's exit, after everything this test compares, and it is reported as a warning."""
    files = {c: [out / f"{c}_rank{r}.pt" for r in range(worker.WORLD)] for c in cases}
    try:
        mp.spawn(entry, args=(worker.WORLD, free_port(), engine, cases, str(out)), nprocs=worker.WORLD, join=True)
    except mp.ProcessExitedException as died:
        missing = [p.name for paths in files.values() for p in paths if not p.exists()]
        message = f"{engine}: {died}\n{rank_logs(out)}"
        if missing:
            raise AssertionError(f"{message}\nresults never written: {', '.join(missing)}") from died
        warnings.warn(f"a rank died after writing every result (in its exit): {message}", stacklevel=2)
    return {c: [torch.load(p, weights_only=False) for p in paths] for c, paths in files.items()}


def rank_logs(out: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of each rank's stderr log (``worker.rank_log``)."""
    tails = []
    for rank in range(worker.WORLD):
        path = worker.rank_log(out, rank)
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
        tails.append(f"--- rank {rank} stderr (last {lines} lines) ---\n" + "\n".join(text))
    return "\n".join(tails)


def single_runs(cases: list[str] | tuple[str, ...], out: Path) -> dict[str, dict]:
    """Each case in this process as a lone process: no torchrun variables from the caller's environment."""
    with pytest.MonkeyPatch.context() as mpatch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mpatch.delenv(name, raising=False)
        return {c: worker.single(c, out / c) for c in cases}


def param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(max |a - b|, mean |a - b| over every element, name of the worst tensor)."""
    assert a.keys() == b.keys()
    worst = {n: (a[n] - b[n]).abs().max().item() for n in a}
    total = sum((a[n] - b[n]).abs().sum().item() for n in a)
    return max(worst.values()), total / sum(t.numel() for t in a.values()), max(worst, key=worst.get)


def trajectory_mismatches(ref: dict, got: dict, param_max_atol: float = PARAM_MAX_ATOL) -> list[str]:
    bad = []
    assert len(ref["loss"]) == len(got["loss"]) == worker.STEPS
    for step, (a, b) in enumerate(zip(ref["loss"], got["loss"])):
        if not math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL):
            bad.append(f"loss step {step}: {a} vs {b}")
    for step, (a, b) in enumerate(zip(ref["grad_norm"], got["grad_norm"])):
        if not math.isclose(a, b, rel_tol=NORM_RTOL):
            bad.append(f"grad_norm step {step}: {a} vs {b}")
    largest, mean, name = param_diff(ref["params"], got["params"])
    if largest > param_max_atol or mean > PARAM_MEAN_ATOL:
        bad.append(f"params: max |diff| {largest:.3g} ({name}), mean |diff| {mean:.3g}")
    return bad


def summary(reference: dict, got: dict) -> str:
    """The measured distances, for the log (``pytest -s``)."""
    largest, mean, _ = param_diff(reference["params"], got["params"])
    loss = max(abs(a - b) / abs(a) for a, b in zip(reference["loss"], got["loss"]))
    norm = max(abs(a - b) / a for a, b in zip(reference["grad_norm"], got["grad_norm"]))
    return f"loss rel {loss:.2g}, grad norm rel {norm:.2g}, params max {largest:.2g} mean {mean:.2g}"


def status(report: dict | None, name: str) -> str:
    """The optimization's status in a report dict; a patch-time ``NotReadyError`` reads "declined: <message>"."""
    if report is None:
        return "no report"
    if "declined" in report:
        return f"declined: {report['declined']}"
    return next(o["status"] for o in report["outcomes"] if o["name"] == name)


def assert_engine(result: dict, engine: str) -> None:
    assert result["world"] == worker.WORLD
    if engine == "fsdp2":
        assert result["distributed_type"] == "DistributedType.FSDP" and result["fsdp2"], "not really FSDP2"
    else:
        assert result["distributed_type"] == "DistributedType.MULTI_CPU" and not result["fsdp2"]


def check_cggr_routing(reference: dict, ranks: list[dict]) -> None:
    for step in range(worker.STEPS):
        local = [int(r["kept"][step].sum()) for r in ranks]
        valid = [int(r["valid"][step].sum()) for r in ranks]
        assert local[0] != local[1], "precondition: ranks hold different label counts"
        assert all(0 < k < v for k, v in zip(local, valid)), "CGGR masked nothing"
        assert [r["num_items"][step] for r in ranks] == [sum(local)] * worker.WORLD
        assert reference["num_items"][step] == sum(local)
        # same kept tokens, row by row (rank rows are right-padded to their own width)
        ref_kept = reference["kept"][step]
        rows = 0
        for r in ranks:
            kept = r["kept"][step]
            width = kept.shape[1]
            assert torch.equal(kept, ref_kept[rows : rows + len(kept), :width])
            assert not ref_kept[rows : rows + len(kept), width:].any()
            rows += len(kept)
        assert rows == len(ref_kept)


def check_grpo_batch(reference: dict, ranks: list[dict]) -> None:
    per_step = len(reference["completions"]) // worker.STEPS
    merged = []
    for step in range(worker.STEPS):
        for r in ranks:
            share = len(r["completions"]) // worker.STEPS
            merged += r["completions"][step * share : (step + 1) * share]
    assert len(merged) == len(reference["completions"]) == per_step * worker.STEPS
    assert merged == reference["completions"]
    head = tuple(reference["params"]["lm_head.weight"].shape)
    for r in ranks:
        # policy (with grad) and reference model once per step at least
        assert len(r["op_calls"]) >= 2 * worker.STEPS and set(r["op_calls"]) == {head}
