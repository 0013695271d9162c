"""RuntimeFallback.call_at: a checkpoint's recompute takes the path its site's forward took.

The two paths below compute the same values but save different tensors for the backward (as a fused kernel and
the stock ops do), so non-reentrant checkpointing rejects a recompute that switched paths. The fallback trips at the
second site of one forward: the first site's recompute must stay on the fast path, the second on the stock one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from leantrain.fallback import RuntimeFallback, recomputing


def fast(x: torch.Tensor) -> torch.Tensor:
    return x.exp() * 2.0  # exp saves its output


def stock(x: torch.Tensor) -> torch.Tensor:
    return (x.double().exp() * 2.0).float()  # saves a float64 tensor: other metadata than the fast path's


class Site(torch.nn.Module):
    def __init__(self, fallback: RuntimeFallback, trip: bool, use_call_at: bool) -> None:
        super().__init__()
        self.fallback, self.trip, self.use_call_at = fallback, trip, use_call_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trip and not recomputing():
            self.fallback.fail("injected at the second site")
        if self.use_call_at:
            return self.fallback.call_at(self, fast, stock, x)
        return self.fallback.call(fast, stock, x)


def run(reentrant: bool, use_call_at: bool) -> torch.Tensor:
    fallback = RuntimeFallback("test", strict=False)
    sites = [Site(fallback, trip=False, use_call_at=use_call_at), Site(fallback, trip=True, use_call_at=use_call_at)]
    x = torch.linspace(-1, 1, 8, requires_grad=True)
    h = x
    for site in sites:
        h = checkpoint(site, h, use_reentrant=reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.sum().backward()
    return x.grad


def reference() -> torch.Tensor:
    x = torch.linspace(-1, 1, 8, requires_grad=True)
    stock(fast(x)).sum().backward()  # the first site fast, the second stock (the fallback tripped there)
    return x.grad


@pytest.mark.expect_fallback
@pytest.mark.parametrize("reentrant", [False, True])
def test_each_recompute_takes_its_forwards_path(reentrant):
    assert torch.equal(run(reentrant, use_call_at=True), reference())


@pytest.mark.expect_fallback
def test_switching_paths_in_a_recompute_is_what_breaks_non_reentrant_checkpointing():
    """The failure call_at prevents (so the test above can fail): plain ``call`` recomputes the first site on the
    stock path."""
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        run(False, use_call_at=False)


def test_outside_a_backward_nothing_is_recomputing():
    assert not recomputing()


@pytest.mark.expect_fallback
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_fallback_tripped_inside_the_fast_path_recomputes_it_fast(reentrant):
    """The fallback trips while the fast path runs and the fast path still finishes (compile_layers past its recompile
    limit inside a layer's forward: the graph being compiled runs as traced, the next calls take the stock path). That
    forward took the fast path, so its recompute must too, though the fallback has failed by then."""
    fallback = RuntimeFallback("test", strict=False)

    def tripping_fast(x: torch.Tensor) -> torch.Tensor:
        if not recomputing():
            fallback.fail("injected inside the fast path")
        return fast(x)

    class TrippingSite(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fallback.call_at(self, tripping_fast, stock, x)

    x = torch.linspace(-1, 1, 8, requires_grad=True)
    h = checkpoint(TrippingSite(), x, use_reentrant=reentrant)
    h = checkpoint(Site(fallback, trip=False, use_call_at=True), h, use_reentrant=reentrant)  # after: stock
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.sum().backward()
    assert fallback.failed == "injected inside the fast path"
    assert torch.equal(x.grad, reference())  # the first site fast, the second stock
