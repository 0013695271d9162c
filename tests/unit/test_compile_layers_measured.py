"""compile_layers' measured rows against the committed results, and the auto rule's reason on 4-bit layers."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from leantrain.compile_layers.measured import BACKGROUND_MOE_4BIT, MOE_4BIT, QUANTIZED_4BIT
from leantrain.compile_layers.probe import background_choice, slower_reason


RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "vs_unsloth.json"
QLORA_RESULTS = RESULTS.parent / "vs_unsloth_qlora_eager_compiled.json"  # the layers eager and compiled, one run


def committed(provider: str, metric: str) -> float:
    rows = json.loads(QLORA_RESULTS.read_text())
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


class Linear4bit(nn.Module):  # bitsandbytes' class, by name (the probe reads names, importing nothing)
    pass


def _trainer(max_steps: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(args=types.SimpleNamespace(device=torch.device("cuda"), max_steps=max_steps))


def test_auto_weighs_4bit_layers_with_the_qlora_row():
    """4-bit layers are weighed with the QLoRA measurement (not the family's LoRA one): a long run compiles them and
    says why with that evidence; a run too short to pay the compile back leaves them eager with the arithmetic."""
    layer = nn.Sequential(nn.Linear(2, 2), Linear4bit())
    applies = slower_reason(_trainer(1000), "sft", "llama", layer)
    assert applies[0] is None and "pays back within this run" in applies[1]
    assert "1000 steps x 54 ms saved" in applies[1] and QUANTIZED_4BIT.evidence.detail in applies[1]
    short = slower_reason(_trainer(100), "sft", "llama", layer)
    assert isinstance(short, str) and "does not pay back" in short and "pays back from step 190" in short
    assert QUANTIZED_4BIT.evidence.detail in short


def test_4bit_layers_of_an_unmeasured_family_are_not_compiled_by_auto():
    reason = slower_reason(_trainer(1000), "sft", "mistral", nn.Sequential(Linear4bit()))
    assert isinstance(reason, str) and reason.startswith("not measured on mistral")


def test_the_moe_row_is_the_committed_in_process_measurement():
    """The MoE row's saving is the smaller of the committed in-process runs' (eager minus compiled), its compile cost
    the compiled moe-qlora run's whole first step."""
    rows = json.loads((RESULTS.parent / "moe_compiled_ab.json").read_text())
    runs = [rows[i : i + 2] for i in range(0, len(rows), 2)]
    savings = [base["p50"] - compiled["p50"] for base, compiled in runs]
    assert [(base["provider"], compiled["provider"]) for base, compiled in runs] == [("base", "leantrain")] * 2
    assert MOE_4BIT.saving_ms == pytest.approx(min(savings), abs=0.05)
    first = next(
        r["p50"] for r in json.loads(RESULTS.read_text())
        if r["x_value"] == "moe-qlora" and r["provider"] == "leantrain_compiled" and r["metric"] == "first step"
    )  # fmt: skip
    assert MOE_4BIT.compile_s == pytest.approx(first, abs=0.05)
    for base, compiled in runs:
        assert f"{base['p50']:.1f} -> {compiled['p50']:.1f} ms" in MOE_4BIT.evidence.detail


def _first_steps(name: str, provider: str) -> list[float]:
    rows = json.loads((RESULTS.parent / f"vs_unsloth_rounds_moe-qlora_{name}.json").read_text())
    return [r["p50"] for r in rows if r["provider"] == provider and r["metric"] == "first step"]


def test_the_background_evidence_is_the_committed_rounds():
    """Auto mode's background evidence quotes the committed runs' first steps: the background compile's and the
    in-process compile's, in run order."""
    background = _first_steps("background", "leantrain_background") + _first_steps(
        "background_fake_inputs", "leantrain_background"
    )
    compiled = _first_steps("background", "leantrain_compiled")
    assert len(background) == 3 and len(compiled) == 2
    quoted = " / ".join(f"{s:.1f}" for s in background) + " s against " + " / ".join(f"{s:.1f}" for s in compiled)
    assert f"first step {quoted} s compiled in the training process" in BACKGROUND_MOE_4BIT.detail
    assert max(background) <= 10 < min(compiled)


class Experts(nn.Module):  # holds a bitsandbytes 4-bit layer, by its class's module (the probe imports nothing)
    def __init__(self) -> None:
        super().__init__()
        self.stack = type("Linear4bit", (nn.Module,), {"__module__": "bitsandbytes.nn.modules"})()


def _cfg(**given) -> types.SimpleNamespace:
    values = {"compile_layers_background": None, "compile_layers_backend": "inductor"}
    return types.SimpleNamespace(**{**values, "compile_layers_dynamic": "auto", **given})


def test_auto_compiles_in_the_background_only_the_measured_moe_layers():
    moe, dense = nn.ModuleDict({"experts": Experts()}), nn.Sequential(nn.Linear(2, 2), Linear4bit())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    chosen = background_choice(_cfg(), cuda, moe, moe4bit_serves=True)
    assert chosen == f"auto: {BACKGROUND_MOE_4BIT}"
    assert background_choice(_cfg(), cuda, moe, moe4bit_serves=False) is None  # moe4bit off: not what was measured
    assert background_choice(_cfg(), cuda, dense, moe4bit_serves=True) is None  # dense layers: in the process
    assert background_choice(_cfg(), cpu, moe, moe4bit_serves=True) is None
    assert background_choice(_cfg(compile_layers_backend="aot_eager"), cuda, moe, moe4bit_serves=True) is None
    assert background_choice(_cfg(compile_layers_dynamic="always"), cuda, moe, moe4bit_serves=True) is None
    # asked for: on or off as asked, anywhere
    assert background_choice(_cfg(compile_layers_background=True), cpu, dense, moe4bit_serves=False) == ""
    assert background_choice(_cfg(compile_layers_background=False), cuda, moe, moe4bit_serves=True) is None
