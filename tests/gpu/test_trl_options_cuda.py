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


# ---------------------------------------------------------------------------------------------------- the matrix
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return opts.save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def _rl_cases():
    from tests._trl_option_cases import cases

    return cases()


def _sft_cases():
    from tests._trl_option_cases import sft_cases

    return sft_cases()


@pytest.mark.parametrize("kind, options", _rl_cases())
def test_rl_matrix(dev, model_dir, tmp_path, kind, options):
    from tests._trl_option_cases import skip_reason

    reason = skip_reason(kind, options)
    if reason:
        pytest.skip(reason)
    stock, ours = opts.rl_pair(kind, model_dir, tmp_path, {"grpo_logps": True}, device=str(dev), **options)
    assert ours.report["grpo_logps"].status is leantrain.Status.APPLIED, ours.report["grpo_logps"].reasons
    if dev.type == "cuda":
        assert "triton" in ours.report["grpo_logps"].detail.lower()
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)


@pytest.mark.parametrize("options", _sft_cases())
def test_sft_matrix(dev, tmp_path, options):
    from testkit.optimizations import only

    missing = [k for k in set(options) - {"masks", "compute_metrics"} if not opts.has_option(trl.SFTConfig, k)]
    if missing:
        pytest.skip(f"trl {trl.__version__}'s SFTConfig has no {', '.join(missing)}")
    stock = opts.sft_run(tmp_path / "stock", None, device=str(dev), **dict(options))
    ours = opts.sft_run(tmp_path / "ours", only("fused_ce"), device=str(dev), **dict(options))
    assert ours.report["fused_ce"].status is leantrain.Status.APPLIED, ours.report["fused_ce"].reasons
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)
    for key, value in stock.extra["eval"].items():
        assert value == pytest.approx(ours.extra["eval"][key], rel=opts.FP32_REL, abs=opts.FP32_ABS), key


def test_sft_use_liger_kernel(dev, tmp_path):
    """use_liger_kernel=True together with leantrain (Liger's kernels need CUDA): stock-with-Liger against
    patched-with-Liger; leantrain (requested: the tiny head is outside every measured cell) either serves the loss with
    the same numbers or declines naming use_liger_kernel."""
    pytest.importorskip("liger_kernel")
    from testkit.optimizations import only

    stock = opts.sft_run(tmp_path / "stock", None, device=str(dev), use_liger_kernel=True)
    try:
        ours = opts.sft_run(tmp_path / "ours", only("fused_ce"), device=str(dev), use_liger_kernel=True)
    except leantrain.NotReadyError as error:
        assert "use_liger_kernel" in str(error)  # declined, naming why
        return
    assert ours.report["fused_ce"].status is leantrain.Status.APPLIED
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)
