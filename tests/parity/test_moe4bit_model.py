"""Grouped 4-bit MoE experts through ``patch_trainer`` on whole tiny gpt-oss / Qwen3-MoE models: training steps
bit-identical (fp32) to the stock per-expert loop, patch/unpatch identity, runtime fallback. CPU, seeded.

Model sizes: hidden 128 and expert intermediate 64, multiples of the 4-bit blocksize (bitsandbytes 0.50.2's native
CPU dequantize is wrong for rows that are not a multiple of the blocksize, which would break the stock loop).
"""

from __future__ import annotations

import pytest
import torch

from leantrain._compat import TRANSFORMERS_3D_EXPERTS, needs


_OLDER = needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D experts and set_experts_implementation")
if _OLDER:
    pytest.skip(_OLDER, allow_module_level=True)


pytest.importorskip("bitsandbytes")

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from leantrain.moe4bit import _custom_ops  # noqa: E402
from leantrain.report import Status  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402
from tests._moe4bit_model import SEQ, VOCAB, make_model, make_trainer  # noqa: E402


ONLY_MOE = others_off("moe4bit")


def batch(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss, trainable-parameter grads, and the loss after one SGD step."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = model(**batch()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    opt.zero_grad()
    return loss.detach(), grads, model(**batch()).loss.detach()


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout",
    [("gpt_oss", "linear4bit"), ("gpt_oss", "stacked"), ("qwen3_moe", "stacked"), ("qwen3_moe", "linear4bit")],
)
def test_training_step_bit_identical_to_loop(family, layout, tmp_path):
    """fp32: the loss, every trainable gradient (router included) and the next loss equal the stock loop's."""
    stock_loss, stock_grads, stock_next = step(make_model(family, layout))
    model = make_model(family, layout)
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED and len(report["moe4bit"].targets) == 2
    loss, grads, next_loss = step(model)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED  # no silent fallback
    assert torch.equal(loss, stock_loss) and torch.equal(next_loss, stock_next), (loss, stock_loss)
    assert grads.keys() == stock_grads.keys() and any("router" in n or "gate.weight" in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), f"{name}: {(grad - stock_grads[name]).abs().max():.3g}"
    leantrain.unpatch_trainer(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [("gpt_oss", "linear4bit"), ("qwen3_moe", "stacked")])
def test_trainer_train_losses_match_stock(family, layout, tmp_path):
    """``trainer.train()`` with the grouped path logs the same per-step losses as the stock run."""
    losses = []
    for patch in (False, True):
        trainer = make_trainer(make_model(family, layout), tmp_path / str(patch), steps=3)
        if patch:
            leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
        trainer.train()
        losses.append([log["loss"] for log in trainer.state.log_history if "loss" in log])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_patch_unpatch_identity(tmp_path):
    model = make_model("gpt_oss", "linear4bit")
    experts = [layer.mlp.experts for layer in model.model.layers]
    weights = [[lin.weight for lin in e.gate_up_projs] for e in experts]
    data = [[w.data.clone() for w in ws] for ws in weights]
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)  # auto: not measured faster on this shape
    assert report["moe4bit"].status is Status.APPLIED and "slow path" in report["moe4bit"].detail
    assert report["moe4bit"].targets == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    for e in experts:
        assert "forward" in e.__dict__ and e.forward.__leantrain_original__.__self__ is e
        ptr = e.gate_up_projs[0].weight.data.untyped_storage().data_ptr()
        assert all(lin.weight.data.untyped_storage().data_ptr() == ptr for lin in e.gate_up_projs)
    assert "Linear4bitMoeExperts" in repr(model)
    state = model.state_dict()  # saving works: no shared storage among the expert tensors handed out
    experts_keys = [k for k in state if ".experts." in k]
    assert len({state[k].untyped_storage().data_ptr() for k in experts_keys}) == len(experts_keys)
    leantrain.unpatch_trainer(trainer)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    for e, ws, ds in zip(experts, weights, data):
        assert "forward" not in e.__dict__
        assert all(a is b for a, b in zip(ws, (lin.weight for lin in e.gate_up_projs)))
        assert all(torch.equal(w.data, d) for w, d in zip(ws, ds))
        assert len({w.data.untyped_storage().data_ptr() for w in ws}) == len(ws)  # private storage again


@pytest.mark.expect_fallback
def test_runtime_fallback_on_injected_error(tmp_path, monkeypatch):
    """An unexpected error in the grouped path warns once, serves the stock loop from then on, and is reported."""
    stock_loss = make_model("qwen3_moe", "stacked")(**batch()).loss
    model = make_model("qwen3_moe", "stacked")
    trainer = make_trainer(model, tmp_path)
    leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)

    def broken(*args, **kwargs):
        raise RuntimeError("injected grouped_mm failure")

    monkeypatch.setattr(_custom_ops, "grouped_mm", broken)
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        loss = model(**batch()).loss
    assert torch.equal(loss, stock_loss)
    outcome = leantrain.current_report(trainer)["moe4bit"]
    assert outcome.status is Status.FAILED and "injected grouped_mm failure" in outcome.reasons[0]
    monkeypatch.undo()
    assert torch.equal(model(**batch()).loss, stock_loss)  # stays on the stock path
    leantrain.unpatch_trainer(trainer)


def test_disabled_and_not_applicable(tmp_path):
    trainer = make_trainer(make_model("gpt_oss", "stacked"), tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=False, **ONLY_MOE)
    assert report["moe4bit"].status is Status.DISABLED
    leantrain.unpatch_trainer(trainer)
    dense = make_trainer(tiny_model("llama", hidden=64, layers=1, vocab_size=VOCAB), tmp_path)
    report = leantrain.patch_trainer(dense, strict=True, **ONLY_MOE)  # not applicable: strict does not raise
    assert report["moe4bit"].status is Status.SKIPPED and "no MoE experts" in report["moe4bit"].reasons[0]
    leantrain.unpatch_trainer(dense)


def _probe_and_apply(trainer, **options):
    """``Moe4bit.probe`` then ``Moe4bit.apply`` on their own (as the entry point runs them)."""
    from leantrain.config import resolve_config
    from leantrain.fallback import RuntimeFallback
    from leantrain.moe4bit import Moe4bit
    from leantrain.optimization import PatchContext

    ctx = PatchContext(resolve_config(options, environ={}), "trainer", RuntimeFallback("moe4bit", strict=True))
    opt = Moe4bit()
    ready = opt.probe(trainer, ctx)
    assert not ready.blocked, ready.reasons  # ready to apply (auto mode may still skip it: not measured faster)
    return opt, ready, ctx


def test_plan_carries_everything_apply_needs(tmp_path, monkeypatch):
    """The probe's plan holds every target with its owner, hook, recipe, adapters and recompute choice: ``apply``
    searches the model for nothing again (every search function fails once the probe has run)."""
    from leantrain.moe4bit import _adapters, layout_expert_mlps, layouts, probe, registry

    model = make_model("qwen3_moe", "stacked")
    trainer = make_trainer(model, tmp_path)
    opt, ready, ctx = _probe_and_apply(trainer)
    targets = ready.plan.targets
    assert [t.name for t in targets] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(t.owner is t.module and t.hook == "forward" and t.adapters is None for t in targets)
    assert not ready.plan.fsdp2 and all(t.recompute for t in targets)

    def searched(*args, **kwargs):
        raise AssertionError("apply searched the model again")

    for module, name in [
        (registry, "find_experts"),
        (layouts, "block_recipe"),
        (layout_expert_mlps, "block_recipe"),
        (probe, "find_experts"),
    ]:
        monkeypatch.setattr(module, name, searched)
    for name in ("wrapped_map", "spec_of", "param_wrappers", "forward_owner"):
        monkeypatch.setattr(_adapters, name, searched)
    applied = opt.apply(trainer, ready.plan, ctx)
    assert applied.targets == tuple(t.name for t in targets)
    assert all("forward" in t.module.__dict__ for t in targets)
    ctx.undo()
    assert not any("forward" in t.module.__dict__ for t in targets)


def test_recompute_default_per_layout_and_the_option_overrides(tmp_path, monkeypatch):
    """Recompute comes from the measured verdicts of the layout (and shape) unless ``moe_recompute`` says otherwise;
    the report says which and why, and the grouped path runs with that choice."""
    from leantrain.moe4bit import ops, recompute

    seen = []
    real = ops.grouped_forward

    def spy(plan, *args, **kwargs):
        seen.append(plan.recompute)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(ops, "grouped_forward", spy)  # read when the patch is installed
    table = (
        recompute.Verdict("stacked", False, "a measured saved-stacks win", max_stack_mib=1.0),
        recompute.Verdict("stacked", True, "a measured recompute win"),
    )
    monkeypatch.setattr(recompute, "VERDICTS", table)
    cases = [({}, False, "stacked recompute off, saved stacks (measured: a measured saved-stacks win)")]
    cases += [({"moe_recompute": True}, True, "stacked recompute on (set by moe_recompute")]
    for options, expected, words in cases:
        trainer = make_trainer(make_model("qwen3_moe", "stacked"), tmp_path)
        report = leantrain.patch_trainer(trainer, moe4bit=True, environ={}, **ONLY_MOE, **options)
        assert words in report["moe4bit"].detail, report["moe4bit"].detail
        seen.clear()
        trainer.model(**batch())
        assert seen == [expected, expected]
        leantrain.unpatch_trainer(trainer)
    monkeypatch.setattr(recompute, "VERDICTS", table[:1])  # a larger stack than the verdict's limit: not measured
    assert recompute.choose("stacked", 2 * 2**20, None) == (True, recompute.NOT_MEASURED)
    assert recompute.choose("linear4bit", 1, False) == (False, "set by moe_recompute / LEANTRAIN_MOE_RECOMPUTE")
