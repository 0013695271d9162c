"""SFTTrainer and the plain Trainer through ``patch_trainer`` against the unpatched trainer, over the options users
set (the option names and values read from the installed TRL's SFTConfig; see tests/_trl_options.py)."""

from __future__ import annotations

import pytest


trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import leantrain  # noqa: E402
from testkit.optimizations import only  # noqa: E402
from tests import _trl_options as opts  # noqa: E402
from tests._trl_option_cases import sft_cases  # noqa: E402


# every optimization off but the fused loss (required): the matrix isolates what it serves
OFF_BUT_FUSED = only("fused_ce")
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


# ---------------------------------------------------------------------------------------------------- the matrix
SFT_ONLY_KEYS = {"masks", "compute_metrics"}


@pytest.mark.parametrize("options", sft_cases())
def test_sft_matrix(tmp_path, options):
    keys = set(options) - SFT_ONLY_KEYS
    missing = [k for k in keys if not opts.has_option(trl.SFTConfig, k)]
    if missing:
        pytest.skip(f"trl {trl.__version__}'s SFTConfig has no {', '.join(missing)}")
    stock = opts.sft_run(tmp_path / "stock", None, **dict(options))
    ours = opts.sft_run(tmp_path / "ours", {**OFF_BUT_FUSED}, **dict(options))
    assert ours.report["fused_ce"].status is leantrain.Status.APPLIED, ours.report["fused_ce"].reasons
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)
    assert stock.extra["eval"].keys() == ours.extra["eval"].keys()
    for key, value in stock.extra["eval"].items():
        assert value == pytest.approx(ours.extra["eval"][key], rel=opts.FP32_REL, abs=opts.FP32_ABS), key


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"gradient_accumulation_steps": 2}, id="num_items_in_batch"),
        pytest.param({"compute_metrics": opts.mean_logit_metric}, id="eval_compute_metrics"),
        pytest.param({"prediction_loss_only": True}, id="eval_loss_only"),
    ],
)
def test_trainer_matrix(tmp_path, options):
    stock = opts.sft_run(tmp_path / "stock", None, trainer_kind="trainer", **dict(options))
    ours = opts.sft_run(tmp_path / "ours", {**OFF_BUT_FUSED}, trainer_kind="trainer", **dict(options))
    assert ours.report["fused_ce"].status is leantrain.Status.APPLIED, ours.report["fused_ce"].reasons
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)
    for key, value in stock.extra["eval"].items():
        assert value == pytest.approx(ours.extra["eval"][key], rel=opts.FP32_REL, abs=opts.FP32_ABS), key


def test_every_option_is_classified():
    opts.assert_classified(trl.SFTConfig, opts.SFT_FIELDS)


def test_covered_options_have_a_case():
    installed = set(opts.config_fields(trl.SFTConfig))
    set_by_cases = {"max_length"}
    for param in sft_cases():
        set_by_cases |= set(param.values[0]) - SFT_ONLY_KEYS
    covered = {name for name, why in opts.SFT_FIELDS.items() if why == opts.COVERED} & installed
    assert covered <= set_by_cases, sorted(covered - set_by_cases)
