"""The trainer-level option matrix on CUDA (tests/parity/test_trl_options_*.py with the model on the GPU, leantrain's
Triton op against the stock CUDA path), and the fused loss on TRL's Liger eval path.

Bounds: fp32 with TF32 off (the ``cuda`` fixture), so both heads run fp32 GEMMs and differ in the order of their
fp32 sums, as on CPU: the CPU matrix's 1e-4 relative / 1e-6 absolute (``_trl_options.FP32_REL``/``FP32_ABS``; the
Triton fold sums a row in 4096-column blocks, cuBLAS tiles in another order than MKL, neither moves a logp by more
than ~V·2^-24 = 3e-5 relative at V = 512, and a step's logged numbers average those)."""

from __future__ import annotations

import pytest

import leantrain
from tests import _trl_options as opts
from tests.gpu._device import DEVICE, dev_fixture, needs_device  # noqa: F401 (the "dev" fixture)


trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
pytestmark = needs_device


@pytest.mark.skipif(not opts.trl_routes_liger_per_call(), reason="this TRL reads use_liger_kernel at init only")
def test_liger_turned_on_after_patching_goes_to_trl(dev, tmp_path):
    """TRL's test_compute_loss_skip_logits_on_eval_without_metrics_with_liger on CUDA: the model on the GPU, the
    inputs on CPU (as in TRL's test). It faulted with "index is on cpu" and fell back; now TRL serves the call (Liger's
    path, mocked by the test) and nothing falls back."""
    captured, report, final = opts.liger_after_patch(tmp_path, str(dev))
    assert captured.get("skip_logits") is True
    assert report["fused_ce"].status is leantrain.Status.APPLIED
    assert final["fused_ce"].status is leantrain.Status.APPLIED
