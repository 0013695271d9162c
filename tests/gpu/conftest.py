"""The CUDA parity suite: every test here compares an optimized CUDA path with the stock CUDA path on the same
inputs. Collected everywhere, run only where CUDA is available (``bash benchmarks/gpu_run.sh parity``).

One device per process: single-process tests see exactly one GPU. On a machine where one process sees two, HF
``Trainer`` wraps the model in ``nn.DataParallel`` and TRL's trainers refuse that (40 of 146 tests failed that way).
CUDA fixes the visible devices when it initializes, so the pin below happens when this file is imported (at the
start of collecting tests/gpu, before any test module touches CUDA): ``CUDA_VISIBLE_DEVICES`` is set to the first
device unless it is already set or the session runs the multi-GPU tests (``MULTI_GPU_TESTS=1``, set by
``gpu_run.sh multi_gpu``; those tests are marked ``multi_gpu`` and skip below two devices). ``gpu_run.sh parity``
pins the device itself too, so the pin holds even if something initialized CUDA earlier.
"""

import os
import warnings

import pytest
import torch


MULTI_GPU_ENV = "MULTI_GPU_TESTS"  # no LEANTRAIN_ prefix: the root conftest removes those


def _multi_gpu_session() -> bool:
    return os.environ.get(MULTI_GPU_ENV, "") == "1"


def _pin_one_device() -> None:
    if _multi_gpu_session() or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    if torch.cuda.is_initialized():  # too late: CUDA enumerated its devices already
        warnings.warn(
            "tests/gpu: CUDA initialized before the one-device pin; set CUDA_VISIBLE_DEVICES=0 (gpu_run.sh does)",
            stacklevel=1,
        )
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"


_pin_one_device()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "/tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)
        elif item.get_closest_marker("multi_gpu") and torch.cuda.device_count() < 2:
            why = "needs 2+ visible CUDA devices: MULTI_GPU_TESTS=1 bash benchmarks/gpu_run.sh multi_gpu"
            item.add_marker(pytest.mark.skip(reason=why))
        elif not item.get_closest_marker("multi_gpu") and _multi_gpu_session():
            item.add_marker(pytest.mark.skip(reason="single-device test: run it without MULTI_GPU_TESTS=1"))


@pytest.fixture
def cuda():
    """The CUDA device, with TF32 off so that fp32 comparisons mean fp32 (restored afterwards)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    yield torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    torch.cuda.empty_cache()
