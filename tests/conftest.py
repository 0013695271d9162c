import os

import pytest
import torch


# Leantrain reads LEANTRAIN_* at patch time; a developer's shell must not leak into the tests.
for _name in [n for n in os.environ if n.startswith("LEANTRAIN_")]:
    del os.environ[_name]

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test sees the environment it started with: transformers 4.57's TrainingArguments(bf16=True) exports
    ACCELERATE_MIXED_PRECISION=bf16, which every later Accelerator in the process reads, so one bf16 test would
    put autocast on the forward of the next fp32 test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
