"""Compiled decoder layers on CPU against the stock layers: the same training run with and without
``compile_layers=True``, on tiny Llama / Qwen2 / Gemma-2 models in fp32.

The compiled runs use the ``aot_eager`` backend: Dynamo traces the layer and AOTAutograd splits forward and backward
into graphs that run the same aten kernels eagerly, so in fp32 the losses, gradients and weights must equal the
stock run's bit for bit (``torch.equal``). That exactness is what makes a mis-bound layer, a stale guard reusing
another layer's weights, or a checkpoint that no longer recomputes the compiled region fail here. One inductor run
checks the default backend with a tolerance (its fused kernels reorder fp32 reductions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import NotReadyError, Status
from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import patch as compile_patch
from leantrain.compile_layers import probe as compile_probe
from leantrain.compile_layers import stats
from leantrain.compile_layers.ops import Payback
from leantrain.fallback import recomputing
from leantrain.models import decoder_parts
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only


VOCAB = 256
AOT = {"compile_layers_backend": "aot_eager"}
# transformers 4.x: the probe declines (each layer compiles its own graph there); test_compile_layers_probe.py
# checks that decline on every version.
pytestmark = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5, reason="compile_layers declines on transformers 4.x"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo remembers which dimensions changed per function name and line (its "automatic dynamic" profile, kept
    on disk too), so a layer seen at several widths by an earlier test would start dynamic here: each test starts
    from a clean profile, as a first launch does."""
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        torch._dynamo.reset()
        yield
    torch._dynamo.reset()


def tiny(family: str = "llama", layers: int = 3) -> torch.nn.Module:
    return tiny_model(family, vocab_size=VOCAB, hidden=64, layers=layers).train()


def rows(n: int = 8, lengths: tuple[int, ...] = (12,)) -> list[dict[str, list[int]]]:
    return random_rows(n, lengths, VOCAB)


pad = pad_right  # the stock run sees the same padded batches


def trainer_for(model, tmp_path, data=None, **args) -> Trainer:
    config = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
        per_device_train_batch_size=2, max_steps=3, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    config.update(args)
    return Trainer(model=model, args=TrainingArguments(**config), train_dataset=data or rows(), data_collator=pad)


def run(make_model, tmp_path, patch: dict | None, data=None, **args):
    """Train; return (losses, weights, trainer)."""
    trainer = trainer_for(make_model(), tmp_path, data, **args)
    if patch is not None:
        leantrain.patch_trainer(trainer, **{**only("compile_layers"), **patch})
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, weights, trainer


def assert_same_run(stock, compiled) -> None:
    assert compiled[0] == stock[0], f"losses {compiled[0]} vs stock {stock[0]}"
    for name, w in stock[1].items():
        assert torch.equal(compiled[1][name], w), f"{name} differs from the stock run"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_trains_exactly_as_stock_with_one_compile_for_every_layer(family, tmp_path):
    stock = run(lambda: tiny(family), tmp_path, None)
    compiled = run(lambda: tiny(family), tmp_path, {"compile_layers": True, **AOT})
    assert_same_run(stock, compiled)
    trainer = compiled[2]
    assert trainer.leantrain_report["compile_layers"].status is Status.APPLIED
    assert len(trainer.leantrain_report["compile_layers"].targets) == 3
    # three layers, one compiled code: Gemma-2 alternates sliding and full attention (a guard on the layer's
    # attention type), so at most one more entry there; never one per layer
    assert stats(trainer).compiles <= (2 if family == "gemma2" else 1)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_wraps_the_compiled_layer(reentrant, tmp_path):
    ckpt = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    stock = run(tiny, tmp_path, None, **ckpt)
    compiled = run(tiny, tmp_path, {"compile_layers": True, **AOT}, **ckpt)
    assert_same_run(stock, compiled)
    assert stats(compiled[2]).compiles <= 2  # reentrant: the no-grad first pass may compile its own entry


def test_lora_adapters_train_as_stock(tmp_path):
    peft = pytest.importorskip("peft")

    def make():
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        return peft.get_peft_model(tiny(), lora)

    ckpt = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    stock = run(make, tmp_path, None, **ckpt)
    compiled = run(make, tmp_path, {"compile_layers": True, **AOT}, **ckpt)
    assert_same_run(stock, compiled)
    assert stats(compiled[2]).compiles == 1
    # alpha / r = 2: the scaling moves to the rank-r side on all 7 projections of the 3 layers, with the same bits
    assert "LoRA scaling applied to the rank-r activations in 21 linears" in (
        compiled[2].leantrain_report["compile_layers"].detail
    )


@pytest.mark.parametrize("dynamic", ["auto", "always"])
def test_varying_lengths_recompile_at_most_once(dynamic, tmp_path):
    data = rows(12, lengths=(9, 17, 12, 23, 14, 31))  # a new padded width every step
    stock = run(tiny, tmp_path, None, data, max_steps=6)
    compiled = run(
        tiny, tmp_path, {"compile_layers": True, "compile_layers_dynamic": dynamic, **AOT}, data, max_steps=6
    )
    assert_same_run(stock, compiled)
    # auto: the first width compiles static, the second compiles the sequence dimension dynamic, and that entry
    # serves every later width; always: dynamic from the start (a 0/1-size specialization may add one)
    assert stats(compiled[2]).recompiles <= 1
    assert compiled[2].leantrain_report["compile_layers"].status is Status.APPLIED


@pytest.mark.expect_fallback
def test_past_the_recompile_limit_the_eager_layers_take_over(tmp_path):
    data = rows(12, lengths=(9, 17, 12, 23, 14, 31))
    stock = run(tiny, tmp_path, None, data, max_steps=6)
    patch = {"compile_layers": True, "compile_layers_max_recompiles": 0, **AOT}
    with pytest.warns(RuntimeWarning, match="recompiled 1 times") as caught:
        compiled = run(tiny, tmp_path, patch, data, max_steps=6)
    assert sum("compile_layers failed" in str(w.message) for w in caught) == 1  # warned once
    assert_same_run(stock, compiled)
    outcome = compiled[2].leantrain_report["compile_layers"]
    assert outcome.status is Status.FAILED and "compile_layers_max_recompiles=0" in outcome.reasons[0]
    assert stats(compiled[2]).compiles == 2  # no compile after the fallback


@pytest.mark.expect_fallback
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_fallback_in_the_middle_of_a_forward_keeps_each_recompute_on_its_forwards_path(reentrant, tmp_path):
    """The fallback can trip between two layers of one forward (the recompile limit crossed at a layer whose guards
    differ, as Gemma-2's alternating attention). The layers before it ran compiled: their checkpoint recomputes in
    the backward must run the compiled code again, not the eager layers, or non-reentrant checkpointing sees other
    saved tensors than its forward saved and stops training. Later forwards are eager."""
    ckpt = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    stock = run(tiny, tmp_path, None, **ckpt)
    trainer = trainer_for(tiny(), tmp_path, **ckpt)
    leantrain.patch_trainer(trainer, **{**only("compile_layers"), "compile_layers": True, **AOT})
    forwards = []

    def trip_in_the_second_step(module, args):
        if not recomputing():  # a forward (under no_grad in reentrant checkpointing), not a recompute
            forwards.append(1)
            if len(forwards) == 2:  # layer 0 ran compiled in this step; layer 1 and after run eager
                stats(trainer).fallback.fail("injected between two layers")

    decoder_parts(trainer.model).layers[1].register_forward_pre_hook(trip_in_the_second_step)
    with pytest.warns(RuntimeWarning, match="injected between two layers"):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert_same_run(stock, (losses, weights))
    assert trainer.leantrain_report["compile_layers"].status is Status.FAILED


def test_strict_mode_raises_past_the_recompile_limit(tmp_path):
    data = rows(8, lengths=(9, 11, 13, 15, 17, 19, 21, 23))  # shuffled batches of two: a new width within 4 steps
    patch = {"compile_layers": True, "compile_layers_max_recompiles": 0, "strict": True, **AOT}
    with pytest.raises(Exception, match="compile_layers_max_recompiles=0"):
        run(tiny, tmp_path, patch, data, max_steps=4)


@pytest.mark.expect_fallback
def test_a_compile_error_falls_back_to_the_eager_layers(tmp_path, monkeypatch):
    def broken(self, gm, example_inputs):
        raise RuntimeError("injected: this layer does not compile")

    monkeypatch.setattr(compile_patch.CompileStats, "backend", broken)
    stock = run(tiny, tmp_path, None)
    with pytest.warns(RuntimeWarning, match="injected: this layer does not compile") as caught:
        compiled = run(tiny, tmp_path, {"compile_layers": True, **AOT})
    assert sum("compile_layers failed" in str(w.message) for w in caught) == 1
    assert_same_run(stock, compiled)  # training went on, on the stock layers
    outcome = compiled[2].leantrain_report["compile_layers"]
    assert outcome.status is Status.FAILED and "injected" in outcome.reasons[0]


def test_forced_probe_failure_declines_or_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_probe, "run_reasons", lambda *a: ["forced: DeepSpeed ZeRO-3"])
    trainer = trainer_for(tiny(), tmp_path)
    with pytest.raises(NotReadyError, match="forced: DeepSpeed ZeRO-3"):
        leantrain.patch_trainer(trainer, **only("compile_layers"), **AOT)
    report = leantrain.patch_trainer(trainer, **only("compile_layers", None), **AOT)
    assert report["compile_layers"].status is Status.SKIPPED
    assert "forward" not in vars(decoder_parts(trainer.model).layers[0])


def test_auto_declines_on_cpu_and_under_osft(tmp_path):
    trainer = trainer_for(tiny(), tmp_path)
    report = leantrain.patch_trainer(trainer, **only("compile_layers", None))
    assert report["compile_layers"].status is Status.SKIPPED
    reason = report["compile_layers"].reasons[0]
    assert reason.startswith("not measured on cpu (measured faster on CUDA only: llama, qwen2, gemma2 on H200")
    leantrain.unpatch_trainer(trainer)
    cfg = types.SimpleNamespace(osft=True, moe4bit=None)
    reasons = compile_probe.run_reasons(
        trainer, trainer.model, "llama", list(decoder_parts(trainer.model).layers), cfg
    )
    assert any(r.startswith("osft is on") for r in reasons)


def test_a_model_without_decoder_layers_is_not_applicable(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64))  # fmt: skip
    trainer = trainer_for(model, tmp_path)
    report = leantrain.patch_trainer(trainer, **only("compile_layers", None), strict=True)
    outcome = report["compile_layers"]
    assert outcome.status is Status.SKIPPED and "no decoder layer list" in outcome.reasons[0]  # strict: no raise


def test_unpatch_restores_the_stock_forwards_by_identity(tmp_path):
    trainer = trainer_for(tiny(), tmp_path)
    layers = decoder_parts(trainer.model).layers
    leantrain.patch_trainer(trainer, **only("compile_layers"), **AOT)
    assert all(layer.forward.__func__.__leantrain_original__ is type(layer).forward for layer in layers)
    print(trainer.model)  # the patched model still prints
    leantrain.unpatch_trainer(trainer)
    assert all("forward" not in vars(layer) for layer in layers)
    assert all(layer.forward.__func__ is type(layer).forward for layer in layers)
    assert stats(trainer) is None


def test_the_payback_arithmetic():
    assert not Payback(steps=100, saving_ms=50.0, compile_s=15.0).pays  # 5 s saved < 15 s compiling
    assert Payback(steps=400, saving_ms=50.0, compile_s=15.0).pays
    assert Payback(steps=1, saving_ms=50.0, compile_s=15.0).break_even == 301
    assert not Payback(steps=10**6, saving_ms=0.0, compile_s=1.0).pays
    fake = types.SimpleNamespace(args=types.SimpleNamespace(max_steps=50))
    assert "does not pay back within this run: 50 steps" in compile_probe.payback_reason(fake, "llama")
    fake.args.max_steps = 5000
    assert compile_probe.payback_reason(fake, "llama")[1].startswith("pays back within this run")
    assert "not measured on gpt2" in compile_probe.payback_reason(fake, "gpt2")


@pytest.mark.slow
def test_inductor_backend_trains_within_fp32_rounding(tmp_path):
    pytest.importorskip("torch._inductor")
    stock = run(tiny, tmp_path, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback here would hide an inductor failure
        compiled = run(tiny, tmp_path, {"compile_layers": True})
    assert compiled[2].leantrain_report["compile_layers"].status is Status.APPLIED
    # inductor fuses the norms and activations and reorders fp32 reductions (~1e-7 relative per op); three steps
    # of Adam at lr 1e-3 on losses ~5.5 keep the loss within 1e-5 relative, far below a wrong-layer error (~1e-2)
    for a, b in zip(compiled[0], stock[0], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.slow
def test_a_second_launch_reuses_the_compile_caches(tmp_path):
    """What the report says of the cache ("a second launch reuses them"): two processes on one cache directory; the
    first compiles (FX-graph and AOTAutograd cache misses), the second only loads (hits, no miss)."""
    pytest.importorskip("torch._inductor")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(str(repo / p) for p in ("src", ".", "benchmarks"))
    child = [sys.executable, str(Path(__file__).with_name("_compile_cache_child.py")), str(tmp_path / "out")]
    launches = []
    for _ in range(2):
        done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        launches.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = launches
    assert first["status"] == second["status"] == "applied"
    assert first["inductor"].get("fxgraph_cache_miss", 0) > 0 and not first["inductor"].get("fxgraph_cache_hit")
    assert first["aot"].get("autograd_cache_miss", 0) > 0
    assert second["inductor"].get("fxgraph_cache_hit", 0) > 0 and not second["inductor"].get("fxgraph_cache_miss")
    assert second["aot"].get("autograd_cache_hit", 0) > 0 and not second["aot"].get("autograd_cache_miss")


def test_the_checkpoint_wraps_the_compiled_region(tmp_path):
    """Checkpointing runs outside Dynamo (never traced) and the compiled forward inside it (torchtitan's order)."""
    model = tiny()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen = []
    for layer in decoder_parts(model).layers:
        original = layer._gradient_checkpointing_func

        def spy(function, *args, _original=original, **kwargs):
            seen.append(torch.compiler.is_compiling())
            return _original(function, *args, **kwargs)

        layer._gradient_checkpointing_func = spy
    trainer = trainer_for(model, tmp_path)
    leantrain.patch_trainer(trainer, **only("compile_layers"), **AOT)
    trainer.train()
    assert len(seen) == 3 * 3 and not any(seen), f"checkpoint calls (True: traced inside the compiled region): {seen}"
    assert stats(trainer).compiles == 1


def test_compiles_instead_of_the_layer_kernels_inside_the_layers(tmp_path):
    from testkit.layer_kernels_refs import emulated

    stock = run(tiny, tmp_path, None)
    with emulated() as calls:
        trainer = trainer_for(tiny(), tmp_path)
        patch = {**only("compile_layers"), "layer_kernels": True, **AOT}
        report = leantrain.patch_trainer(trainer, **patch)
        trainer.train()
        # only the final norm (outside the layers) keeps its kernel: one call a step
        assert calls == {"rms_norm": 3}, f"kernel stand-ins ran inside the compiled layers: {calls}"
    assert "compiles instead of layer_kernels inside the layers" in report["compile_layers"].detail
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == stock[0]
    layers = decoder_parts(trainer.model).layers
    leantrain.unpatch_trainer(trainer)
    assert all("forward" not in vars(m) for layer in layers for m in layer.modules())


def lora_tiny():
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    return peft.get_peft_model(tiny(), lora)


@pytest.mark.parametrize("reentrant", [False, True])
def test_elementwise_recompute_trains_exactly_as_stock(reentrant, tmp_path):
    """Recomputing the elementwise ops in the backward runs the same aten kernels on the same inputs (aot_eager,
    fp32): the run equals stock's bit for bit, LoRA and both checkpointing modes included."""
    ckpt = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    stock = run(lora_tiny, tmp_path, None, **ckpt)
    patch = {"compile_layers": True, "compile_layers_recompute": "elementwise", **AOT}
    compiled = run(lora_tiny, tmp_path, patch, **ckpt)
    assert_same_run(stock, compiled)
    assert "elementwise ops recomputed in the backward" in compiled[2].leantrain_report["compile_layers"].detail


def saved_activation_bytes(recompute: str, tmp_path) -> int:
    """Bytes the compiled layers save for their backward in one forward of a LoRA model (no checkpointing, so the
    saves stay visible): every saved tensor but the parameters, each storage counted once."""
    trainer = trainer_for(lora_tiny(), tmp_path)
    leantrain.patch_trainer(trainer, **only("compile_layers"), compile_layers_recompute=recompute, **AOT)
    model = trainer.model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = pad(rows(2, (64,)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    assert stats(trainer).compiles >= 1
    return sum(saved.values())


def test_elementwise_recompute_saves_less_for_the_backward(tmp_path):
    """The option reaches the partition: the layers stop saving what elementwise ops rebuild. At the least the MLP's
    activation product (the down projection's input, 2 x 64 tokens x the intermediate width x fp32, per layer) is
    recomputed from the gate and up outputs the SiLU backward keeps anyway."""
    default = saved_activation_bytes("default", tmp_path)
    torch._dynamo.reset()
    elementwise = saved_activation_bytes("elementwise", tmp_path)
    intermediate = tiny().config.intermediate_size
    assert elementwise <= default - 3 * 2 * 64 * intermediate * 4, (default, elementwise)


def lora_linear(alpha: int = 8, dtype: torch.dtype = torch.float32, **config) -> torch.nn.Module:
    """One PEFT LoRA linear (r=4, B not zero so the adapter counts) of a tiny model."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    lora = peft.LoraConfig(r=4, lora_alpha=alpha, lora_dropout=0.0, target_modules=["up_proj"], **config)
    model = peft.get_peft_model(tiny(layers=1), lora).to(dtype)
    module = model.base_model.model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        module.lora_B["default"].weight.normal_(0, 0.5)
    return module


def forward_and_grads(module: torch.nn.Module, forward, x: torch.Tensor, grad: torch.Tensor, autocast: bool):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = forward(module, x)
    out.backward(grad.to(out.dtype))
    return [out, x.grad] + [p.grad for p in module.parameters() if p.requires_grad]


SAME_BITS_CASES = [(8, torch.float32, False), (8, torch.bfloat16, False), (8, torch.float32, True),
                   (8, torch.bfloat16, True), (2, torch.float32, False), (12, torch.float32, False)]  # fmt: skip


@pytest.mark.parametrize(("alpha", "dtype", "autocast"), SAME_BITS_CASES)
def test_lora_scaling_on_the_rank_side_gives_the_same_bits(alpha, dtype, autocast):
    """base(x) + B(A(x) * s) against PEFT's base(x) + B(A(x)) * s, as two GEMMs: for s = 2 and 0.5 (powers of two)
    every rounding commutes with the scaling, so output and gradients are equal bit for bit, in fp32, bf16 and bf16
    autocast; s = 3 runs PEFT's own forward (and the patch leaves such a linear alone). In 16-bit compute the patch
    makes the wide side one GEMM (test_one_gemm_lora.py bounds that)."""
    from leantrain.compile_layers.ops import lora_scaled_on_rank, lora_two_gemms, scaling_folds

    module = lora_linear(alpha, dtype)
    assert scaling_folds(module, "default") is (alpha != 12)
    torch.manual_seed(4)
    x = torch.randn(2, 12, module.in_features, dtype=dtype)
    grad = torch.randn(2, 12, module.out_features)
    stock = forward_and_grads(module, type(module).forward, x, grad, autocast)
    two_gemms = lambda m, x: lora_two_gemms(m, x, "default")  # noqa: E731
    folded = forward_and_grads(module, two_gemms if alpha != 12 else lora_scaled_on_rank, x, grad, autocast)
    assert len(stock) == 4  # output, input grad, A and B grads
    for a, b in zip(stock, folded, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("config", [{"use_dora": True}, {"lora_bias": True}, {"lora_alpha": 12}])
def test_the_patch_leaves_lora_linears_it_cannot_serve_exactly_to_peft(config, tmp_path):
    alpha = config.pop("lora_alpha", 8)
    module = lora_linear(alpha, **config)
    from leantrain.compile_layers.ops import scaling_folds

    assert not scaling_folds(module, "default")


def test_disabled_adapters_run_peft_forward(tmp_path):
    """A reference forward under PEFT's disable_adapter (TRL's GRPO/DPO reference model) must see the base layer."""
    from leantrain.compile_layers.ops import lora_scaled_on_rank

    module = lora_linear()
    x = torch.randn(2, 5, module.in_features)
    module.enable_adapters(False)  # what PEFT's disable_adapter() does on every LoRA layer
    try:
        assert torch.equal(lora_scaled_on_rank(module, x), module.base_layer(x))
    finally:
        module.enable_adapters(True)
    assert not torch.equal(lora_scaled_on_rank(module, x), module.base_layer(x))


def qlora_tiny(alpha: int = 8) -> torch.nn.Module:
    """A tiny Llama with its layers' linears in bitsandbytes nf4 (as from_pretrained(load_in_4bit=True)) and LoRA
    r=4 on them: PEFT wraps them in its 4-bit LoRA class."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from testkit.moe4bit_models import load_in_4bit_like

    model = tiny(layers=2)
    load_in_4bit_like(model)
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # B starts at zero: a real adapter's products
    return model


@pytest.mark.parametrize("autocast", [False, True])
def test_qlora_scaling_on_the_rank_side_gives_the_same_bits(autocast):
    """PEFT's 4-bit LoRA linear (its own forward: cloned base output, casts only outside autocast) against the
    rank-side forward: output and gradients equal bit for bit."""
    from leantrain.compile_layers.ops import lora4bit_scaled_on_rank

    module = qlora_tiny().base_model.model.model.layers[0].mlp.up_proj
    assert type(module).__name__ == "Linear4bit"
    torch.manual_seed(4)
    x = torch.randn(2, 12, module.in_features)
    grad = torch.randn(2, 12, module.out_features)
    stock = forward_and_grads(module, type(module).forward, x, grad, autocast)
    folded = forward_and_grads(module, lora4bit_scaled_on_rank, x, grad, autocast)
    assert len(stock) == 4
    for a, b in zip(stock, folded, strict=True):
        assert torch.equal(a, b)


def test_compiled_qlora_layers_train_as_stock(tmp_path):
    """compile_layers=True on 4-bit layers (aot_eager, fp32 compute): the run equals the eager QLoRA run's bits, the
    4-bit LoRA linears served with the scaling on the rank-r side."""
    ckpt = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    stock = run(qlora_tiny, tmp_path, None, **ckpt)
    compiled = run(qlora_tiny, tmp_path, {"compile_layers": True, **AOT}, **ckpt)
    assert_same_run(stock, compiled)
    detail = compiled[2].leantrain_report["compile_layers"].detail
    assert "LoRA scaling applied to the rank-r activations in 14 linears" in detail, detail
