"""compile_generation under accelerate's DDP (2 processes, gloo, CPU): every rank compiles its own decode step once
and samples exactly the completions stock generate samples on that rank (same seeds, same prompts; ``aot_eager``
runs the same ops as eager in fp32), so the trained weights match stock's too."""

from __future__ import annotations

import pytest
import torch
from _trainer_cases import MARKS, spawn, status, trajectory_mismatches


pytestmark = MARKS
pytest.importorskip("transformers", minversion="5")


def test_each_rank_compiles_once_and_samples_what_stock_samples(tmp_path):
    runs = spawn("ddp", ["grpo_generate", "grpo_compiled_generate"], tmp_path)
    for rank, (stock, ours) in enumerate(zip(runs["grpo_generate"], runs["grpo_compiled_generate"], strict=True)):
        assert status(ours["patched"], "compile_generation") == "applied", (rank, ours["patched"])
        assert status(ours["report"], "compile_generation") == "applied", (rank, ours["report"])  # no fallback
        compiles, calls = ours["compiles"]
        assert compiles == 1 and calls >= 2, (rank, compiles, calls)
        assert ours["completions"] and ours["completions"] == stock["completions"], rank
        assert trajectory_mismatches(stock, ours) == [], rank
    first, second = (r["completions"] for r in runs["grpo_compiled_generate"])
    assert first != second  # each rank sampled its own share of the prompts
    for name, value in runs["grpo_compiled_generate"][0]["params"].items():
        assert torch.equal(value, runs["grpo_compiled_generate"][1]["params"][name]), name
