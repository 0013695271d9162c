"""The one adapter for TRL's fused LM head (``leantrain.trl_head``): finding TRL's forward under wrappers, the kernel
guard's report, the MoE aux loss's expert counts. End to end it is covered by the fused_ce and grpo_logps parity
tests (each against TRL's own head)."""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch

from leantrain import trl_head
from leantrain.fallback import RuntimeFallback


def _fused_forward(self, *args, **kwargs):  # stands in for TRL's closure: found by its code name
    return "trl"


def test_find_code_through_wrappers():
    """Bound methods, functools.wraps and accelerate's ``model_forward`` attribute are looked through."""
    owner = torch.nn.Linear(1, 1)
    bound = types.MethodType(_fused_forward, owner)

    @functools.wraps(bound)
    def autocast_forward(*args, **kwargs):
        return bound(*args, **kwargs)

    class Fp32Outputs:
        def __init__(self, model_forward):
            self.model_forward = model_forward

    found = trl_head.find_code(Fp32Outputs(autocast_forward), trl_head.FUSED_FORWARD)
    assert found is not None and found.__code__ is _fused_forward.__code__
    assert trl_head.find_code(owner.forward, trl_head.FUSED_FORWARD) is None
    assert trl_head.fused_forward_of(owner) is None
    owner.forward = bound
    assert trl_head.fused_forward_of(owner).__code__ is _fused_forward.__code__


@pytest.mark.expect_fallback
def test_kernel_guard_reports_through_the_fallback():
    """A Triton failure warns once, the torch path serves, and the optimization's fallback hears of it."""
    heard = []
    guard = trl_head.kernel_guard("fused_ce", RuntimeFallback("fused_ce", strict=False, on_failure=heard.append))

    def run(backend):
        if backend == "triton":
            raise RuntimeError("no kernel for this input")
        return backend

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert guard.call(run, lambda _backend: run("torch"), "triton") == "torch"
        assert guard.call(run, lambda _backend: run("torch"), "triton") == "torch"  # once failed: torch directly
    assert len([w for w in caught if "fused_ce triton kernel failed" in str(w.message)]) == 1
    assert heard == [
        "the Triton kernel failed (RuntimeError: no kernel for this input); leantrain's torch path serves"
    ]
    strict = trl_head.kernel_guard("fused_ce", RuntimeFallback("fused_ce", strict=True))
    with pytest.raises(RuntimeError, match="no kernel"):
        strict.call(run, lambda _backend: run("torch"), "triton")


@pytest.mark.skipif(trl_head._transformers_major() < 5, reason="transformers 5 reads the counts from the config")
def test_aux_terms_read_the_text_config():
    """The text config's ``num_experts`` first; where a config lacks it (gpt-oss before transformers 5.6) the model's
    count, else the config's ``num_local_experts``; the coefficient from the config, 0 where it has none."""
    config = types.SimpleNamespace(
        num_experts=6, num_local_experts=99, num_experts_per_tok=2, router_aux_loss_coef=0.1
    )
    model = types.SimpleNamespace(num_experts=7)
    assert trl_head.aux_terms(model, config) == (6, 2, 0.1)
    old = types.SimpleNamespace(num_local_experts=5, num_experts_per_tok=2)
    assert trl_head.aux_terms(model, old) == (7, 2, 0.0)
    assert trl_head.aux_terms(types.SimpleNamespace(), old) == (5, 2, 0.0)
