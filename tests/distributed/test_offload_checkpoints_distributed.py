"""offload_checkpoints under accelerate's DDP and FSDP2 (2 processes, gloo, CPU): each rank's hooks move its own
checkpointed layer inputs, and the run trains exactly as stock checkpointing on the same engine (the recompute gets
an exact copy of each input: the same ops in fp32 on CPU, so the losses, gradient norms and weights are equal)."""

from __future__ import annotations

import pytest
import torch
from _trainer_cases import MARKS, spawn, status, worker


pytestmark = MARKS


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_each_rank_offloads_and_trains_as_stock_checkpointing(engine, tmp_path):
    runs = spawn(engine, ["sft_checkpointed", "sft_offload"], tmp_path)
    for rank, (stock, ours) in enumerate(zip(runs["sft_checkpointed"], runs["sft_offload"], strict=True)):
        assert status(ours["patched"], "offload_checkpoints") == "applied", (rank, ours["patched"])
        assert status(ours["report"], "offload_checkpoints") == "applied", (rank, ours["report"])  # no fallback
        assert ours["packed"] >= worker.STEPS, (rank, ours["packed"])  # every step moved its layer inputs
        assert ours["loss"] == stock["loss"] and ours["grad_norm"] == stock["grad_norm"], rank
        for name, value in stock["params"].items():
            assert torch.equal(ours["params"][name], value), (rank, name)
