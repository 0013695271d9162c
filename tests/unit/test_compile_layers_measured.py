"""compile_layers' measured rows against the committed results, and the auto rule's reason on 4-bit layers."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from leantrain.compile_layers.measured import QUANTIZED_4BIT
from leantrain.compile_layers.probe import slower_reason


RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "vs_unsloth.json"


def committed(provider: str, metric: str) -> float:
    rows = json.loads(RESULTS.read_text())
    row = next(
        r for r in rows if r["x_value"] == "llama-3.2-1b-qlora" and r["provider"] == provider and r["metric"] == metric
    )
    return row["p50"]


def test_the_4bit_row_is_the_committed_qlora_measurement():
    eager, compiled = (committed(p, "speed") for p in ("leantrain", "leantrain_compiled"))
    assert QUANTIZED_4BIT.saving_ms == pytest.approx(eager - compiled, abs=0.05)
    first = [committed(p, "first step") for p in ("leantrain", "leantrain_compiled")]
    assert QUANTIZED_4BIT.compile_s == pytest.approx(first[1] - first[0], abs=0.05)
    peaks = [committed(p, "memory") for p in ("leantrain", "leantrain_compiled")]
    assert f"peak memory {peaks[0]:.2f} -> {peaks[1]:.2f} GiB" in QUANTIZED_4BIT.evidence.detail


def test_auto_leaves_4bit_layers_eager_and_says_why():
    class Linear4bit(nn.Module):  # bitsandbytes' class, by name (the probe reads names, importing nothing)
        pass

    layer = nn.Sequential(nn.Linear(2, 2), Linear4bit())
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(device=torch.device("cuda")))
    reason = slower_reason(trainer, "sft", "llama", layer)
    assert isinstance(reason, str)
    assert "Linear4bit" in reason and QUANTIZED_4BIT.evidence.detail in reason
    assert "compile_layers=True" in reason
