"""The OSFT Triton GEMM (``leantrain.osft._triton``) on CUDA: tf32x3 in registers against fp64 and against one-pass
TF32, and the Projector's Triton path against the fp32 reference at 1B-Llama shapes (batched and per target),
the readiness fallback (fp32 GEMMs), no host syncs, and FSDP2's sharded layouts on one NCCL rank.

Run: ``python3 -m pytest -q -m gpu tests/gpu/test_osft_triton_cuda.py``. Import-safe without CUDA / triton (skips).

Tolerances (u = eps32 / 2, u_tf32 = 2^-11; fp64 references):
- GEMM, per element: tf32x3 forms each product from hi·hi + hi·lo + lo·hi (|lo| ≤ u_tf32·|x|): it drops lo·lo
  (≤ u_tf32²) and reads each tail rounded to TF32 (≤ u_tf32² each), so ≤ 3·u_tf32² = 12·u relative per product;
  accumulating K products in fp32 adds ≤ K·u, the epilogue one more u: ``((K + 1)·u + 3·u_tf32²)·(|a|@|b|)``.
  One-pass TF32 reads each operand rounded to TF32 (~u_tf32 relative): ~2^13 times larger; asserted ≥ 30x.
- Projection residual max|U_highᵀ dU′| / max|dU| (and the V analogue): the basis is orthonormal to fp32 rounding
  (fp64 QR, cast), so an exact projection leaves ~u·sqrt(n); the acceptance level of issue #14 is 1e-6, and the
  Triton path must stay within 2x of the fp32 cuBLAS reference's own residual (plus that level).
"""

from __future__ import annotations

import copy

import pytest
import torch


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from leantrain.osft import OSFTLinear, Projector, _triton  # noqa: E402


U32 = torch.finfo(torch.float32).eps / 2
U_TF32 = 2.0**-11
U_BF16 = 2.0**-8
SHAPES = [(2048, 2048), (5632, 2048)]  # (out, in) at k_high = k_low = 1024
RESIDUAL = 1e-6


def _orthonormal(n: int, r: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64, device=device))[0].float()


def _layer(n: int, m: int, seed: int, device: torch.device) -> OSFTLinear:
    g = torch.Generator(device=device).manual_seed(seed)
    r = min(n, m)
    k = r // 2
    u, v = _orthonormal(n, r, g, device), _orthonormal(m, r, g, device).t()
    layer = OSFTLinear(m, n, k, device=device, dtype=torch.float32)
    s = torch.linspace(2.0, 0.1, r, device=device)
    with torch.no_grad():
        for name, value in dict(U_high=u[:, :k], U_low=u[:, k:], V_high=v[:k], V_low=v[k:]).items():
            getattr(layer, name).copy_(value)
        layer.S_high.copy_(s[:k])
        layer.S_low.copy_(s[k:])
    return layer


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a.shape[1] + 1) * U32 + 3 * U_TF32**2) * (a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("split_k", [None, 1, 4], ids=["auto", "no-split", "split4"])
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (-1.0, 1.0)], ids=["coefficient", "update"])
def test_gemm_tf32x3_is_fp32_level_and_far_better_than_tf32(cuda, split_k, alpha, beta):
    """The u-side coefficient layout (both operands transposed views: U_highᵀ·dU, contraction 5632) and an
    update, against fp64; one-pass TF32 through the same kernel as the control."""
    g = torch.Generator(device=cuda).manual_seed(0)
    basis = torch.randn(5632, 1024, device=cuda, generator=g)
    target = torch.randn(5632, 1000, device=cuda, generator=g)  # 1000: not a multiple of the tiles
    out0 = torch.randn(1024, 1000, device=cuda, generator=g)
    a, b = basis.t(), target
    exact = beta * out0.double() + alpha * (a.double() @ b.double())
    errors = {}
    for precision in ("tf32x3", "tf32"):
        out = out0.clone()
        _triton.addmm(out, a, b, alpha=alpha, beta=beta, precision=precision, split_k=split_k)
        errors[precision] = (out.double() - exact).abs()
    bound = _bound(a, b) + U32 * out0.double().abs()
    worst = float((errors["tf32x3"] - bound).max())
    assert worst <= 0, f"tf32x3 error exceeds its bound by {worst:.3g}"
    assert float(errors["tf32"].max()) >= 30 * float(errors["tf32x3"].max()), {
        k: float(v.max()) for k, v in errors.items()
    }


def _grads(layers: list[OSFTLinear], g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(torch.randn(f.shape, device=f.device, generator=g) for f in (x.U_low, x.V_low)) for x in layers]


def _residual(layer: OSFTLinear, du: torch.Tensor, dv: torch.Tensor) -> float:
    u, v = layer.U_high.double(), layer.V_high.double()
    ru = (u.t() @ layer.U_low.grad.double()).abs().max() / du.abs().max()
    rv = (layer.V_low.grad.double() @ v.t()).abs().max() / dv.abs().max()
    return float(max(ru, rv))


def _project(layers, grads, projector: Projector | None = None, **kw) -> tuple[list[float], Projector]:
    projector = projector or Projector(layers, **kw)
    for layer, (du, dv) in zip(layers, grads):
        layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()  # fresh tensors: the tables must follow
    projector.project_gradients()
    return [_residual(layer, du, dv) for layer, (du, dv) in zip(layers, grads)], projector


def test_projector_triton_reaches_fp32_orthogonality_at_llama_shapes(cuda):
    """Two layers of each shape (one batched launch per shape class and product), Triton tf32x3 vs fp32 cuBLAS
    vs the cuBLAS split vs one-pass TF32; twice, with reallocated gradients the second time."""
    layers = [_layer(n, m, seed, cuda) for seed, (n, m) in enumerate(SHAPES * 2)]
    g = torch.Generator(device=cuda).manual_seed(1)
    grads = _grads(layers, g)
    fp32, _ = _project(layers, grads, precision="fp32")
    ref = [(x.U_low.grad.clone(), x.V_low.grad.clone()) for x in layers]
    tf32, _ = _project(layers, grads, precision="tf32")
    projector = Projector(layers, precision="tf32x3", kernel="triton")
    for _ in range(2):  # the same projector: its address tables must follow the new gradient tensors
        triton, _ = _project(layers, grads, projector)
    assert projector.fallbacks == {}
    split, _ = _project(layers, grads, precision="tf32x3", kernel="split")
    report = dict(fp32=max(fp32), tf32=max(tf32), triton=max(triton), split=max(split))
    assert max(triton) <= RESIDUAL and max(triton) <= 2 * max(fp32) + RESIDUAL / 10, report
    assert min(tf32) >= 10 * max(triton), report  # the control: one rounded pass leaves ~u_tf32
    _project(layers, grads, precision="tf32x3", kernel="triton")
    for layer, (ref_u, ref_v), (du, dv) in zip(layers, ref, grads):
        # the same projection as fp32 (relative to the input): both within ~u·(n + k) of the exact one
        assert float((layer.U_low.grad - ref_u).abs().max() / du.abs().max()) <= 1e-5
        assert float((layer.V_low.grad - ref_v).abs().max() / dv.abs().max()) <= 1e-5


def test_projector_triton_has_no_host_sync_after_first_call(cuda):
    layers = [_layer(1024, 1024, seed, cuda) for seed in range(3)]
    for layer in layers:
        layer.U_low.grad, layer.V_low.grad = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    projector = Projector(layers, precision="tf32x3", kernel="triton")
    projector.project_gradients()  # compiles, builds the address tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        projector.project_gradients()
        projector.project_parameters()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert projector.fallbacks == {}


def test_auto_follows_triton_by_default(cuda):
    from leantrain.osft import ops

    layer = _layer(256, 256, 0, cuda)
    wanted = ops._TritonGemm if ops.TRITON_BY_DEFAULT else ops._Gemm
    assert isinstance(Projector([layer], precision="tf32x3")._gemm(layer.U_low), wanted)


def test_readiness_fallback_runs_fp32_bitwise(cuda, monkeypatch):
    """A job the kernel refuses runs plain fp32 GEMMs (TF32 off around them), not the cuBLAS split."""
    layers = [_layer(1024, 512, seed, cuda) for seed in range(2)]
    g = torch.Generator(device=cuda).manual_seed(2)
    grads = _grads(layers, g)
    _project(layers, grads, precision="fp32")
    fp32 = [(x.U_low.grad.clone(), x.V_low.grad.clone()) for x in layers]
    _, projector = _project(layers, grads, precision="tf32x3", kernel="triton")
    assert projector.fallbacks == {}
    assert not all(torch.equal(x.U_low.grad, s[0]) for x, s in zip(layers, fp32))  # Triton really ran
    _project(layers, grads, precision="tf32x3", kernel="split")
    assert not all(torch.equal(x.U_low.grad, s[0]) for x, s in zip(layers, fp32))  # and so would the split
    monkeypatch.setattr(_triton, "projection_reasons", lambda *args: ["forced for the test"])
    _, projector = _project(layers, grads, precision="tf32x3", kernel="triton")
    assert projector.fallbacks == {"forced for the test": 2 * len(layers)}
    for layer, (fu, fv) in zip(layers, fp32):
        assert torch.equal(layer.U_low.grad, fu) and torch.equal(layer.V_low.grad, fv)


@pytest.fixture
def one_rank_nccl(tmp_path):
    """A one-process NCCL group: FSDP2's sharded layouts and their collectives on the GPU (world size 1)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["tf32x3", "bf16x3", "tf32"])
@pytest.mark.parametrize("layout", ["shard1", "shard0"])
def test_projector_under_fsdp2_on_cuda(cuda, one_rank_nccl, layout, precision):
    """FSDP2 on CUDA, one rank: U Shard(0) and V Shard(1) (``leantrain.osft.fully_shard``: coefficients into the
    flat all-reduce buffer) or V Shard(0) (torch's ``fully_shard``: V_high all-gathered), each reduced precision
    against the unsharded fp32 projection of the same parameters. tf32x3 must stay at fp32 level; the one-pass and
    bf16 split precisions leave their documented residual (tf32 ~u_tf32, bf16x3 ~1e-5) and no more."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from leantrain.osft import fully_shard

    layers = [_layer(n, m, seed, cuda) for seed, (n, m) in enumerate([(1024, 512), (512, 1024), (1024, 512)])]
    g = torch.Generator(device=cuda).manual_seed(3)
    with torch.no_grad():
        for layer in layers:  # parameters well off the subspace: the projection has something to remove
            layer.U_low.add_(torch.randn(layer.U_low.shape, device=cuda, generator=g))
            layer.V_low.add_(torch.randn(layer.V_low.shape, device=cuda, generator=g))
    before = [(x.U_low.detach().clone(), x.V_low.detach().clone()) for x in layers]
    plain = copy.deepcopy(layers)
    holder = nn.Module()
    holder.layers = nn.ModuleList(layers)
    (fully_shard if layout == "shard1" else torch_fully_shard)(holder, mesh=one_rank_nccl)
    projector = Projector(list(holder.layers), precision=precision)
    assert projector.uses_collectives()
    projector.project_parameters()
    Projector(plain, precision="fp32").project_parameters()
    assert projector.fallbacks == {}
    # one pass reads each operand rounded to TF32 (~u_tf32 each); bf16x3 drops the tails' own rounding (~u_bf16²)
    level = {"tf32x3": RESIDUAL, "bf16x3": 8 * U_BF16**2, "tf32": 8 * U_TF32}[precision]
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    for layer, ref, (u0, v0) in zip(holder.layers, plain, before):
        u, v = full(layer.U_low.detach()).double(), full(layer.V_low.detach()).double()
        u_high, v_high = ref.U_high.double(), ref.V_high.double()
        residual = max(
            float((u_high.t() @ u).abs().max() / u0.abs().max()), float((v @ v_high.t()).abs().max() / v0.abs().max())
        )
        assert residual <= level, (layout, precision, residual)
        assert float((u_high.t() @ u0.double()).abs().max() / u0.abs().max()) > 100 * residual  # it projected
        # the same projection as fp32 up to the precision's own level (relative to the input)
        assert float((u - ref.U_low.double()).abs().max() / u0.abs().max()) <= 10 * level
        assert float((v - ref.V_low.double()).abs().max() / v0.abs().max()) <= 10 * level
