"""compile_layers' gated LoRA MLP (``GatedLoraMlp``: the three one-GEMM projections as one function, its backward a
chunk of rows at a time in the ``leantrain::lora_mlp_backward`` op) against autograd through the three projections
(``lora_scaled_on_rank`` each), on CPU in bf16 autocast, eager and traced by ``aot_eager``.

The forward runs the projections' very ops: the same bits. The backward's results are each held to the rounding
bound of ``testkit.lora_mlp`` against the exact (fp64) gradients of the same 16-bit operands, and to at most twice
the stock path's own error there (in norm): a dropped term or a 1% error in one adapter's gradient fails that."""

from __future__ import annotations

import pytest
import torch
import transformers

from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import ops
from leantrain.compile_layers.ops import GatedLoraMlp, gated_lora_mlp
from testkit.lora_mlp import NAMES, captured_operands, mlp_bounds, rank_side_lora_mlp


pytestmark = pytest.mark.usefixtures("fresh_dynamo")
# compile_layers declines on transformers 4.x (each layer would compile its own graph): the trainer runs need 5
needs_5 = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="compile_layers needs 5.x")
BF16 = torch.bfloat16


def lora_mlp(dropout: float = 0.0, targets: tuple[str, ...] = NAMES, family: str = "llama") -> torch.nn.Module:
    """A tiny model's MLP (bf16 base) with LoRA r=4 (scaling 2) on ``targets`` (``testkit.lora_mlp``)."""
    pytest.importorskip("peft")
    model = tiny_model(family, vocab_size=64, hidden=64, layers=1).to(BF16)
    return rank_side_lora_mlp(model, rank=4, targets=targets, dropout=dropout)


def stock(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(mlp).forward(mlp, x)


def adapters(mlp: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for short, name in zip("gud", NAMES, strict=True):
        projection = getattr(mlp, name)
        out[f"a_{short}"] = projection.lora_A["default"].weight
        out[f"b_{short}"] = projection.lora_B["default"].weight
    return out


def gradients(mlp, forward, x, grad, compiled: bool = False) -> dict[str, torch.Tensor]:
    """The output, the input gradient and the six adapter gradients of one call in bf16 autocast."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    call = (lambda t: forward(mlp, t)) if not compiled else torch.compile(
        lambda t: forward(mlp, t), backend="aot_eager", fullgraph=True
    )  # fmt: skip
    with torch.autocast("cpu", BF16):
        out = call(x)
    out.backward(grad.to(out.dtype))
    return {"out": out, "x": x.grad, **{k: w.grad for k, w in adapters(mlp).items()}}


def operands(mlp: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    return captured_operands(lambda: gradients(mlp, gated_lora_mlp, x, grad))


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("min_rows", [1, 10_000])  # four uneven chunks of rows; one chunk
def test_the_chunked_backward_is_as_close_to_exact_as_autograds(traced, min_rows, monkeypatch):
    monkeypatch.setattr(ops, "MLP_MIN_ROWS", min_rows)
    mlp = lora_mlp()
    torch.manual_seed(2)
    x, grad = torch.randn(2, 37, 64), torch.randn(2, 37, 64)  # 74 rows: chunks of 19, 19, 19, 17
    reference = gradients(mlp, stock, x, grad)
    result = gradients(mlp, gated_lora_mlp, x, grad, compiled=traced)
    assert torch.equal(result["out"], reference["out"])  # the projections' very ops
    scales = [2.0, 2.0, 2.0]
    exact, bounds = mlp_bounds(operands(mlp, x, grad), scales, BF16)
    for key, value in exact.items():
        shape = value.shape
        for name, run in (("leantrain", result), ("autograd", reference)):
            error = (run[key].double().reshape(shape) - value).abs()
            assert (error <= bounds[key]).all(), f"{name} {key}: {(error / bounds[key]).max():.2f} of the bound"
        ours = (result[key].double().reshape(shape) - value).norm()
        theirs = (reference[key].double().reshape(shape) - value).norm()
        assert ours <= 2 * theirs + 1e-12 * value.norm(), f"{key}: error {ours:.3g} vs autograd's {theirs:.3g}"


def test_one_percent_off_in_an_adapter_gradient_fails_the_comparison(monkeypatch):
    """The comparison above resolves a small mistake: each adapter gradient 1% off fails it."""
    monkeypatch.setattr(ops, "MLP_MIN_ROWS", 1)
    mlp = lora_mlp()
    torch.manual_seed(2)
    x, grad = torch.randn(2, 37, 64), torch.randn(2, 37, 64)
    reference = gradients(mlp, stock, x, grad)
    result = gradients(mlp, gated_lora_mlp, x, grad)
    exact, _ = mlp_bounds(operands(mlp, x, grad), [2.0, 2.0, 2.0], BF16)
    for key, value in exact.items():
        off = (result[key].double().reshape(value.shape) * 1.01 - value).norm()
        theirs = (reference[key].double().reshape(value.shape) - value).norm()
        assert off > 2 * theirs, key


def spy_calls(monkeypatch) -> list:
    calls = []
    real = GatedLoraMlp.apply
    monkeypatch.setattr(GatedLoraMlp, "apply", lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.parametrize(
    ("case", "taken"), [("bf16", True), ("fp32", False), ("dropout", False), ("hooked", False), ("disabled", False)]
)
def test_where_the_gated_mlp_applies(case, taken, monkeypatch):
    """16-bit compute with one vanilla adapter on each projection, no dropout, no hooks: else the stock forward
    (each projection still on its rank-side forward), with the stock forward's result."""
    mlp = lora_mlp(dropout=0.1 if case == "dropout" else 0.0).eval()  # dropout's module decides, not its draw
    if case == "fp32":
        mlp.float()
    if case == "hooked":
        mlp.up_proj.register_forward_hook(lambda module, args, out: None)
    if case == "disabled":
        for name in NAMES:
            getattr(mlp, name)._disable_adapters = True  # PEFT's per-layer switch
    calls = spy_calls(monkeypatch)
    x = torch.randn(1, 5, 64)
    with torch.autocast("cpu", BF16, enabled=case != "fp32"):
        out = gated_lora_mlp(mlp, x)
        expected = stock(mlp, x)
    assert bool(calls) is taken, case
    assert torch.equal(out, expected)


def test_only_stock_gated_silu_mlps_with_three_lora_projections_qualify():
    assert ops.is_gated_lora_mlp(lora_mlp())
    assert ops.is_gated_lora_mlp(lora_mlp(family="qwen2"))
    assert not ops.is_gated_lora_mlp(lora_mlp(targets=("gate_proj", "up_proj")))
    assert not ops.is_gated_lora_mlp(lora_mlp(family="gemma2"))  # a GELU gate


@needs_5
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_bf16_lora_run_trains_through_the_gated_mlps(reentrant, tmp_path, monkeypatch):
    """``patch_trainer`` binds it on every layer's MLP (a 16-bit LoRA run with checkpointing): the compiled layers
    run its backward, the losses follow stock's within bf16 rounding, and unpatching restores the
    class's forwards."""
    peft = pytest.importorskip("peft")
    from transformers import Trainer, TrainingArguments

    import leantrain
    from testkit.batches import pad_right, random_rows
    from testkit.optimizations import only

    def run(patch: bool):
        model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train().to(BF16)
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)  # bf16 adapters: 16-bit compute
        args = TrainingArguments(
            output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3, bf16=True,
            per_device_train_batch_size=2, max_steps=2, logging_steps=1, disable_tqdm=True, seed=0,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=random_rows(4, (40,), 256), data_collator=pad_right)
        if patch:
            options = {"compile_layers": True, "compile_layers_backend": "aot_eager", "compile_layers_mlp_chunks": 4}
            leantrain.patch_trainer(trainer, **{**only("compile_layers"), **options})
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    stock_losses, _ = run(False)
    chunks = []  # the op's eager body runs at run time (Dynamo traces ``GatedLoraMlp.apply`` itself, not a spy)
    real = ops.silu_mul  # once per chunk
    monkeypatch.setattr(ops, "silu_mul", lambda *args: chunks.append(1) or real(*args))
    losses, trainer = run(True)
    assert "2 gated LoRA MLPs" in trainer.leantrain_report["compile_layers"].detail
    assert len(chunks) == 2 * 2  # two layers' backwards, two steps, one chunk each (80 rows)
    for ours, theirs in zip(losses, stock_losses, strict=True):
        assert abs(ours - theirs) <= 8 * 2.0**-8 * abs(theirs)  # bf16's rounding of a few steps' updates
    mlps = [layer.mlp for layer in trainer.model.base_model.model.model.layers]
    leantrain.unpatch_trainer(trainer)
    assert all("forward" not in vars(mlp) for mlp in mlps)


_TRITON_SCRIPT = """
import torch
from leantrain.compile_layers import _triton, ops
torch.manual_seed(0)
rows, cols = 3, _triton.BLOCK + 7  # blocks across rows, a partial last block
g = (torch.randn(rows, cols) * 4).to(torch.bfloat16)
u, dh = torch.randn(rows, cols).to(torch.bfloat16), torch.randn(rows, cols).to(torch.bfloat16)
exact_h = torch.nn.functional.silu(g.double()) * u.double()
sig = torch.sigmoid(g.double())
exact_du = dh.double() * g.double() * sig
exact_dg = dh.double() * u.double() * sig * (1 + g.double() * (1 - sig))


def run(silu_mul, silu_mul_backward_):
    # the op's layout: [dg | h, then du] rows side by side in one buffer; the guard columns stay untouched
    pair = torch.full((rows, 2 * cols + 5), 7.0, dtype=torch.bfloat16)
    left, right = pair[:, :cols], pair[:, cols : 2 * cols]
    silu_mul(g, u, right)
    h = right.clone()
    left.copy_(dh)
    silu_mul_backward_(left, g, u, right)
    assert (pair[:, 2 * cols :] == 7).all()
    return h, right.clone(), left.clone()


worst = 0.0
kernel = run(_triton.silu_mul, _triton.silu_mul_backward_)
torch_ops = run(ops.silu_mul, ops.silu_mul_backward_)  # CPU tensors: the torch ops
for got, ref, exact in zip(kernel, torch_ops, (exact_h, exact_du, exact_dg)):
    bound = (2.0**-8 + 16 * 2.0**-24) * exact.abs() + 2.0**-133  # one bf16 rounding of an fp32 result
    # the interpreter casts fp32 to bf16 by truncation (up to one bf16 ulp: twice the rounding's bound)
    for result, ulps in ((got, 2), (ref, 1)):
        worst = max(worst, ((result.double() - exact).abs() / (ulps * bound)).max().item())
print("WORST", worst)
"""


def test_the_triton_elementwise_kernels_round_once_as_the_torch_ops():
    """The two Triton kernels (CPU interpreter) and the torch ops of the CPU path, writing into column slices of one
    buffer as the op does: each result within one bf16 rounding of the exact value (fp32 compute; the interpreter
    truncates where the GPU rounds, so one bf16 ulp for the kernels here: the CUDA test holds them to the rounding)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = float(proc.stdout.split("WORST")[-1])
    assert worst <= 1, worst


@needs_5
@pytest.mark.parametrize("offload", [None, True])
def test_no_mlp_chunks_by_default_and_bad_values_raise(offload, tmp_path):
    """By default (``compile_layers_mlp_chunks=0``, with or without offload_checkpoints=True) no MLP is bound (the
    projections' rank-side forwards stay); a value out of range is a clear error at ``patch_trainer`` time."""
    peft = pytest.importorskip("peft")
    from transformers import Trainer, TrainingArguments

    import leantrain
    from testkit.batches import pad_right, random_rows
    from testkit.optimizations import only

    def trainer():
        model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train()
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        args = TrainingArguments(
            output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, gradient_checkpointing=True
        )
        return Trainer(model=model, args=args, train_dataset=random_rows(2, (8,), 256), data_collator=pad_right)

    options = {**only("compile_layers"), "compile_layers": True, "compile_layers_backend": "aot_eager"}
    patched = trainer()
    leantrain.patch_trainer(patched, **{**options, "offload_checkpoints": offload})
    layers = patched.model.base_model.model.model.layers
    assert all("forward" not in vars(layer.mlp) for layer in layers)
    assert all("forward" in vars(layer.mlp.up_proj) for layer in layers)
    assert "gated LoRA MLPs" not in patched.leantrain_report["compile_layers"].detail
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="compile_layers_mlp_chunks"):
            leantrain.patch_trainer(trainer(), **options, compile_layers_mlp_chunks=bad)


def test_the_chunks_start_at_half_the_largest_micro_batch_the_trainer_can_build():
    assert ops.mlp_min_rows(2, 4 * 2048) == 4096
    assert ops.mlp_min_rows(2, None) == 0  # not told: every micro-batch
    assert ops.mlp_min_rows(0, 4 * 2048) == 0  # no chunks


@pytest.mark.parametrize("compiled", [False, True])
def test_a_micro_batch_below_min_rows_keeps_autograds_backward(compiled, monkeypatch):
    """Rows below ``min_rows``: the stock forward (autograd's backward through the projections, no chunk); at or
    above it: ``GatedLoraMlp`` (chunks). Compiled, the row count is a guard: each side compiles once, and each side's
    gradients are its eager path's bit for bit."""
    monkeypatch.setattr(ops, "MLP_MIN_ROWS", 1)
    chunks = []
    real = ops.silu_mul  # once per chunk of the chunked backward
    monkeypatch.setattr(ops, "silu_mul", lambda *args: chunks.append(1) or real(*args))
    mlp = lora_mlp()
    torch.manual_seed(0)

    def chunked(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return gated_lora_mlp(m, x, chunks=2, min_rows=40)

    frames = []
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("aot_eager")
        call = torch.compile(chunked, backend=counter, dynamic=True, fullgraph=True)
        frames.append(counter)
    else:
        call = chunked
    counts = []  # the compiles after each call
    for rows, expect_chunks in ((3, 0), (20, 2), (5, 0), (30, 2)):  # 2 x rows: below, above, below, above 40
        x, grad = torch.randn(2, rows, 64), torch.randn(2, rows, 64)
        before = len(chunks)
        ours = gradients(mlp, lambda m, t: call(m, t), x, grad)
        assert len(chunks) - before == expect_chunks, rows
        counts.append(frames[0].frame_count if frames else 0)
        eager = gradients(mlp, chunked if expect_chunks else stock, x, grad)
        for name, value in eager.items():
            assert torch.equal(ours[name], value), (rows, name)
    if compiled:  # the other side of the row guard compiles once; every later length is served
        assert counts[1] > counts[0] and counts[2:] == [counts[1]] * 2, counts


@needs_5
def test_the_plan_chunks_only_micro_batches_of_half_batch_times_max_length(tmp_path, monkeypatch):
    """A trainer told its max_length (SFT's argument): micro-batches of at least half of batch x max_length take the
    chunked backward, smaller ones autograd's; the report says from which size."""
    from dataclasses import dataclass

    peft = pytest.importorskip("peft")
    from transformers import Trainer, TrainingArguments

    import leantrain
    from testkit.batches import pad_right, random_rows
    from testkit.optimizations import only

    @dataclass
    class Args(TrainingArguments):
        max_length: int | None = None  # what SFTConfig adds

    monkeypatch.setattr(ops, "MLP_MIN_ROWS", 1)
    chunks = []
    real = ops.silu_mul
    monkeypatch.setattr(ops, "silu_mul", lambda *args: chunks.append(1) or real(*args))
    model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train().to(BF16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                                autocast_adapter_dtype=False)  # fmt: skip
    args = Args(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=True, per_device_train_batch_size=2,
                max_steps=1, max_length=40)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=random_rows(2, (40,), 256), data_collator=pad_right)
    options = {"compile_layers": True, "compile_layers_backend": "aot_eager", "compile_layers_mlp_chunks": 2}
    leantrain.patch_trainer(trainer, **{**only("compile_layers"), **options})
    assert "on micro-batches of at least 40 tokens" in trainer.leantrain_report["compile_layers"].detail
    for width, expect in ((10, 0), (30, 2 * 2)):  # 2 x 10 rows: below 40; 2 x 30: two layers, two chunks each
        before = len(chunks)
        ids = torch.randint(3, 256, (2, width))
        with torch.autocast("cpu", BF16):
            loss = trainer.model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert len(chunks) - before == expect, width
    leantrain.unpatch_trainer(trainer)
