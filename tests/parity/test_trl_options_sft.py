"""SFTTrainer and the plain Trainer through ``patch_trainer`` against the unpatched trainer, over the options users
set (the option names and values read from the installed TRL's SFTConfig; see tests/_trl_options.py)."""

from __future__ import annotations

import pytest


trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import leantrain  # noqa: E402
from tests import _trl_options as opts  # noqa: E402


LIGER_AT_INIT = f"trl {trl.__version__} reads use_liger_kernel when the trainer is built, not per call"


@pytest.mark.skipif(not opts.trl_routes_liger_per_call(), reason=LIGER_AT_INIT)
def test_liger_turned_on_after_patching_goes_to_trl(tmp_path):
    """TRL's ``test_compute_loss_skip_logits_on_eval_without_metrics_with_liger``: ``use_liger_kernel`` turned on
    after the trainer (and leantrain) were set up, an eval-mode ``compute_loss`` without ``compute_metrics``, TRL's
    parent ``compute_loss`` mocked. TRL hands that call to Liger (``skip_logits=True``). leantrain's fused loss used to
    serve it by running the model itself on the caller's inputs, which on CUDA faulted ("index is on cpu": the test's
    inputs are CPU tensors that only Liger's mocked path never reads) and fell back. Now the call goes to TRL, with no
    fallback."""
    captured, report, final = opts.liger_after_patch(tmp_path, "cpu")
    assert captured.get("skip_logits") is True
    assert report["fused_ce"].status is leantrain.Status.APPLIED
    assert final["fused_ce"].status is leantrain.Status.APPLIED  # no fallback
