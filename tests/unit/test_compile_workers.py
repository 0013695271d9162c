"""Inductor's Triton compile workers started at patch time (``compiling.warm_compile_workers``): only for inductor on
CUDA, through torch's own ``maybe_warm_pool`` (so torch's switches still hold), never an error when that private API
fails; both compiled installs call it with the module they compile. On CUDA, tests/gpu/test_compile_layers_cuda.py
checks that the pool exists after ``patch_trainer``."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import Status
from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import patch as compile_patch
from leantrain.compiling import warm_compile_workers
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only


def on(device_type: str) -> types.SimpleNamespace:
    """A module stand-in whose parameters live on ``device_type`` (CUDA tensors cannot be made on a CPU machine)."""
    parameter = types.SimpleNamespace(device=torch.device(device_type))
    return types.SimpleNamespace(parameters=lambda: iter([parameter]))


@pytest.fixture
def warm_calls(monkeypatch) -> list[int]:
    import torch._inductor.async_compile as async_compile

    calls: list[int] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    return calls


def test_warms_the_pool_for_inductor_on_cuda_only(warm_calls):
    assert warm_compile_workers("inductor", on("cuda")) is True
    assert len(warm_calls) == 1
    assert warm_compile_workers("inductor", on("cpu")) is False
    assert warm_compile_workers("aot_eager", on("cuda")) is False
    assert warm_compile_workers("inductor", torch.nn.Module()) is False  # no parameters: nothing on CUDA
    assert len(warm_calls) == 1


def test_a_failing_private_api_leaves_the_pool_to_the_first_compile(monkeypatch):
    import torch._inductor.async_compile as async_compile

    def broken() -> None:
        raise RuntimeError("no pool here")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", broken)
    assert warm_compile_workers("inductor", on("cuda")) is False


def test_compile_layers_warms_with_its_backend_and_the_first_layer(monkeypatch, tmp_path):
    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(compile_patch, "warm_compile_workers", lambda backend, module: seen.append((backend, module)))
    model = tiny_model("llama", vocab_size=128, hidden=32, layers=2).train()
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_steps=1, disable_tqdm=True
    )
    trainer = Trainer(model=model, args=args, train_dataset=random_rows(2, (8,), 128), data_collator=pad_right)
    report = leantrain.patch_trainer(trainer, **only("compile_layers"), compile_layers_backend="aot_eager")
    assert report["compile_layers"].status is Status.APPLIED
    assert seen == [("aot_eager", model.model.layers[0])]
    leantrain.unpatch_trainer(trainer)
