"""moe4bit's auto rule off CUDA (``moe4bit/measured.py``): the measured cells decide, within the reach of a cell of the
same device class and trainer kind, the nearest cell's verdict (a tie: the slower one); anywhere else auto mode keeps
the stock experts and ``moe4bit=True`` applies the grouped path anyway. Plain values first, then the probe on tiny
gpt-oss models with frozen nf4 experts (the demo's layout) on CPU, the trainer kind forced."""

from __future__ import annotations

import pytest
import torch

import leantrain
from leantrain import Status, _compat
from leantrain.measured import REACH, Evidence
from leantrain.moe4bit import measured
from leantrain.moe4bit.measured import Cell, choose


FASTER = Evidence("faster", "a CPU", "2026-01-01", "stock 2 ms, moe4bit 1 ms")
NOT_FASTER = Evidence("not faster", "a CPU", "2026-01-01", "stock 2 ms, moe4bit 2 ms")
CELLS = (Cell("cpu", "sft", 32, 64, FASTER), Cell("cpu", "sft", 8, 64, NOT_FASTER))


def test_the_nearest_cell_decides_within_reach():
    assert choose("cpu", "sft", 32, 64, CELLS) == (True, f"measured faster on cpu at 32 experts a layer, hidden 64 "
                                                          f"({FASTER})")  # fmt: skip
    assert choose("cpu", "sft", int(32 * REACH), 64, CELLS)[0]  # as far as the reach
    assert choose("cpu", "sft", 24, 128, CELLS)[0]  # nearer the faster cell
    faster, why = choose("cpu", "sft", 12, 64, CELLS)  # nearer the cell within the noise
    assert not faster and why == (
        f"not measured faster on cpu for SFT with 12 experts a layer, hidden 64: nearest measured at 8 experts a "
        f"layer, hidden 64 ({NOT_FASTER}); the stock experts"
    )
    assert not choose("cpu", "sft", 16, 64, CELLS)[0]  # equidistant: the tie goes to the slower verdict


@pytest.mark.parametrize(
    ("device", "kind", "experts", "hidden"),
    [
        ("cpu", "sft", 32 * 2 * int(REACH), 64),  # beyond the reach in experts
        ("cpu", "sft", 32, 64 * 2 * int(REACH)),  # beyond the reach in hidden size
        ("cpu", "grpo", 32, 64),  # another trainer kind
        ("cpu", "trainer", 32, 64),
        ("xpu", "sft", 32, 64),  # another device class
        ("cpu", "sft", 32, None),  # a model whose config has no hidden size
    ],
)
def test_outside_every_cell_keeps_the_stock_experts(device, kind, experts, hidden):
    faster, why = choose(device, kind, experts, hidden, CELLS)
    assert not faster and why.startswith(f"not measured on {device} for ") and why.endswith(": the stock experts")


def test_the_shipped_table():
    """The measurements it holds (a 2-core Xeon, 2026-11-29): SFT with 32 experts faster, with 8 within the noise;
    GRPO (generation included) with 8 faster, and with 64 (beyond the reach of 8) not measured."""
    assert choose("cpu", "sft", 32, 64)[0] and "231 / 216 ms" in choose("cpu", "sft", 32, 64)[1]
    assert not choose("cpu", "sft", 8, 64)[0] and "the p20-p80 bands overlap" in choose("cpu", "sft", 8, 64)[1]
    assert choose("cpu", "grpo", 8, 64)[0] and "325 / 334 ms" in choose("cpu", "grpo", 8, 64)[1]
    assert not choose("cpu", "grpo", 64, 64)[0]
    assert all(c.evidence.verdict in ("faster", "not faster") and c.device == "cpu" for c in measured.CELLS)


# ------------------------------------------------------------------------------------------------ the probe
def gpt_oss_trainer(tmp_path, experts: int):
    pytest.importorskip("bitsandbytes")
    from transformers import Trainer, TrainingArguments

    from leantrain.cli import tiny

    model = tiny.tiny_model("gpt_oss", vocab_size=128, hidden=64, layers=1, num_local_experts=experts).train()
    tiny.linear4bit_experts(model)
    tiny.settle_4bit(model)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 128, (4, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    return Trainer(model=model, args=args, train_dataset=rows)


def probe(trainer, kind: str):
    from leantrain.config import resolve_config
    from leantrain.fallback import RuntimeFallback
    from leantrain.moe4bit import Moe4bit
    from leantrain.optimization import PatchContext

    return Moe4bit().probe(
        trainer, PatchContext(resolve_config({}, environ={}), kind, RuntimeFallback("moe4bit", False))
    )


@pytest.mark.skipif(
    not _compat.at_least("transformers", _compat.TRANSFORMERS_3D_EXPERTS),
    reason="gpt-oss' 4-bit lists: transformers 5",
)
def test_the_probe_reads_the_experts_and_the_trainer_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "CELLS", CELLS)
    wide = probe(gpt_oss_trainer(tmp_path / "32", 32), "sft")
    assert wide.ready and "measured faster on cpu at 32 experts a layer, hidden 64" in wide.detail
    narrow = probe(gpt_oss_trainer(tmp_path / "8", 8), "sft")
    assert not narrow.blocked and narrow.slower_evidence.startswith(
        "not measured faster on cpu for SFT with 8 experts"
    )
    assert narrow.plan is not None  # moe4bit=True applies it
    plain = probe(gpt_oss_trainer(tmp_path / "trainer", 32), "trainer")
    assert plain.slower_evidence.startswith("not measured on cpu for a plain Trainer with 32 experts a layer")
    # through the entry point: skipped in auto mode with the evidence, applied on request
    trainer = gpt_oss_trainer(tmp_path / "entry", 8)
    outcome = leantrain.patch_trainer(trainer, environ={})["moe4bit"]
    assert outcome.status is Status.SKIPPED and outcome.reasons[0].endswith("pass moe4bit=True to apply anyway")
    leantrain.unpatch_trainer(trainer)
    outcome = leantrain.patch_trainer(trainer, moe4bit=True, environ={})["moe4bit"]
    assert (
        outcome.status is Status.APPLIED and "applied on request (moe4bit=True); not measured on cpu" in outcome.detail
    )
