"""The OSFT Triton GEMM (``leantrain.osft._triton``) and the Projector's Triton path on CPU, through Triton's
interpreter, plus an offline CUDA compile and the readiness reasons.

One subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported) runs every kernel call of this file
and saves inputs and outputs; the tests compare them here. The interpreter multiplies fp32 tiles with numpy in fp32
whatever ``input_precision`` says, so these tests check indexing, strides, batching, tables, split-K and alpha/beta
at fp32 accuracy; the tf32x3 arithmetic itself is checked on CUDA (``tests/gpu/test_osft_triton_cuda.py``).

Tolerances (u = eps32 / 2; fp64 references):
- GEMM, per element: an fp32 dot product of length K in any order (blocked, split-K then summed) is within
  ``K·u·(|a|@|b|)`` of the exact value; the epilogue ``beta·out + alpha·acc`` rounds once more (≤ u of its
  magnitude ≤ u·(|out| + |a|@|b|)): ``(K + 1)·u·(|a|@|b| + beta·|out|)``.
- Projection ``x′ = x − B(Bᵀx)`` (B: k_high columns, contraction n for the coefficient), per element, for one fp32
  implementation against the exact value: the coefficient's error ``≤ n·u·|B|ᵀ|x|`` carried through |B|, the
  update's own ``(k_high + 1)·u·(|B||C| + |x|)`` with |C| ≤ |B|ᵀ|x|: ``(n + k_high + 1)·u·(|B||B|ᵀ|x| + |x|)``;
  two implementations (Triton vs the fp32 reference) differ by at most twice that.
- Frozen-subspace residual ``Bᵀx′``: the exact projection leaves ``(I − BᵀB)Bᵀx`` (the basis' own orthogonality
  defect) plus ``|B|ᵀ`` times the per-element bound above.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests._interpreter import assert_within, run_interpreted


pytest.importorskip("triton")

from leantrain.osft import _triton  # noqa: E402


U32 = torch.finfo(torch.float32).eps / 2
# Small tiles for the GEMM cases (several tiles, partial edge tiles, several K steps per split); the Projector runs
# with the default tiles (one tile per member at these sizes: the interpreter costs ~0.5 ms per op per program).
GEMM_TILES = "TileConfig(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=2)"
# (m, n, k): none a multiple of the tiles (2 x 3 edge tiles, 5 K steps); then whole tiles (the unmasked branch)
GEMM_SHAPES = [(37, 45, 70), (64, 32, 96)]
LAYER_SHAPES = [(48, 40), (48, 40), (48, 40), (24, 40), (40, 24)]  # (out, in): one class of three, two singles

_SCRIPT = textwrap.dedent(
    f"""
    import copy, os, sys, tempfile
    import torch
    import torch.distributed as dist
    from torch import nn
    from leantrain.osft import _triton, Projector, OSFTLinear
    from leantrain.osft._triton import Operand, PointerTables, TileConfig

    saved = {{}}
    torch.manual_seed(0)
    tiles = {GEMM_TILES}

    def view(rows, cols, transposed):
        return torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)

    # (1) single GEMMs: every alpha/beta, plain and transposed views, with and without split-K
    for m, n, k in {GEMM_SHAPES}:
        for transposed in (False, True):
            for split in (1, 3):
                for alpha in (1.0, -1.0):
                    for beta in (0.0, 1.0):
                        a, b, out = view(m, k, transposed), view(k, n, transposed), view(m, n, transposed)
                        out0 = out.clone()
                        _triton.addmm(out, a, b, alpha=alpha, beta=beta, tiles=tiles, split_k=split)
                        saved[("gemm", m, n, k, transposed, split, alpha, beta)] = (a, b, out0, out)

    # (2) batched: members through address tables (transposed views of separate tensors) into a stacked output,
    # then an update through tables again, with split-K on the first
    xs = [torch.randn(70, 37) for _ in range(3)]
    ys = [torch.randn(70, 45) for _ in range(3)]
    tables = PointerTables()
    xt, yt = tables.get("x", xs), tables.get("y", ys)
    assert tables.get("x", xs) is xt  # unchanged addresses: the cached table
    c = torch.empty(3, 37, 45)
    _triton.addmm(Operand.stacked(c), Operand(xs[0].t(), 3, xt), Operand(ys[0], 3, yt), tiles=tiles, split_k=2)
    targets = [torch.randn(70, 45) for _ in range(3)]
    before = [t.clone() for t in targets]
    tt = tables.get("t", targets)
    _triton.addmm(Operand(targets[0], 3, tt), Operand(xs[0], 3, xt), Operand.stacked(c), alpha=-1.0, beta=1.0,
                  tiles=tiles)
    saved["batched"] = (xs, ys, c, before, targets)

    # (3) the Projector: Triton (batched per shape class) vs the fp32 reference, gradients and parameters
    def layers(seed):
        torch.manual_seed(seed)
        return [OSFTLinear.from_module(nn.Linear(m, n, bias=False), 0.5)[0] for n, m in {LAYER_SHAPES}]

    calls = []
    original = _triton.addmm
    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    _triton.addmm = counting

    for kind in ("gradients", "parameters"):
        ours = layers(1)
        torch.manual_seed(2)
        inputs = [(torch.randn_like(l.U_low), torch.randn_like(l.V_low)) for l in ours]
        ref = copy.deepcopy(ours)
        for group, kw in ((ours, dict(precision="tf32x3", kernel="triton")), (ref, dict(precision="fp32"))):
            for layer, (du, dv) in zip(group, inputs):
                if kind == "gradients":
                    layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
                else:
                    with torch.no_grad():
                        layer.U_low.copy_(du)
                        layer.V_low.copy_(dv)
            projector = Projector(group, **kw)
            calls.clear()
            (projector.project_gradients if kind == "gradients" else projector.project_parameters)()
            if kw["precision"] == "tf32x3":
                saved[("launches", kind)] = (len(calls), dict(projector.fallbacks))
        get = (lambda l: (l.U_low.grad, l.V_low.grad)) if kind == "gradients" else (
            lambda l: (l.U_low.detach(), l.V_low.detach()))
        saved[("projector", kind)] = [(l.U_high.detach(), l.V_high.detach(), du, dv, *get(l), *get(r))
                                      for l, r, (du, dv) in zip(ours, ref, inputs)]
    _triton.addmm = original

    # (4) sharded layouts, one rank (the DTensor paths: coefficients into the flat all-reduce buffer for Shard(1) V,
    # the V_high all-gather for Shard(0) V; U on Shard(0) in both), parameters projected
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from leantrain.osft import fully_shard
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), world_size=1, rank=0)
    mesh = init_device_mesh("cpu", (1,))
    for name, shard in (("shard1", fully_shard), ("shard0", torch_fully_shard)):
        group = layers(3)
        torch.manual_seed(4)
        with torch.no_grad():
            for l in group:
                l.U_low.copy_(torch.randn_like(l.U_low))
                l.V_low.copy_(torch.randn_like(l.V_low))
        plain = copy.deepcopy(group)
        before = [(l.U_low.detach().clone(), l.V_low.detach().clone()) for l in plain]
        holder = nn.Module()
        holder.layers = nn.ModuleList(group)
        shard(holder, mesh=mesh)
        projector = Projector(list(holder.layers), precision="tf32x3", kernel="triton")
        assert projector.uses_collectives()
        projector.project_parameters()
        Projector(plain, precision="fp32").project_parameters()
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
        saved[("sharded", name)] = (dict(projector.fallbacks), [
            (p.U_high.detach(), p.V_high.detach(), du, dv, full(l.U_low.detach()), full(l.V_low.detach()),
             p.U_low.detach(), p.V_low.detach())
            for l, p, (du, dv) in zip(holder.layers, plain, before)
        ])
    dist.destroy_process_group()
    torch.save(saved, sys.argv[1])
    """
)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every interpreter result of this file, from one subprocess (interpreter start-up dominates)."""
    return run_interpreted(_SCRIPT, tmp_path_factory.mktemp("triton") / "results.pt")


def _gemm_bound(a: torch.Tensor, b: torch.Tensor, out0: torch.Tensor, beta: float) -> torch.Tensor:
    k = a.shape[1]
    return (k + 1) * U32 * (a.double().abs() @ b.double().abs() + beta * out0.double().abs())


def test_gemm_matches_fp64_every_alpha_beta_layout_and_split(interpreted):
    cases = [(key, v) for key, v in interpreted.items() if key[0] == "gemm"]
    assert len(cases) == len(GEMM_SHAPES) * 2 * 2 * 2 * 2
    for key, (a, b, out0, out) in cases:
        *_, transposed, _split, alpha, beta = key
        assert out.is_contiguous() != transposed and a.is_contiguous() != transposed  # views, not copies
        exact = beta * out0.double() + alpha * (a.double() @ b.double())
        assert_within(out, exact, _gemm_bound(a, b, out0, beta), str(key))
        assert (out.double() - exact).abs().max() < 0.1 * exact.abs().max()  # the check can fail: O(1) errors


def test_batched_gemm_through_address_tables(interpreted):
    xs, ys, c, before, targets = interpreted["batched"]
    for i, (x, y, t0, t) in enumerate(zip(xs, ys, before, targets)):
        coeff = x.double().t() @ y.double()
        assert_within(c[i], coeff, _gemm_bound(x.t(), y, c[i], 0.0), f"coefficient {i}")
        # the update reads the rounded coefficient: its own bound, plus |x|·(coefficient error bound)
        exact = t0.double() - x.double() @ coeff
        carry = x.double().abs() @ _gemm_bound(x.t(), y, c[i], 0.0)
        assert_within(t, exact, _gemm_bound(x, c[i], t0, 1.0) + carry, f"update {i}")


def _projection_bounds(basis: torch.Tensor, x: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-element bound of one fp32 projection vs exact, bound of its frozen-subspace residual |Bᵀx′|), fp64;
    side 'v' is side 'u' transposed (B = V_highᵀ, x = dVᵀ)."""
    b, x = basis.double(), x.double()
    if side == "v":
        b, x = b.t(), x.t()
    n, k_high = b.shape
    reach = b.abs() @ (b.abs().t() @ x.abs()) + x.abs()
    elem = (n + k_high + 1) * U32 * reach
    eye = torch.eye(k_high, dtype=torch.float64)
    defect = (b.t() @ b - eye).abs().sum(1, keepdim=True)  # row sums of |I − BᵀB|
    residual = b.abs().t() @ elem + defect * (b.t() @ x).abs().max()
    return (elem, residual) if side == "u" else (elem.t(), residual.t())


def _frozen(basis: torch.Tensor, x: torch.Tensor, side: str) -> torch.Tensor:
    return basis.double().t() @ x.double() if side == "u" else x.double() @ basis.double().t()


def _check_projection(u_high, v_high, du, dv, got_u, got_v, ref_u, ref_v, what: str) -> None:
    for side, basis, x, got, ref in (("u", u_high, du, got_u, ref_u), ("v", v_high, dv, got_v, ref_v)):
        elem, residual = _projection_bounds(basis, x, side)
        assert_within(got, ref, 2 * elem, f"{what} {side}: Triton vs fp32 reference")
        left = _frozen(basis, got, side)
        assert_within(left, torch.zeros_like(left), residual, f"{what} {side}: frozen-subspace residual")
        assert _frozen(basis, x, side).abs().max() > 1e3 * left.abs().max()  # it removed a large component


@pytest.mark.parametrize("kind", ["gradients", "parameters"])
def test_projector_triton_path_matches_fp32_reference(interpreted, kind):
    launches, fallbacks = interpreted[("launches", kind)]
    assert fallbacks == {}
    # one launch per shape class and product: 3 classes x 2 sides x 2 products (5 layers unbatched would be 20)
    assert launches == 3 * 2 * 2
    for i, case in enumerate(interpreted[("projector", kind)]):
        _check_projection(*case, f"{kind} layer {i}")


@pytest.mark.parametrize("layout", ["shard1", "shard0"])
def test_projector_triton_path_in_sharded_layouts(interpreted, layout):
    """One-rank FSDP2: the all-reduce path (U Shard(0), V Shard(1)) and the V_high gather path (V Shard(0))."""
    fallbacks, cases = interpreted[("sharded", layout)]
    assert fallbacks == {}
    for i, (u_high, v_high, du, dv, got_u, got_v, ref_u, ref_v) in enumerate(cases):
        _check_projection(u_high, v_high, du, dv, got_u, got_v, ref_u, ref_v, f"{layout} layer {i}")


# ------------------------------------------------------------------- offline CUDA compile (no GPU, no interpreter)


def _compile(kernel, types: dict[str, str], constexprs: dict, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"enable_fp_fusion": _triton.FP_FUSION, **options}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("tiles", ["DEFAULT_TILES", "LARGE_TILES"])
def test_kernels_compile_for_sm90_with_tf32x3_on_tensor_cores(tiles):
    """Compiles as a GPU would (Triton IR → PTX → cubin) with both default tile sets, address tables and the three
    layouts the projection uses: every one lowers to Hopper wgmma, three TF32 MMAs per fp32 product (tf32x3)."""
    if _triton.INTERPRETED:
        pytest.skip("kernels were defined for the interpreter in this process")
    pytest.importorskip("triton.backends.nvidia")
    t = getattr(_triton, tiles)
    ints = ("M", "N", "K", "K_SPLIT", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")
    batch = {"batch_a": "i32", "batch_b": "i32", "batch_c": "i32"}
    layouts = {
        "u coefficient": {"stride_am": 1, "stride_bn": 1, "stride_cn": 1},
        "v coefficient": {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1},
        "update": {"stride_ak": 1, "stride_bn": 1, "stride_cn": 1},
    }
    counts = {}
    for name, ones in layouts.items():
        for precision in ("tf32x3", "tf32") if name == "update" else ("tf32x3",):
            types = {n: "i32" for n in ints if n not in ones} | batch
            types |= {"a_ptr": "*i64", "b_ptr": "*fp32", "c_ptr": "*i64", "ws_ptr": "*fp32"}
            constexprs = {
                **ones, "A_TABLE": True, "B_TABLE": False, "C_TABLE": True, "ALPHA": -1, "BETA": 1, "SPLIT_K": 1,
                "PRECISION": precision, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
                "GROUP_M": t.group_m, "EVEN_M": True, "EVEN_N": True, "EVEN_K": True,
            }  # fmt: skip
            kernel = _compile(_triton.addmm_kernel, types, constexprs, num_warps=t.num_warps, num_stages=t.num_stages)
            counts[name, precision] = kernel.asm["ptx"].count("wgmma.mma_async")
            assert kernel.asm["cubin"]
    assert counts["update", "tf32"] > 0, counts
    for name in layouts:  # same tiles, so the same MMA count per TF32 product: three products each
        assert counts[name, "tf32x3"] == 3 * counts["update", "tf32"], counts
    reduce = _compile(
        _triton.reduce_kernel,
        {"ws_ptr": "*fp32", "c_ptr": "*fp32", "M": "i32", "N": "i32", "stride_cm": "i32", "batch_c": "i32"},
        {"stride_cn": 1, "C_TABLE": False, "ALPHA": 1, "BETA": 0, "SPLIT_K": 4, "BLOCK": _triton.REDUCE_BLOCK},
        num_warps=4,
    )
    assert reduce.asm["cubin"]


# ----------------------------------------------------------------------------------- reasons (no interpreter)


def test_reasons_cpu_without_interpreter_and_projector_default_unchanged(monkeypatch):
    """On CPU without the interpreter the kernel refuses (before any launch), and a default Projector never asks
    for it there: the fp32 path runs bitwise as before; a refused job runs fp32 GEMMs, not the split."""
    from torch import nn

    from leantrain.osft import OSFTLinear, Projector

    monkeypatch.setattr(_triton, "INTERPRETED", False)
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    reasons = _triton.gemm_reasons(torch.empty(8, 6), a, b)
    assert len(reasons) == 1 and "runs on CUDA tensors" in reasons[0]
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        _triton.addmm(torch.empty(8, 6), a, b)
    torch.manual_seed(0)
    layer, _ = OSFTLinear.from_module(nn.Linear(40, 48, bias=False), 0.5)
    du, dv = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
    results = {}
    for kernel in ("auto", "triton"):
        layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
        # emulate: the split GEMMs would round their inputs here, so only the fp32 fallback is bitwise fp32
        projector = Projector([layer], precision="tf32x3", kernel=kernel, emulate=kernel == "triton")
        projector.project_gradients()
        results[kernel] = layer.U_low.grad.clone(), layer.V_low.grad.clone()
        # "auto" never asks off CUDA; "triton" asks, is refused with the reason, and runs fp32 GEMMs instead
        assert bool(projector.fallbacks) == (kernel == "triton"), projector.fallbacks
    layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
    Projector([layer], precision="tf32x3", kernel="split", emulate=True).project_gradients()
    assert not torch.equal(layer.U_low.grad, results["triton"][0])  # the control: the split differs from fp32
    layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
    Projector([layer], precision="fp32").project_gradients()
    for got in results.values():
        assert torch.equal(got[0], layer.U_low.grad) and torch.equal(got[1], layer.V_low.grad)
    with pytest.raises(ValueError, match="kernel must be one of"):
        Projector([layer], kernel="cutlass")


def test_default_tiles_follow_the_devices_shared_memory(monkeypatch):
    """The large tiles only where a block may take their shared memory (checked before any launch)."""
    large, small = _triton.LARGE_TILES, _triton.DEFAULT_TILES
    assert _triton.shared_memory(large) == 120 * 2**10 and _triton.shared_memory(small) == 96 * 2**10
    cuda = torch.device("cuda", 0)
    for optin, expected in ((227 * 2**10, large), (120 * 2**10, large), (99 * 2**10, small), (0, small)):
        monkeypatch.setattr(_triton, "_shared_memory_optin", lambda device, optin=optin: optin)
        assert _triton.default_tiles(cuda) == expected, optin
    monkeypatch.undo()
    assert _triton.default_tiles(torch.device("cpu")) == small  # the interpreter: no shared memory to size


def test_reasons_name_what_the_kernel_cannot_do(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRETED", True)  # device checks pass on CPU: only the listed problem is reported

    def only(reasons: list[str], needle: str) -> None:
        assert len(reasons) == 1 and needle in reasons[0], reasons

    a, b, out = torch.randn(8, 4), torch.randn(4, 6), torch.empty(8, 6)
    assert _triton.gemm_reasons(out, a, b) == [] and _triton.gemm_reasons(out.t(), b.t(), a.t()) == []
    only(_triton.gemm_reasons(out, a.double(), b), "fp32 only")
    only(_triton.gemm_reasons(out, a[None], b), "must be 2-D")
    only(_triton.gemm_reasons(out, a, torch.randn(5, 6)), "shapes do not chain")
    assert _triton.gemm_reasons(out, a, b.to("meta")) == []  # shape-only stand-ins do not count as a device
    only(_triton.gemm_reasons(torch.empty(1, 6).expand(8, 6), a, b), "zero stride")
    huge = torch.empty_strided((8, 4), (2**30, 1), device="meta")  # metadata only
    only(_triton.gemm_reasons(out, huge, b), "int32 offsets")
    # the projection pair: side u (basis N×k_high, target N×k_low), side v (basis k_high×M, target k_low×M)
    assert _triton.projection_reasons("u", torch.randn(10, 3), torch.randn(10, 4)) == []
    assert _triton.projection_reasons("v", torch.randn(3, 10), torch.randn(4, 10)) == []
    assert _triton.projection_reasons("v", torch.randn(3, 10), None) == []
    only(_triton.projection_reasons("u", torch.randn(10, 3), torch.randn(10, 4).double()), "fp32 only")
    only(_triton.projection_reasons("u", torch.randn(10, 3), torch.randn(9, 4)), "do not chain")
    only(_triton.projection_reasons("v", torch.randn(3, 10), torch.randn(1, 10).expand(4, 10)), "zero stride")
    monkeypatch.setattr(_triton, "triton", None)
    only(_triton.gemm_reasons(out, a, b), "triton not installed")
