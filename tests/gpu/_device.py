"""The device the CUDA tests run on: CUDA, or (dev-only, with ``--noconftest``) ``LEANTRAIN_TEST_DEVICE=cpu`` to run
their logic on CPU. Read once here, so every module of one session sees the same device."""

from __future__ import annotations

import os

import pytest
import torch


DEVICE = os.environ.pop("LEANTRAIN_TEST_DEVICE", "cuda")  # popped: leantrain rejects unknown LEANTRAIN_* names
needs_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(name="dev")
def dev_fixture(request) -> torch.device:
    if DEVICE == "cuda":
        return request.getfixturevalue("cuda")  # tests/gpu/conftest.py: TF32 off, seeded
    torch.manual_seed(0)
    return torch.device(DEVICE)
