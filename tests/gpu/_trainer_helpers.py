"""Shared setup of the CUDA parity tests for CGGR and OSFT: the device fixture, a tiny pre-tokenized SFT dataset,
an SFTTrainer factory, unit roundoffs, and comparison helpers.

Development aid: ``GPU_TEST_DEVICE=cpu`` runs these tests on the CPU so their logic can be checked on a machine
without a GPU. ``tests/gpu/conftest.py`` skips everything without CUDA and the root conftest removes ``LEANTRAIN_*``
variables, so run them with ``--noconftest``::

    GPU_TEST_DEVICE=cpu python -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_osft_cuda.py

On the CPU the bitwise claims still hold (same kernels for both sides); the reduced-precision projections run
emulated where a test says so. The variable is never read by leantrain (it has no ``LEANTRAIN_`` prefix).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch


DEVICE_ENV = "GPU_TEST_DEVICE"
# Odd vocabulary over two of the CGGR scorer's 8192-wide vocabulary tiles; the LM head is ~3/4 of the per-token
# matmul work, so CGGR's auto mode would apply.
VOCAB = 9001
HIDDEN = 128
LAYERS = 4


def on_cpu() -> bool:
    value = os.environ.get(DEVICE_ENV, "")
    if value not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {value!r}")
    return value == "cpu"


def select_device(request: pytest.FixtureRequest) -> torch.device:
    """For the test modules' ``device`` fixtures: CUDA through ``tests/gpu/conftest.py``'s ``cuda`` fixture (TF32 off,
    seeded, restored after the test); the CPU under GPU_TEST_DEVICE=cpu."""
    if on_cpu():
        torch.manual_seed(0)
        return torch.device("cpu")
    return request.getfixturevalue("cuda")


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels for the bitwise claims.

    cuBLAS GEMMs and TRL's Triton log-prob kernels (no atomics) repeat bitwise for the same shapes on one stream;
    ``use_deterministic_algorithms`` also pins the scatter/index backward kernels (hidden[mask] in TRL's fused head,
    the embedding gradient) to their deterministic versions, and cuBLAS then asks for a fixed workspace
    (CUBLAS_WORKSPACE_CONFIG; torch sizes it once per process, so both sides share it anyway). ``warn_only``: an
    op without a deterministic version warns, naming itself, instead of raising; the bitwise asserts decide.
    """
    old_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])
        if old_env is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = old_env


# ---- numbers ---------------------------------------------------------------------------------------------------


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp at 1: the relative error of one rounding (fp32 2^-24, bf16 2^-8)."""
    return torch.finfo(dtype).eps / 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius distance in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    """Bitwise equality of two name -> tensor maps, naming the first mismatch and its size."""
    assert a.keys() == b.keys() and a, f"{what}: different names"
    for name in a:
        if not torch.equal(a[name], b[name]):
            diff = float((a[name].double() - b[name].double()).abs().max())
            pytest.fail(f"{what} {name}: not bitwise equal, max |diff| {diff:.3e}, rel {rel(a[name], b[name]):.3e}")


# ---- data and trainers ----------------------------------------------------------------------------------------


def tokenizer():
    """A word-level tokenizer with pad/eos/bos only: the datasets here are pre-tokenized, SFTTrainer needs the ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|pad|>": 0, "<|endoftext|>": 1, "<|bos|>": 2, "<unk>": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>", bos_token="<|bos|>", unk_token="<unk>"
    )


def sft_rows(n: int = 16, seed: int = 0, vocab: int = VOCAB) -> list[dict[str, list[int]]]:
    """Distinct random sequences of 20..63 tokens; labels -100 on a 'prompt' of 2..9 tokens (as a collator would)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(20, 64, (1,), generator=g))
        prompt = int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(4, vocab, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def sft_trainer(model: torch.nn.Module, out: Any, device: torch.device, rows: list[dict], **args: Any):
    """A TRL SFTTrainer on ``device`` over pre-tokenized ``rows`` (their ``labels`` column is used as is)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    config = dict(
        output_dir=str(out),
        report_to=[],
        use_cpu=device.type == "cpu",
        save_strategy="no",
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        activation_checkpointing=False,
        bf16=False,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    config.update(args)
    return SFTTrainer(
        model=model, args=SFTConfig(**config), train_dataset=Dataset.from_list(rows), processing_class=tokenizer()
    )


def log_values(trainer: Any, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]
