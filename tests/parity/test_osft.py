"""OSFT op- and model-level parity: factored layer vs dense, factored vs Gram projection, orthogonality under AdamW,
export (merge → save → from_pretrained), undo by identity, torch.compile. CPU, fp32 unless stated, seeded."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch import nn

from leantrain.cli.tiny import tiny_model
from leantrain.osft import OSFTLinear, Projector, convert, dense_state_dict, frozen_overlap, merge, osft_layers
from leantrain.osft.ops import PRECISIONS, check_precision, gram_project
from leantrain.osft.probe import find_targets


torch.set_num_threads(1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def ids(batch: int = 2, length: int = 16, vocab: int = 2048, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def subspace_leak(layer: OSFTLinear, w0: torch.Tensor) -> tuple[float, float]:
    """(max(‖U_highᵀ ΔW‖, ‖ΔW V_highᵀ‖), ‖U_highᵀ ΔW V_highᵀ‖), relative to ‖ΔW‖, in float64."""
    dw = layer.dense_weight(torch.float64) - w0
    u, v = layer.U_high.double(), layer.V_high.double()
    one = max((u.t() @ dw).norm(), (dw @ v.t()).norm()) / dw.norm()
    return float(one), float((u.t() @ dw @ v.t()).norm() / dw.norm())


# -- the layer -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "gpt_neox", "gemma2", "qwen3_moe"])
def test_logits_at_init_equal_dense(family):
    model = tiny_model(family)
    with torch.no_grad():
        dense = model(ids()).logits
    conversion = convert(model, unfrozen_rank_ratio=0.5, progress=False)
    with torch.no_grad():
        factored = model(ids()).logits
    # fp32 SVD reconstruction (~1e-6 relative per target, reported as max_error) carried through 4 layers.
    assert rel(factored, dense) <= 1e-5
    assert 0 < conversion.max_error <= 5e-6


@pytest.mark.parametrize(
    "family,expected",
    [
        ("llama", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        ("phi3", {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
        ("gpt2", {"c_attn", "c_proj", "c_fc"}),
        ("gpt_neox", {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}),
        ("qwen3_moe", {"q_proj", "k_proj", "v_proj", "o_proj"}),  # MoE: attention only
        ("gpt_oss", {"q_proj", "k_proj", "v_proj", "o_proj"}),
    ],
)
def test_default_targets_per_architecture(family, expected):
    model = tiny_model(family, layers=2)
    conversion = convert(model, progress=False)
    assert {name.rsplit(".", 1)[-1] for name in conversion.layers} == expected
    assert not any("lm_head" in n or "embed" in n for n in conversion.layers)


def test_gpt2_conv1d_round_trip():
    from transformers.pytorch_utils import Conv1D

    model = tiny_model("gpt2")
    attn = model.transformer.h[0].attn
    original, weight = attn.c_attn, attn.c_attn.weight.detach().clone()
    with torch.no_grad():
        dense = model(ids()).logits
    conversion = convert(model, progress=False)
    layer = attn.c_attn
    assert isinstance(layer, OSFTLinear) and layer.transposed
    assert (layer.out_features, layer.in_features) == (weight.shape[1], weight.shape[0])  # Conv1D stores (in, out)
    with torch.no_grad():
        assert rel(model(ids()).logits, dense) <= 1e-5
    merge(model)
    assert attn.c_attn is original and isinstance(original, Conv1D)
    assert rel(original.weight, weight) <= 5e-6  # fp32 SVD reconstruction
    assert "transformer.h.0.attn.c_attn" in conversion.layers


def test_ratio_one_freezes_nothing_and_bad_ratio_errors():
    linear = nn.Linear(24, 40)
    layer, _ = OSFTLinear.from_module(linear, 1.0)
    assert layer.k_high == 0 and layer.k_low == 24
    x = torch.randn(5, 24)
    assert rel(layer(x), linear(x)) <= 5e-6  # fp32 SVD reconstruction
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            OSFTLinear.from_module(linear, bad)
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            convert(tiny_model("llama", layers=1), unfrozen_rank_ratio=bad, progress=False)


def test_rank_split_and_frozen_flags():
    linear = nn.Linear(24, 40, bias=False)
    layer, _ = OSFTLinear.from_module(linear, 0.3)
    assert layer.k_high == int(24 * 0.7) == 16 and layer.k_low == 8
    assert [p.requires_grad for p in (layer.U_high, layer.S_high, layer.V_high)] == [False] * 3
    assert [p.requires_grad for p in (layer.U_low, layer.S_low, layer.V_low)] == [True] * 3
    assert {n for n, _ in layer.named_parameters()} == {"U_high", "S_high", "V_high", "U_low", "S_low", "V_low"}


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (33, 33)])
def test_layer_forward_backward_match_dense(shape):
    out_f, in_f = shape
    torch.manual_seed(0)
    linear = nn.Linear(in_f, out_f)
    layer, _ = OSFTLinear.from_module(linear, 0.5)
    x = torch.randn(3, 7, in_f, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), linear(x2)
    # fp32 thin SVD reconstructs W to ~1e-6 relative (Frobenius): outputs and input grads inherit that.
    assert y.shape == y_ref.shape and rel(y, y_ref) <= 5e-6
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert rel(x.grad, x2.grad) <= 5e-6
    assert layer.bias is linear.bias and torch.equal(layer.bias.grad, linear.bias.grad)  # same op on the same grad
    # dW of the dense layer, chained through the factors: dU_low = dW V_lowᵀ S_low.
    expected = linear.weight.grad @ layer.V_low.detach().t() * layer.S_low.detach()
    assert rel(layer.U_low.grad, expected) <= 1e-5


def test_forward_under_bf16_autocast_with_fp32_factors():
    linear = nn.Linear(32, 48)
    layer, _ = OSFTLinear.from_module(linear, 0.5)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = layer(x), linear(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert rel(y, y_ref) <= 2e-2  # bf16 rounding of activations and factors (8-bit mantissa)


def test_torch_compile_fullgraph_matches_eager():
    linear = nn.Linear(32, 48)
    layer, _ = OSFTLinear.from_module(linear, 0.5)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break allowed
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    eager_x = x.detach().clone().requires_grad_()
    grads = [p.grad.clone() for p in (layer.U_low, layer.S_low, layer.V_low)]
    for p in (layer.U_low, layer.S_low, layer.V_low):
        p.grad = None
    y_eager = layer(eager_x)
    y_eager.sum().backward()
    assert torch.allclose(y, y_eager, rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad, eager_x.grad, rtol=1e-6, atol=1e-6)
    for g, p in zip(grads, (layer.U_low, layer.S_low, layer.V_low)):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6)


# -- targets -----------------------------------------------------------------------------------------------------


def test_target_patterns_glob_regex_suffix_and_unmatched():
    model = tiny_model("llama", layers=2)
    suffix = {n for n, _ in find_targets(model, ["q_proj"], strict=True)}
    glob = {n for n, _ in find_targets(model, ["*.self_attn.q_proj"], strict=True)}
    regex = {n for n, _ in find_targets(model, [r"re:model\.layers\.\d+\.self_attn\.q_proj"], strict=True)}
    assert suffix == glob == regex == {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}
    only_first = {n for n, _ in find_targets(model, ["model.layers.0.mlp.*"], strict=True)}
    assert only_first == {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match="'nope_proj'"):
        find_targets(model, ["q_proj", "nope_proj"], strict=True)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        convert(model, targets=["self_attn"], progress=False)  # a block, not a linear
    with pytest.raises(ValueError, match="bad regular expression"):
        find_targets(model, ["re:("], strict=True)


# -- projection --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,k_high", [((40, 24), 12), ((24, 40), 12), ((48, 48), 17), ((30, 64), 29)])
def test_factored_projection_equals_gram_form(shape, k_high):
    n, m = shape
    torch.manual_seed(1)
    linear = nn.Linear(m, n, bias=False)
    layer, _ = OSFTLinear.from_module(linear, 1 - (k_high + 0.5) / min(n, m))
    assert layer.k_high == k_high
    du, dv = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
    Projector([layer]).project_gradients()
    ref_u, ref_v = gram_project(du.double(), dv.double(), layer.U_high.double(), layer.V_high.double())

    def err(got, ref, inp):  # relative to the input gradient: with k_low = 1 the result is a small remainder
        return float((got.double() - ref).norm() / inp.double().norm())

    assert err(layer.U_low.grad, ref_u, du) <= 1e-6
    assert err(layer.V_low.grad, ref_v, dv) <= 1e-6
    # and the projection removed a non-trivial component (the test can fail)
    assert rel(du, ref_u) > 0.1 and rel(dv, ref_v) > 0.1
    # the simple (fallback) path agrees with the batched one
    layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
    Projector([layer], batched=False).project_gradients()
    assert err(layer.U_low.grad, ref_u, du) <= 1e-6 and err(layer.V_low.grad, ref_v, dv) <= 1e-6


def _train(model, steps: int, *, pre: bool = True, post: bool = True, lr: float = 1e-2, seed: int = 0, **kw):
    layers = list(osft_layers(model).values())
    projector = Projector(layers, **kw)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = torch.randint(3, model.config.vocab_size, (4, 24), generator=generator)
        loss = model(batch, labels=batch).loss
        loss.backward()
        if pre:
            projector.project_gradients()
        optimizer.step()
        if post:
            projector.project_parameters()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
def test_adamw_steps_keep_the_frozen_subspace_and_leak_without_projection():
    results = {}
    for mode in ("both", "grad_only", "none"):
        model = tiny_model("llama", layers=2).train()
        convert(model, unfrozen_rank_ratio=0.5, progress=False)
        layers = osft_layers(model)
        w0 = {n: layer.dense_weight(torch.float64) for n, layer in layers.items()}
        _train(model, 15, pre=mode != "none", post=mode == "both")
        leaks = [subspace_leak(layer, w0[n]) for n, layer in layers.items()]
        results[mode] = (max(a for a, _ in leaks), max(b for _, b in leaks))
        if mode == "both":
            assert max(frozen_overlap(layer) for layer in layers.values()) <= 1e-6
            for layer in layers.values():  # frozen factors untouched
                assert layer.U_high.grad is None and layer.V_high.grad is None
    # fp32: measured ~5e-7 one-sided, ~1e-7 two-sided after 15 AdamW steps at lr 1e-2 (rounding of 4-layer GEMMs).
    assert results["both"][0] <= 1e-5 and results["both"][1] <= 1e-5
    # Without the post-step projection AdamW's elementwise update leaks (measured ~1e-1); with nothing, worse.
    assert results["grad_only"][0] > 1e-2
    assert results["none"][0] > results["grad_only"][0]


def test_bf16_factors_stay_orthogonal_to_bf16_rounding():
    model = tiny_model("llama", layers=1, dtype=torch.bfloat16).train()
    convert(model, progress=False)
    layers = osft_layers(model)
    assert all(layer.U_low.dtype == torch.bfloat16 for layer in layers.values())
    _train(model, 4)
    # bf16 U_high itself is orthonormal only to ~4e-3 (8-bit mantissa): the projection is exact up to that.
    assert max(frozen_overlap(layer) for layer in layers.values()) <= 2e-2


# -- reduced-precision projection (tf32x3 / bf16x3), emulated on CPU ---------------------------------------------


def _residual(layer: OSFTLinear, du: torch.Tensor, dv: torch.Tensor) -> float:
    """max(|U_highᵀ dU′|, |dV′ V_highᵀ|) / max|d·| in float64: what the projection left in the frozen subspace."""
    u, v = layer.U_high.double(), layer.V_high.double()
    ru = (u.t() @ layer.U_low.grad.double()).abs().max() / du.abs().max()
    rv = (layer.V_low.grad.double() @ v.t()).abs().max() / dv.abs().max()
    return float(max(ru, rv))


def _project(layer, du, dv, passes: int = 1, **kw) -> float:
    layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
    for _ in range(passes):
        Projector([layer], **kw).project_gradients()
    return _residual(layer, du, dv)


@pytest.mark.parametrize("shape", [(160, 96), (96, 160)])
def test_split_precision_projection_reaches_fp32_orthogonality(shape):
    n, m = shape
    torch.manual_seed(2)
    layer, _ = OSFTLinear.from_module(nn.Linear(m, n, bias=False), 0.5)
    du, dv = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    res = {p: _project(layer, du, dv, precision=p, emulate=True) for p in PRECISIONS}
    exact = res["fp32"]
    # The floor: U_high/V_high from the fp32 SVD are orthonormal to ~1e-6, measured 1.0e-6 (fp32 GEMMs as well).
    assert exact <= 3e-6
    # One reduced-precision pass leaves ~eps of the gradient (measured tf32 6e-4, bf16 4e-3) ...
    assert res["tf32"] > 1e-4 and res["bf16"] > 1e-3
    # ... a second identical pass does not fix it: the operands of B_highᵀ·G₁ are O(1), only their product is
    # small, so rounding them leaves ~eps again (measured tf32 2e-4, bf16 2e-3) ...
    assert _project(layer, du, dv, passes=2, precision="tf32", emulate=True) > 5e-5
    assert _project(layer, du, dv, passes=2, precision="bf16", emulate=True) > 5e-4
    # ... while splitting every operand into head + tail (3 products each) leaves ~eps²: tf32x3 at the fp32 floor
    # (measured 1.00e-6 vs 1.02e-6), bf16x3 ~eps_bf16² (measured 6.6e-6).
    assert res["tf32x3"] <= 1.5 * exact
    assert res["bf16x3"] <= 2e-5
    # and the result is the fp32 projection, not just any orthogonal vector (relative to the input gradient).
    _project(layer, du, dv, precision="fp32")
    ref_u, ref_v = layer.U_low.grad.clone(), layer.V_low.grad.clone()
    _project(layer, du, dv, precision="tf32x3", emulate=True)
    assert rel(layer.U_low.grad, ref_u) <= 1e-5 and rel(layer.V_low.grad, ref_v) <= 1e-5


def test_split_precision_off_cuda_is_the_fp32_path_bitwise():
    torch.manual_seed(3)
    layer, _ = OSFTLinear.from_module(nn.Linear(48, 40, bias=False), 0.5)
    du, dv = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    _project(layer, du, dv, precision="fp32")
    ref_u, ref_v = layer.U_low.grad.clone(), layer.V_low.grad.clone()
    for precision in ("tf32x3", "bf16x3", "tf32"):  # no emulation: reduced precision is CUDA-only
        _project(layer, du, dv, precision=precision)
        assert torch.equal(layer.U_low.grad, ref_u) and torch.equal(layer.V_low.grad, ref_v), precision


def test_precision_option_resolution():
    from leantrain.config import resolve_config

    # the default: fp32-level and the fastest such in a whole step on an H100 (Triton tf32x3 303 ms vs fp32 336 ms)
    assert resolve_config({}, environ={}).osft_projection_precision == "tf32x3"
    assert check_precision("fp32") == "fp32"
    assert Projector([], tf32=True).precision == "tf32"
    for bad in ("fp16", "tf32x2", ""):
        with pytest.raises(ValueError, match="precision must be one of"):
            check_precision(bad)
        with pytest.raises(ValueError, match="precision must be one of"):
            Projector([], precision=bad)
        with pytest.raises(ValueError, match="OSFT_PROJECTION_PRECISION must be one of"):
            resolve_config({}, environ={"LEANTRAIN_OSFT_PROJECTION_PRECISION": bad or "x"})


@pytest.mark.slow
@pytest.mark.parametrize("precision,max_leak,max_overlap", [("tf32x3", 5e-6, 5e-7), ("bf16x3", 5e-5, 2e-5)])
def test_adamw_steps_with_split_precision_keep_the_frozen_subspace(precision, max_leak, max_overlap):
    model = tiny_model("llama", layers=1).train()
    convert(model, unfrozen_rank_ratio=0.5, progress=False)
    layers = osft_layers(model)
    w0 = {n: layer.dense_weight(torch.float64) for n, layer in layers.items()}
    _train(model, 6, precision=precision, emulate=True)  # gradients and parameters, emulated GEMMs
    leak = max(subspace_leak(layer, w0[n])[0] for n, layer in layers.items())
    overlap = max(frozen_overlap(layer) for layer in layers.values())
    # Measured after 6 steps: fp32 GEMMs leak 7.9e-7 / overlap 5.8e-8; tf32x3 7.9e-7 / 8.2e-8 (fp32 level);
    # bf16x3 7.2e-6 / 2.9e-6 (~eps_bf16²); one-pass tf32 4.8e-4 / 1.5e-4. Bounds: ~6x the measured value.
    assert leak <= max_leak and overlap <= max_overlap, (leak, overlap)


def _emulated_worker(rank: int, world: int, port: int, scenario: str, out: str, precision: str) -> None:
    from tests.distributed import _osft_worker as worker

    worker.Projector = functools.partial(Projector, precision=precision, emulate=True)
    worker.run(rank, world, port, scenario, out)


@pytest.mark.slow
@pytest.mark.distributed
def test_split_precision_under_fsdp2_both_layouts(tmp_path):
    """Shard(1) (coefficients all-reduced: per-rank partial products in split precision) and Shard(0) (V_high
    gathered) with emulated tf32x3 match the single-process emulated run."""
    from tests.distributed import _osft_worker as worker

    results = worker.spawn_two(_emulated_worker, "fsdp", tmp_path / "fsdp.pt", "tf32x3")
    original = worker.Projector
    worker.Projector = functools.partial(Projector, precision="tf32x3", emulate=True)
    try:
        reference = worker.train("single")
    finally:
        worker.Projector = original
    for mode in ("fsdp_shard1", "fsdp_default"):
        result = results[mode]
        assert result["collectives"], mode
        for name, value in reference["params"].items():
            # as the fp32 distributed test: summation order of the rank halves and of the partial coefficients
            assert torch.allclose(result["params"][name], value, rtol=1e-5, atol=1e-6), (mode, name)
        assert result["overlap"] <= 1e-6, mode  # fp32-level orthogonality through the sharded split products
    assert results["naive"]["leantrain"] <= 1e-5


# -- export and undo ---------------------------------------------------------------------------------------------


def test_merge_save_from_pretrained_same_logits(tmp_path):
    model = tiny_model("llama", layers=2).train()
    convert(model, progress=False)
    _train(model, 3, lr=1e-2)
    model.eval()
    with torch.no_grad():
        trained = model(ids()).logits
    state = dense_state_dict(model.state_dict(), model)  # what trainer.save_model() writes
    assert not any(k.endswith(("U_high", "V_low")) for k in state)
    merge(model)
    assert not osft_layers(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key  # the two export paths agree bitwise
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with torch.no_grad():
        # fp32 rebuild of W from the factors vs factored forward: the sum order differs, ~1e-7 relative.
        assert rel(reloaded(ids()).logits, trained) <= 1e-5


def test_undo_restores_modules_and_weights_by_identity():
    model = tiny_model("llama", layers=2)
    before = {n: m for n, m in model.named_modules()}
    weights = {n: (m.weight, m.weight.detach().clone()) for n, m in before.items() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        dense = model(ids()).logits
    conversion = convert(model, progress=False)
    q = conversion.layers["model.layers.0.self_attn.q_proj"]
    assert q.in_features == 64 and model.model.layers[0].self_attn.q_proj is q
    assert weights["model.layers.0.self_attn.q_proj"][0].numel() == 0  # storage released, not duplicated
    conversion.undo()
    assert {n: m for n, m in model.named_modules()} == before  # every module object is back
    for name, (param, value) in weights.items():
        module = model.get_submodule(name)
        assert module.weight is param
        assert rel(param, value) <= 5e-6  # untrained: original up to the fp32 reconstruction error
    with torch.no_grad():
        assert rel(model(ids()).logits, dense) <= 1e-5


def test_frozen_and_shared_weights_are_skipped():
    model = tiny_model("llama", layers=1)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    conversion = convert(model, progress=False)
    assert "model.layers.0.self_attn.q_proj" in conversion.skipped
    assert "model.layers.0.self_attn.k_proj" in conversion.layers
