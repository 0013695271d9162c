"""OSFT on CUDA for each projection precision (``OSFT_PRECISIONS``: fp32, tf32, bf16, tf32x3, bf16x3).

- the factored model at init equals the dense model (SVD on the GPU), within what the dtype itself allows;
- after AdamW steps through TRL's SFTTrainer, the exported dense weights (``trainer.save_model``) moved only in
  the trainable subspace: the weight delta projected on the frozen singular subspace is at the precision's
  rounding level, and the frozen factors are bitwise unchanged;
- merge round-trip: export -> plain ``from_pretrained`` -> logits of the factored model; ``merge()`` in place is
  bitwise the reloaded model;
- the factored projection equals the Gram form on random data to the precision's unit roundoff, and the one-pass
  reduced precisions leave a residual of their size (so the mode is really on).

Reduced precision runs on CUDA only; under the CPU development mode (``_trainer_helpers``) it is emulated in
software (``Projector(..., emulate=True)``) so the same bounds are exercised.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from _trainer_helpers import assert_same, on_cpu, rel, select_device, sft_rows, sft_trainer, unit_roundoff
from safetensors.torch import load_file
from torch import nn

import leantrain
from leantrain.cli.tiny import tiny_model
from leantrain.config import OSFT_PRECISIONS
from leantrain.osft import OSFTCallback, OSFTLinear, Projector, convert, merge, osft_layers
from leantrain.osft.ops import gram_project
from testkit.optimizations import others_off


VOCAB = 512
LAYERS = 2
OFF = others_off("osft")
U32 = unit_roundoff(torch.float32)
U_TF32 = 2.0**-11  # 10 stored mantissa bits
U_BF16 = unit_roundoff(torch.bfloat16)
# Relative error of one projection product: one reduced-precision GEMM rounds each operand once (u); the split
# forms hi*hi + hi*lo + lo*hi drop lo*lo (<= u^2), round the tails (<= u^2 each, ~u^2/3 typical) and accumulate
# in fp32 (u32).
UNIT = {
    "fp32": U32,
    "tf32": U_TF32,
    "bf16": U_BF16,
    "tf32x3": U_TF32**2 + U32,
    "bf16x3": U_BF16**2 + U32,
}
assert set(UNIT) == set(OSFT_PRECISIONS)
ONE_PASS = ("tf32", "bf16")


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    return select_device(request)


def ids(on: torch.device, batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(on)


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits.float()


def basis_defect(layer: OSFTLinear) -> float:
    """Spectral norm of U_highᵀU_high − I and V_highV_highᵀ − I (float64): how far the frozen basis is from
    orthonormal. An exact projection with this basis leaves this much in the frozen subspace."""
    u, v = layer.U_high.double(), layer.V_high.double()
    eye = torch.eye(layer.k_high, dtype=torch.float64, device=u.device)
    return float(max(torch.linalg.matrix_norm(u.t() @ u - eye, 2), torch.linalg.matrix_norm(v @ v.t() - eye, 2)))


# ---- init: the factored model equals the dense one ----------------------------------------------------------


@pytest.mark.parametrize(
    "family,dtype",
    [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.float32), ("phi3", torch.float32)],
    ids=["llama-fp32", "llama-bf16", "gpt2-fp32", "phi3-fp32"],
)
def test_init_logits_equal_dense(family, dtype, device):
    model = tiny_model(family, vocab_size=VOCAB, hidden=128, layers=LAYERS, dtype=dtype).to(device)
    truth_model = copy.deepcopy(model).double()  # exact math on the same dense weights
    x = ids(device)
    dense, truth = logits(model, x), logits(truth_model, x).double()
    conversion = convert(model, unfrozen_rank_ratio=0.5, progress=False)
    assert conversion.layers and all(layer.U_high.device.type == device.type for layer in osft_layers(model).values())
    factored = logits(model, x)
    # SVD in fp32 on the device, factors cast to the weight dtype: the reconstruction is backward stable, error
    # ~u_fp32 sqrt(n) for fp32 factors (n = 128..256), and ~u of the dtype per cast factor (three) otherwise.
    u = unit_roundoff(dtype)
    assert conversion.max_error <= (64 * U32 * math.sqrt(256) if dtype == torch.float32 else 4 * u)
    # The factored forward rounds like the dense one (u per op) plus the reconstruction error: its distance to the
    # exact logits is at most a few times the stock model's own, plus the reconstruction error carried through
    # the ~7 targets per layer.
    dense_err, factored_err = rel(dense, truth), rel(factored, truth)
    bound = 3 * dense_err + 2 * math.sqrt(7 * LAYERS) * conversion.max_error
    assert factored_err <= bound, (factored_err, dense_err, conversion.max_error)


# ---- training through SFTTrainer, measured on the exported dense weights ---------------------------------------


def trained(device, tmp_path, precision: str, dtype=torch.float32, steps: int = 4, lr: float = 1e-2, project=True):
    """An SFTTrainer with OSFT at ``precision``: exports (safetensors dicts) before and after ``steps`` AdamW steps,
    the frozen factors before, and the trainer. ``project=False`` disables the post-step parameter projection (the
    negative control)."""
    model = tiny_model("llama", vocab_size=VOCAB, hidden=128, layers=LAYERS, dtype=dtype).train()
    trainer = sft_trainer(
        model, tmp_path / "run", device, sft_rows(vocab=VOCAB), max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant", bf16=False,
    )  # fmt: skip
    x = ids(device)
    dense = logits(trainer.model.eval(), x)
    report = leantrain.patch_trainer(trainer, osft=True, osft_projection_precision=precision, **OFF)
    assert report["osft"].status.value == "applied", report
    layers = osft_layers(trainer.model)
    assert len(layers) == 7 * LAYERS and all(layer.U_high.dtype == dtype for layer in layers.values())
    factored = logits(trainer.model, x)
    assert rel(factored, dense) <= (1e-5 if dtype == torch.float32 else 8 * U_BF16)  # init (see the test above)
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, OSFTCallback))
    if on_cpu():  # development aid: reduced precision only runs on CUDA, emulate it here
        callback.projector = Projector(list(layers.values()), precision=precision, emulate=True)
    if not project:
        callback.on_optimizer_step = lambda *args, **kwargs: None
    frozen = {
        n: [getattr(lay, f).detach().clone() for f in ("U_high", "S_high", "V_high")] for n, lay in layers.items()
    }
    trainer.save_model(str(tmp_path / "before"))
    trainer.model.train()
    trainer.train()
    trainer.save_model(str(tmp_path / "after"))
    before = load_file(str(tmp_path / "before" / "model.safetensors"))
    after = load_file(str(tmp_path / "after" / "model.safetensors"))
    return trainer, layers, frozen, before, after


def frozen_part(layer: OSFTLinear, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(max(‖U_highᵀ X‖, ‖X V_highᵀ‖), X) in float64 for X = ``w`` (an exported dense weight) minus the frozen
    part U_high S_high V_high: what of the trainable part lies in the frozen subspace."""
    u, v = layer.U_high.double(), layer.V_high.double()
    x = w.double().to(u.device) - (u * layer.S_high.double()) @ v
    return float(max((u.t() @ x).norm(), (x @ v.t()).norm())), x


def check_frozen_subspace(device, tmp_path, precision: str, dtype=torch.float32, project=True) -> list[float]:
    """Trains; returns per target (leak of the exported ΔW in the frozen subspace) / (what a correct projection
    leaves), asserting that the frozen factors are bitwise unchanged and that every target trained."""
    trainer, layers, frozen, before, after = trained(device, tmp_path, precision, dtype, project=project)
    ratios = []
    for name, layer in layers.items():
        for f, value in zip(("U_high", "S_high", "V_high"), frozen[name]):
            assert torch.equal(getattr(layer, f), value), f"{name}.{f} changed"  # frozen means bitwise frozen
        w_before, w_after = before[name + ".weight"], after[name + ".weight"]
        floor, low_before = frozen_part(layer, w_before)
        _, low_after = frozen_part(layer, w_after)
        delta = low_after - low_before  # = ΔW: the frozen part cancels
        u, v = layer.U_high.double(), layer.V_high.double()
        leak = float(max((u.t() @ delta).norm(), (delta @ v.t()).norm()))
        assert delta.norm() > 0.1 * low_before.norm(), name  # it trained: the trainable part moved by > 10%
        # A correct run leaves: the export's own level at init (``floor``: the fp32 SVD's orthogonality and the
        # rounding of W to its dtype, present again after training) plus the projection's rounding, ~unit of the
        # trainable part. Measured on CPU (emulated GEMMs), leak / bound: fp32 0.2, tf32 0.1, bf16 0.1, tf32x3
        # 0.15, bf16x3 0.05, bf16 factors 0.16; without the post-step projection 1e4 (negative control below).
        unit = UNIT[precision] if layer.U_low.dtype == torch.float32 else unit_roundoff(layer.U_low.dtype)
        bound = 4 * floor + 2 * unit * float(low_before.norm() + low_after.norm())
        ratios.append(leak / bound)
        if project and layer.U_low.dtype == torch.float32 and precision in ONE_PASS:
            # the reduced precision really ran: fp32 GEMMs would leave ~1e-3 of this (measured ~0.2 unit)
            assert leak >= 1e-2 * unit * float(low_after.norm()), (name, leak)
    return ratios


@pytest.mark.parametrize("precision", OSFT_PRECISIONS)
def test_frozen_subspace_stays_frozen_on_export(precision, device, tmp_path):
    ratios = check_frozen_subspace(device, tmp_path, precision)
    assert max(ratios) <= 1.0, f"leak / bound per target: {[f'{r:.2g}' for r in ratios]}"


def test_frozen_subspace_bf16_factors(device, tmp_path):
    """A bf16 model: bf16 factors project in bf16 whatever the precision option; bound at the bf16 unit."""
    ratios = check_frozen_subspace(device, tmp_path, "fp32", dtype=torch.bfloat16)
    assert max(ratios) <= 1.0, f"leak / bound per target: {[f'{r:.2g}' for r in ratios]}"


def test_frozen_subspace_check_detects_a_missing_projection(device, tmp_path):
    """Negative control: without the post-step parameter projection AdamW's elementwise update leaks into the
    frozen subspace, far above the fp32 bound (the leak metric can fail)."""
    ratios = check_frozen_subspace(device, tmp_path, "fp32", project=False)
    assert max(ratios) > 100, f"leak / bound per target: {[f'{r:.2g}' for r in ratios]}"


# ---- merge round-trip ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "precision,dtype", [(p, torch.float32) for p in OSFT_PRECISIONS] + [("fp32", torch.bfloat16)],
    ids=list(OSFT_PRECISIONS) + ["bf16-factors"],
)  # fmt: skip
def test_merge_round_trip_same_logits(precision, dtype, device, tmp_path):
    trainer, layers, _, _, after = trained(device, tmp_path, precision, dtype, steps=2)
    model = trainer.model.eval()
    x = ids(device)
    factored = logits(model, x)
    assert not any(k.endswith(("U_high", "V_low")) for k in after) and all(n + ".weight" in after for n in layers)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "after", attn_implementation="eager", dtype=dtype
    ).to(device)
    assert all(type(m) is nn.Linear for n, m in reloaded.named_modules() if n.endswith("_proj"))
    plain = logits(reloaded.eval(), x)
    # The dense rebuild sums the k products in another order than the factored forward and rounds W once to the
    # dtype: per target ~u sqrt(k) (fp32) or ~u (bf16 W vs bf16 factors), carried through 7 targets per layer.
    u = unit_roundoff(dtype)
    per_target = u * math.sqrt(256) if dtype == torch.float32 else 4 * u
    assert rel(plain, factored) <= math.sqrt(7 * LAYERS) * per_target, rel(plain, factored)
    merge(model)
    assert not osft_layers(model)
    exported = {k: v.to(device) for k, v in after.items()}
    state = model.state_dict()
    assert_same({k: state[k] for k in exported}, exported, "merged vs exported")
    assert torch.equal(logits(model, x), plain)  # same dense weights, same plain modules: bitwise


# ---- the projection op: factored vs the Gram form on random data --------------------------------------------


@pytest.mark.parametrize("shape", [(384, 256), (256, 384)], ids=["tall", "wide"])
@pytest.mark.parametrize("precision", OSFT_PRECISIONS)
def test_factored_projection_vs_gram(precision, shape, device):
    n, m = shape
    torch.manual_seed(2)
    layer, _ = OSFTLinear.from_module(nn.Linear(m, n, bias=False, device=device), 0.5)  # SVD on the device
    assert layer.k_high == 128 and layer.U_high.device.type == device.type
    emulate = device.type != "cuda"  # development aid: software emulation of the reduced-precision GEMMs
    defect = basis_defect(layer)
    assert defect <= 64 * U32 * math.sqrt(min(n, m))  # fp32 SVD: orthonormal to ~u sqrt(n)
    u64, v64 = layer.U_high.double(), layer.V_high.double()

    def residual(du: torch.Tensor, dv: torch.Tensor, du0: torch.Tensor, dv0: torch.Tensor) -> float:
        return max(
            float((u64.t() @ du.double()).norm() / du0.norm()), float((dv.double() @ v64.t()).norm() / dv0.norm())
        )

    unit = UNIT[precision]
    for kind in ("gradients", "parameters"):
        du = torch.randn(n, layer.k_low, device=device)
        dv = torch.randn(layer.k_low, m, device=device)
        if kind == "gradients":
            layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
            Projector([layer], precision=precision, emulate=emulate).project_gradients()
            got_u, got_v = layer.U_low.grad, layer.V_low.grad
        else:
            with torch.no_grad():
                layer.U_low.copy_(du)
                layer.V_low.copy_(dv)
            Projector([layer], precision=precision, emulate=emulate).project_parameters()
            got_u, got_v = layer.U_low.detach(), layer.V_low.detach()
        ref_u, ref_v = gram_project(du.double(), dv.double(), u64, v64)
        # against the Gram form in float64 with the same (fp32) basis, relative to the input: the unit of the
        # products, plus the basis defect (the factored and Gram forms differ by it). Measured on CPU emulation:
        # 0.6 unit (tf32, bf16), 0.15 unit (bf16x3), 0.1 defect (fp32, tf32x3); 4 covers TF32 truncation (2x).
        err = max(
            float((got_u.double() - ref_u).norm() / du.norm()), float((got_v.double() - ref_v).norm() / dv.norm())
        )
        assert err <= 4 * (unit + defect), (kind, err, unit, defect)
        left = residual(got_u, got_v, du, dv)
        assert left <= 4 * (unit + defect), (kind, left)
        assert rel(du, ref_u.float()) > 0.5  # the projection removed a large component: the checks can fail
        if precision in ONE_PASS:  # one rounded pass leaves ~unit: the reduced precision is really in use
            assert left >= 0.05 * unit, (kind, left)


# ---- the SVD behind the factors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2048, 2048), (4096, 1024), (1024, 4096)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("force_fp64", [False, True], ids=["gesvda", "fp64-fallback"])
def test_thin_svd_is_orthonormal_to_fp32(shape, force_fp64, cuda, monkeypatch):
    """CUDA's default SVD driver leaves ~1e-3 orthogonality defects at 2048x2048; thin_svd's factors are
    orthonormal and reconstruct to fp32 level on both of its paths (gesvda checked, fp64 when the check fails)."""
    from leantrain.osft import linear

    if force_fp64:
        monkeypatch.setattr(linear, "_accurate", lambda *args: False)
    torch.manual_seed(0)
    w = torch.randn(*shape, device=cuda) / math.sqrt(shape[1])
    w[:, :8] *= 1e3  # a spread of singular values, like trained weights
    u, s, vh = linear.thin_svd(w)
    assert u.dtype == s.dtype == vh.dtype == torch.float32 and u.device.type == "cuda"
    k = min(shape)
    eye = torch.eye(k, dtype=torch.float64, device=cuda)
    defect = max((u.double().t() @ u.double() - eye).abs().max(), (vh.double() @ vh.double().t() - eye).abs().max())
    error = rel((u.double() * s.double()) @ vh.double(), w.double())
    bound = 8 * U32 * math.sqrt(k)  # the acceptance check's own level (~1e-7 measured)
    assert float(defect) <= bound and error <= bound, (float(defect), error, bound)
    default = torch.linalg.svd(w, full_matrices=False)[0].double()  # the negative control: the check can fail
    assert float((default.t() @ default - eye).abs().max()) > bound
