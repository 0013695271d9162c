"""moe4bit's grouped 4-bit experts inside compiled decoder layers (``compile_layers``), on CPU in fp32.

With the ``aot_eager`` backend the compiled graphs run the same kernels as eager code (moe4bit's custom ops run the
eager path's own functions), so the compiled run must equal eager moe4bit bit for bit (``torch.equal``): the loss,
every gradient, the layer's output and input gradient. One compiled code serves every layer and every routing (group
sizes live in tensors, never in guards). Also: the custom ops pass ``torch.library.opcheck``; under the min-cut
partitioner (inductor's) the compiled forward saves no dequantized ``[E, rows, cols]`` stack (moe4bit's recompute
holds); the per-call check still sends moe4bit to its stock path while compiled; undo restores the classes and
bitsandbytes' hooks that moe4bit changes so that every layer compiles as one.

Sizes: hidden 128, expert intermediate 64 (multiples of the 4-bit blocksize; see tests/parity/test_moe4bit_model.py).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from leantrain._compat import TRANSFORMERS_3D_EXPERTS, needs


_OLDER = needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D experts and set_experts_implementation")
if _OLDER:
    pytest.skip(_OLDER, allow_module_level=True)

bnb = pytest.importorskip("bitsandbytes")

import leantrain  # noqa: E402
from leantrain import NotReadyError, Status  # noqa: E402
from leantrain.compile_layers import measured as compile_measured  # noqa: E402
from leantrain.compile_layers import probe as compile_probe  # noqa: E402
from leantrain.compile_layers import stats  # noqa: E402
from leantrain.fallback import EAGER_CHECK_ATTR, TRACEABLE_ATTR  # noqa: E402
from leantrain.models import decoder_parts  # noqa: E402
from leantrain.moe4bit import _custom_ops  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402
from tests._moe4bit_model import SEQ, VOCAB, make_model, make_trainer  # noqa: E402


AOT = {"compile_layers_backend": "aot_eager"}
BOTH = {**others_off("compile_layers"), "moe4bit": True}  # compile_layers given by each test
CASES = [("qwen3_moe", "stacked"), ("gpt_oss", "stacked"), ("gpt_oss", "linear4bit"), ("qwen3_moe", "linear4bit")]
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # a clean Dynamo state per test


def patched(family: str, layout: str, tmp_path, compiled: bool, **options):
    """A tiny MoE with 4-bit experts and its trainer, patched with moe4bit (and compile_layers on ``aot_eager``)."""
    model = make_model(family, layout)
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, compile_layers=compiled, **AOT, **{**BOTH, **options})
    assert report["moe4bit"].status is Status.APPLIED
    assert report["compile_layers"].status is (Status.APPLIED if compiled else Status.DISABLED)
    return model, trainer


def batch(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_and_grads(model, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch(seed)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal_runs(compiled, eager) -> None:
    (loss_c, grads_c), (loss_e, grads_e) = compiled, eager
    assert torch.equal(loss_c, loss_e), (loss_c, loss_e)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name, grad in grads_e.items():
        assert torch.equal(grads_c[name], grad), f"{name} differs from eager moe4bit"


# ----------------------------------------------------------------------------------------------- the custom ops


def packed_stack(experts: int, rows: int, cols: int, blocksize: int = 64):
    w = torch.randn(experts * rows * cols // blocksize, blocksize, generator=torch.Generator().manual_seed(0))
    q, state = bnb.functional.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    return q.view(-1), state.absmax


@pytest.mark.parametrize("in_major", [False, True])
def test_the_custom_ops_pass_opcheck_with_an_empty_expert_group(in_major):
    experts, rows, cols = 4, 64, 128
    data, absmax = packed_stack(experts, rows, cols)
    eid = torch.tensor([0] * 5 + [2] * 7 + [3] * 4)  # expert 1 has no rows
    offs = torch.tensor([5, 5, 12, 16], dtype=torch.int32)
    width_in, width_out = (rows, cols) if in_major else (cols, rows)
    x = torch.randn(16, width_in, requires_grad=True)
    stack = ([experts, rows, cols], 64, "nf4", in_major)
    for bias in (None, torch.randn(experts, width_out)):
        torch.library.opcheck(_custom_ops.grouped_proj4bit, (x, data, absmax, offs, bias, eid, *stack, torch.float32))
    grad = torch.randn(16, width_out)
    args = (grad, data, absmax, offs, *stack, torch.float32, torch.float32)
    torch.library.opcheck(_custom_ops.grouped_proj4bit_grad, args)
    torch.library.opcheck(_custom_ops.grouped_mm_op, (x.detach(), torch.randn(experts, width_in, 32), offs))
    torch.library.opcheck(_custom_ops.grouped_mm_op, (torch.randn(32, 16), torch.randn(16, width_in), offs))


def test_the_projection_op_equals_the_eager_projection():
    """The op's result and input gradient equal ``_GroupedProjection``'s (the eager path), bias included."""
    from leantrain.moe4bit import ops
    from leantrain.moe4bit._stacks import PackedStack

    data, absmax = packed_stack(4, 64, 128)
    proj = ops.Projection(PackedStack(data, (4, 64, 128), 64, "nf4", absmax), False, torch.randn(4, 64), None,
                          restore_dtype=False, cast_bias=False)  # fmt: skip
    routing = ops.route(torch.tensor([[0, 2], [3, 2], [0, 3], [2, 0]]), 4)
    x = torch.randn(8, 128, requires_grad=True)
    grad = torch.randn(8, 64)
    results = []
    for project in (
        lambda: proj.packed_forward(x, routing),
        lambda: ops._GroupedProjection.apply(x, proj, routing, True),
    ):
        out = project()
        (dx,) = torch.autograd.grad(out, x, grad)
        results.append((out, dx))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ----------------------------------------------------------------------------------------- one compiled layer


def layer_inputs(model, seed: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, SEQ, model.config.hidden_size, generator=g).requires_grad_()
    cos_sin = model.model.rotary_emb(h, torch.arange(SEQ).unsqueeze(0).expand(2, -1))
    return h, cos_sin


def layer_step(call, layer, model, seed: int):
    h, pe = layer_inputs(model, seed)
    out = call(layer, h, pe)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + seed)))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), h.grad, grads


def call_layer(layer, h, pe):
    out = layer(h, position_embeddings=pe, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family,layout", CASES[:3])
def test_one_compiled_layer_code_equals_eager_for_every_layer_and_routing(family, layout, tmp_path):
    """fullgraph (no graph break), one compile for 2 layers x 3 routings, bitwise against eager moe4bit."""
    model, _ = patched(family, layout, tmp_path, compiled=False)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(call_layer, backend=counting, fullgraph=True)
    for layer in model.model.layers:
        for seed in range(3):
            out_c, dx_c, grads_c = layer_step(compiled, layer, model, seed)
            out_e, dx_e, grads_e = layer_step(call_layer, layer, model, seed)
            assert torch.equal(out_c, out_e) and torch.equal(dx_c, dx_e)
            assert grads_c.keys() == grads_e.keys() and grads_e  # the router's and attention's
            assert all(torch.equal(grads_c[n], g) for n, g in grads_e.items())
    assert len(graphs) == 1
    ops_in_graph = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("leantrain.grouped_proj4bit" in t for t in ops_in_graph), ops_in_graph


def test_the_compiled_forward_saves_no_dequantized_stack(tmp_path):
    """Under the min-cut partitioner (inductor's), the forward keeps packed bytes and absmax for the backward, never
    a dequantized ``[E, rows, cols]`` float stack: the compiled layer recomputes the dequantize, as eager does."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    model, _ = patched("qwen3_moe", "stacked", tmp_path, compiled=False)
    saved = []

    def forward_compiler(gm, example_inputs):
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        saved.extend(
            n.meta["val"] for n in outputs if hasattr(n, "meta") and isinstance(n.meta.get("val"), torch.Tensor)
        )
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, example_inputs: make_boxed_func(gm),
        partition_fn=min_cut_rematerialization_partition,
    )
    layer = model.model.layers[0]
    h, _ = layer_inputs(model, 0)
    out = torch.compile(lambda layer, h: layer.mlp(h), backend=backend, fullgraph=True)(layer, h)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    experts = layer.mlp.experts
    shapes = {tuple(experts.parametrizations[n][0].quant_state.shape) for n in ("gate_up_proj", "down_proj")}
    shapes |= {(e, c, r) for e, r, c in shapes}  # or a transposed view of one
    assert saved and all(len(s) == 3 for s in shapes)
    stacks = [tuple(t.shape) for t in saved if tuple(t.shape) in shapes]
    assert not stacks, f"the compiled forward saves dequantized stacks {stacks}"


# ------------------------------------------------------------------------------------------- through patch_trainer


@pytest.mark.parametrize("family,layout", CASES)
def test_patch_trainer_compiles_moe4bit_layers_bitwise_with_one_compile(family, layout, tmp_path):
    eager, _ = patched(family, layout, tmp_path / "eager", compiled=False)
    model, trainer = patched(family, layout, tmp_path / "compiled", compiled=True)
    for seed in range(3):  # three batches, three routings
        assert_equal_runs(loss_and_grads(model, seed), loss_and_grads(eager, seed))
    assert stats(trainer).compiles == 1  # 2 layers x 3 routings: one compiled code
    layer = decoder_parts(model).layers[0]
    assert getattr(layer.mlp.experts.forward, TRACEABLE_ATTR)  # compile_layers kept moe4bit's forward
    assert "compiles instead of layer_kernels" not in trainer.leantrain_report["compile_layers"].detail


def lora_model(tmp_path, compiled: bool):
    """Qwen3-MoE with 4-bit stacked experts and PEFT ``target_parameters`` LoRA on them (and on q/v)."""
    peft = pytest.importorskip("peft")
    from tests._moe4bit_lora import base_model

    model = base_model("qwen3_moe")
    leantrain.quantize_experts_4bit(model)
    config = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(
        model, peft.LoraConfig(target_parameters=leantrain.expert_lora_targets(model), **config)
    )
    # every layer's input requires grad (as under gradient checkpointing): the first layer's would not otherwise
    # (frozen embeddings), which is a guard of its own, unrelated to the experts
    model.enable_input_require_grads()
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, compile_layers=compiled, **AOT, **BOTH)
    assert report["moe4bit"].status is Status.APPLIED and "split grouped GEMMs" in report["moe4bit"].detail
    return model, trainer


def test_expert_lora_compiles_bitwise_with_one_compile(tmp_path):
    eager, _ = lora_model(tmp_path / "eager", compiled=False)
    model, trainer = lora_model(tmp_path / "compiled", compiled=True)
    for seed in range(2):
        compiled_run = loss_and_grads(model, seed)
        assert any("experts" in n and "lora_A" in n for n in compiled_run[1])
        assert_equal_runs(compiled_run, loss_and_grads(eager, seed))
    assert stats(trainer).compiles == 1


@pytest.mark.expect_fallback
def test_a_failed_check_while_compiled_sends_moe4bit_to_the_stock_path(tmp_path):
    """The plan check cannot be traced: the compiled layer's eager wrapper runs it. A replaced stack trips moe4bit's
    run-time fallback (warned, reported) and the stock experts serve, with the stock result."""
    reference = make_model("qwen3_moe", "stacked")  # unpatched: the stock per-expert loop
    model, trainer = patched("qwen3_moe", "stacked", tmp_path, compiled=True, strict=False)
    loss_and_grads(model, 0)
    experts = decoder_parts(model).layers[1].mlp.experts
    plist = experts.parametrizations["down_proj"]
    plist.original = torch.nn.Parameter(plist.original.detach().clone(), requires_grad=False)  # same bytes, new tensor
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time .*replaced after patching"):
        loss, grads = loss_and_grads(model, 1)
    report = leantrain.current_report(trainer)
    assert report["moe4bit"].status is Status.FAILED
    stock_loss, stock_grads = loss_and_grads(reference, 1)
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(loss, stock_loss, rtol=16 * eps, atol=0)  # the stock loop, compiled or eager
    for name, grad in stock_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=64 * eps * grad.abs().max().item())


def test_strict_mode_raises_for_a_failed_check_while_compiled(tmp_path):
    model, _ = patched("qwen3_moe", "stacked", tmp_path, compiled=True, strict=True)
    plist = decoder_parts(model).layers[0].mlp.experts.parametrizations["gate_up_proj"]
    plist.original = torch.nn.Parameter(plist.original.detach().clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match="replaced after patching"):
        loss_and_grads(model, 0)


# ------------------------------------------------------------------------------------------------- patch / undo


def cache_hooks(module) -> list[tuple[str, int, object]]:
    return [
        (kind, key, hook)
        for kind, hooks in (("pre", module._forward_pre_hooks), ("post", module._forward_hooks))
        for key, hook in hooks.items()
        if getattr(hook, "__module__", "") == "bitsandbytes.nn.parametrize"
    ]


def test_undo_restores_classes_and_hooks_and_parametrizations_stay_removable(tmp_path):
    from torch.nn.utils import parametrize

    model = make_model("qwen3_moe", "stacked")
    experts = [layer.mlp.experts for layer in model.model.layers]
    classes = [type(e) for e in experts]
    hooks = [cache_hooks(e) for e in experts]
    always = [dict(e._forward_hooks_always_called) for e in experts]
    assert len(set(classes)) == 2 and all(len(h) == 4 for h in hooks)  # bitsandbytes: a pair per stack
    trainer = make_trainer(model, tmp_path)
    leantrain.patch_trainer(trainer, compile_layers=True, **AOT, **BOTH)
    assert len({type(e) for e in experts}) == 1 and not any(cache_hooks(e) for e in experts)
    assert all(callable(vars(e)[EAGER_CHECK_ATTR]) for e in experts)
    leantrain.unpatch_trainer(trainer)
    assert [type(e) for e in experts] == classes
    assert [cache_hooks(e) for e in experts] == hooks  # the same hooks, keys and order
    assert [dict(e._forward_hooks_always_called) for e in experts] == always
    assert not any(EAGER_CHECK_ATTR in vars(e) for e in experts)
    parametrize.remove_parametrizations(experts[0], "gate_up_proj", leave_parametrized=False)
    assert isinstance(experts[1].gate_up_proj, torch.Tensor) and experts[1].gate_up_proj.dtype == torch.float32


@pytest.mark.expect_fallback
def test_the_stock_fallback_dequantizes_each_stack_once_per_call(tmp_path, monkeypatch):
    """Without bitsandbytes' cache hooks (detached while patched), the stock loop runs under torch's parametrization
    cache: each stack is dequantized once per call, not once per expert."""
    from leantrain.moe4bit import _qstate

    model, trainer = patched("qwen3_moe", "stacked", tmp_path, compiled=False, strict=False)
    plist = model.model.layers[0].mlp.experts.parametrizations["gate_up_proj"]
    plist.original = torch.nn.Parameter(plist.original.detach().clone(), requires_grad=False)  # trips the fallback
    calls = []
    dequantize = _qstate.FollowingParametrization.forward
    monkeypatch.setattr(
        _qstate.FollowingParametrization, "forward", lambda self, q: calls.append(q.shape) or dequantize(self, q)
    )
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        model(**batch(0))
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.FAILED
    assert len(calls) == 2 * len(model.model.layers)  # gate_up and down, once per layer


# ------------------------------------------------------------------------------------------------------- probe


def test_auto_mode_weighs_moe4bit_layers_with_their_measured_row():
    """On CUDA, layers with moe4bit's experts are weighed with the compiled-MoE measurement: a run long enough to pay
    its compile back compiles them, a shorter one says from which step it would."""
    model = make_model("qwen3_moe", "stacked")
    layer = model.model.layers[0]
    moe = compile_measured.MOE_4BIT
    pays_from = math.floor(moe.compile_s * 1000 / moe.saving_ms) + 1

    def trainer(steps: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(args=types.SimpleNamespace(device=torch.device("cuda"), max_steps=steps))

    long = compile_probe.slower_reason(trainer(pays_from), "sft", "qwen3_moe", layer, moe4bit_serves=True)
    assert long[0] is None and "pays back within this run" in long[1] and moe.evidence.detail in long[1]
    short = compile_probe.slower_reason(trainer(pays_from - 1), "sft", "qwen3_moe", layer, moe4bit_serves=True)
    assert isinstance(short, str) and f"pays back from step {pays_from}" in short and moe.evidence.detail in short


def test_peft_lora_on_plain_expert_parameters_is_declined_at_patch_time(tmp_path):
    """PEFT's LoRA on parameters (``target_parameters``) registers and removes a parametrization on every forward:
    compiled, each call would break the graph and recompile until the limit. Asked for, the patch says so and why;
    with the experts in 4-bit, moe4bit serves that LoRA and the layers compile (``lora_model`` above)."""
    peft = pytest.importorskip("peft")
    from tests._moe4bit_lora import base_model

    model = peft.get_peft_model(
        base_model("qwen3_moe"), peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["gate_up_proj"])
    )
    assert any(type(m).__name__ == compile_probe.PARAMETER_LORA for m in model.modules())
    with pytest.raises(NotReadyError, match=r"mlp\.experts holds PEFT's LoRA on a parameter \(target_parameters"):
        trainer = make_trainer(model, tmp_path)
        leantrain.patch_trainer(trainer, compile_layers=True, **AOT, **others_off("compile_layers"))


def test_4bit_experts_moe4bit_does_not_serve_are_declined_precisely(tmp_path):
    model = make_model("qwen3_moe", "stacked")
    layers = list(model.model.layers)
    cfg = types.SimpleNamespace(osft=False, moe4bit=None)
    reasons = compile_probe.run_reasons(make_trainer(model, tmp_path), model, "qwen3_moe", layers, cfg, False)
    assert any(r.startswith("MoE layers with 4-bit experts that moe4bit does not serve") for r in reasons)
    # moe4bit=False: the stock parametrized experts have a class per layer, each layer would compile its own graph
    with pytest.raises(NotReadyError, match="layer 1's mlp.experts has a parametrized class of its own"):
        leantrain.patch_trainer(
            make_trainer(model, tmp_path), compile_layers=True, **AOT, **others_off("compile_layers")
        )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_router_logits_captured_inside_compiled_layers_train_bitwise_with_one_compile(checkpointing, tmp_path):
    """TRL turns config.output_router_logits on for the MoE load-balancing loss; transformers then records the router
    logits with a ContextVar hook inside every layer, which Dynamo cannot trace. Compiled, the hook writes into a
    plain collector (the same keys at every call): one compile, the router logits and the loss with its auxiliary
    term equal eager moe4bit's bit for bit, with and without checkpointing (whose recompute must run the compiled
    code again, saving the same tensors)."""

    def run(compiled: bool):
        torch._dynamo.reset()
        model, trainer = lora_model(tmp_path / str(compiled), compiled)
        model.config.get_text_config().output_router_logits = True
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        runs = []
        for seed in range(2):
            model.zero_grad(set_to_none=True)
            out = model(**batch(seed))
            out.loss.backward()
            assert out.aux_loss is not None and len(out.router_logits) == 2  # both layers' logits, in order
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            runs.append((out.loss.detach(), out.aux_loss.detach(), [r.detach() for r in out.router_logits], grads))
        return runs, trainer

    eager, _ = run(False)
    compiled, trainer = run(True)
    assert trainer.leantrain_report["compile_layers"].status is Status.APPLIED
    for (loss_c, aux_c, logits_c, grads_c), (loss_e, aux_e, logits_e, grads_e) in zip(compiled, eager, strict=True):
        assert torch.equal(loss_c, loss_e) and torch.equal(aux_c, aux_e)
        assert all(torch.equal(c, e) for c, e in zip(logits_c, logits_e, strict=True))
        assert grads_c.keys() == grads_e.keys()
        assert all(torch.equal(grads_c[n], g) for n, g in grads_e.items()), "gradients differ from eager moe4bit"
    assert stats(trainer).compiles == 1, stats(trainer).compiles
    assert trainer.leantrain_report["compile_layers"].status is Status.APPLIED  # no run-time fallback
