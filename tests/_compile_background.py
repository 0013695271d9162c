"""The background compile against its references, shared by the CPU and CUDA tests of
``compile_layers_background`` (a helper module: a test module is never imported as one)."""

from __future__ import annotations

import torch

import leantrain
from leantrain.compile_layers import stats


BACKGROUND = {"compile_layers": True, "compile_layers_background": True}


def fx_cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal(got, want) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert got[1].keys() == want[1].keys() and want[1]
    for name, grad in want[1].items():
        assert torch.equal(got[1][name], grad), name


def held_child(tmp_path, monkeypatch) -> tuple:
    """Children that wait for the returned release file (``tests._held_child``), and a list that grows by one at
    every call of a traced graph (a job)."""
    from leantrain.compiling import background

    release = tmp_path / "release"
    monkeypatch.setenv("HELD_CHILD_RELEASE", str(release))
    monkeypatch.setattr(background, "CHILD_MODULE", "tests._held_child")
    traced: list = []
    run_traced = background.Job.__call__

    def spy(job, *args):
        traced.append(1)
        return run_traced(job, *args)

    monkeypatch.setattr(background.Job, "__call__", spy)
    return release, traced


def background_against_references(
    make, make_trainer, options: dict, batches: tuple[dict, dict], tmp_path, monkeypatch, rounds_apart: bool = True
) -> None:
    """Three copies of one model (``make()``, each in ``make_trainer(model, path)``): background-compiled, eager and
    compiled in this process (each patched with ``options`` and its compile_layers switch). The child is held
    (``tests._held_child``) until the eager phase was seen. The first batch (the trace: the traced graph runs) equals
    eager; at a step boundary with the child still compiling the eager layers serve the second batch (no call of
    the traced graph) and equal eager; after the switch the second batch equals in-process inductor, and the switch
    compiled nothing (cache hits only). ``rounds_apart``: the compiled kernels are known to round differently from
    eager somewhere in this model (checked: the comparisons can tell the two apart); where they may not, what ran
    after the switch is told by the cache hits and the retrace count alone."""
    release, traced = held_child(tmp_path, monkeypatch)
    patched = {}
    # "here" names the in-process compile: auto mode would compile MoE-4bit layers on CUDA in a child too
    here = {"compile_layers": True, "compile_layers_background": False}
    for name, switch in (("bg", BACKGROUND), ("eager", {"compile_layers": False}), ("here", here)):
        model = make()
        trainer = make_trainer(model, tmp_path / name)
        report = leantrain.patch_trainer(trainer, **options, **switch)
        patched[name] = model, trainer, report
    model, trainer, report = patched["bg"]
    assert "compiled in a child process" in report["compile_layers"].detail
    assert "child process" not in patched["here"][2]["compile_layers"].detail  # the reference compiles here
    assert_equal(loss_and_grads(model, batches[0]), loss_and_grads(patched["eager"][0], batches[0]))
    live = stats(trainer).background
    graphs = len(live.jobs)  # LoRA: the first layer's input needs no grad, the others' do (two graphs)
    assert graphs >= 1 and not live.in_process and stats(trainer).compiles == graphs and traced
    assert live.promote() == 0 and live.eager  # a step boundary, the child held: the eager layers serve
    calls = len(traced)
    eager = loss_and_grads(patched["eager"][0], batches[1])
    assert_equal(loss_and_grads(model, batches[1]), eager)
    assert len(traced) == calls
    release.touch()
    live.wait(timeout_s=300)
    assert live.promote() == graphs and not live.eager  # what the trainer's step-begin callback calls
    before = fx_cache_counts()
    switched = loss_and_grads(model, batches[1])
    after = fx_cache_counts()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # each graph's forward and backward from the child's cache entries, nothing compiled here
    assert delta.get("fxgraph_cache_hit") == 2 * graphs and not delta.get("fxgraph_cache_miss"), delta
    assert_equal(switched, loss_and_grads(patched["here"][0], batches[1]))
    assert (stats(trainer).compiles, live.retraced) == (graphs, graphs)  # the switch's traces are no recompiles
    if rounds_apart:  # the comparison can tell them apart: inductor's kernels round differently from eager somewhere
        assert not all(torch.equal(switched[1][n], g) for n, g in eager[1].items())
