"""The fused 4-bit grouped GEMM (``leantrain.moe4bit._triton``) on CPU, through Triton's interpreter.

One subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported) runs every kernel call of this file
on tiny shapes and saves inputs and outputs; the tests compare them here against bitsandbytes' dequantize, torch's
``grouped_mm`` on the dequantized stack, an fp64 per-group loop and the default (``kernel="dequant"``) path.

Tolerances (the dequantized operand is bitwise the dequant path's, checked by the first test, so only the GEMM's
summation order differs):
- fp32 GEMM, per element: each of two fp32 dot products of length K is within ``K * u * sum_k |a_k b_k|`` of the
  exact value (u = eps/2, the classic recursive-summation bound, also for blocked/FMA orders), so the two differ by
  at most ``K * eps32 * (|a| @ |B|)``; each is within half of that of the fp64 loop.
- bf16 GEMM, per element: identical bf16 operands, fp32 accumulation (the fp32 bound above on the unrounded sums),
  then one rounding to bf16 each (monotone: at most one ulp apart beyond the sums' difference, and one ulp is at
  most ``eps_bf16 * |value|``): ``eps_bf16 * max(|ours|, |ref|) + K * eps32 * (|a| @ |B|)``; against the fp64
  loop half of each term (one rounding, one accumulation).
- whole layer (``grouped_forward``, relative Frobenius error): the GEMM differences above, passed through the gate
  and a second GEMM: fp32 ``256 * eps32`` (3e-5; observed differences ~1e-7, and any wrong expert, bias or weight
  is an O(1) error), bf16 ``4 * eps_bf16`` for outputs and twice that for gradients (a few bf16 roundings that
  may land on different sides; the GPU suite's bound).
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from tests._interpreter import assert_within, run_interpreted


pytest.importorskip("triton")
bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbf  # noqa: E402

from leantrain.moe4bit import _grouped, _triton  # noqa: E402
from leantrain.moe4bit._stacks import stack_from_quant_state  # noqa: E402


EPS32 = torch.finfo(torch.float32).eps
EPS_BF16 = torch.finfo(torch.bfloat16).eps
LAYER_REL = {torch.float32: 256 * EPS32, torch.bfloat16: 4 * EPS_BF16}
# The interpreter costs ~0.5 ms per tensor op per program: few, small programs. BLOCK_M 16 against groups of up to
# 40 rows (several M tiles per group, partial tiles, empty groups in between); GEMM tests: BLOCK_N 64 / BLOCK_K 32
# against 64..128 (several N tiles and K steps); whole-layer tests: one N tile, two K steps at most.
GEMM_TILES = "TileConfig(block_m=16, block_n=64, block_k=32)"  # the W^T cases use the gather lookup, W the tree
LAYER_TILES = "TileConfig(block_m=16, block_n=128, block_k=64, lookup='gather')"  # the default lookup
GROUP_SIZES = [0, 21, 3, 0, 40, 0]  # empty first and last groups, one group of 40 > BLOCK_M

_SCRIPT = textwrap.dedent(
    f"""
    import dataclasses, sys
    import torch
    import bitsandbytes.functional as bnbf
    from leantrain.moe4bit import _triton
    from leantrain.moe4bit._stacks import stack_from_quant_state, consolidate_linear4bit
    from tests._moe4bit_models import linear4bit_experts_from
    from leantrain.undo import Undo
    from tests.parity import test_moe4bit as parity

    def use_tiles(tiles):
        _triton.DEFAULT_TILES.update({{dt: tiles for dt in _triton.DEFAULT_TILES}})

    _triton.DEQUANT_BLOCK = 8192
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    saved = {{}}

    # (1) dequantize-only kernel, through stack_from_quant_state (3-D) and consolidated Linear4bit stacks
    torch.manual_seed(0)
    for qt in ("nf4", "fp4"):
        for nested in (False, True):
            for bs in (64, 128):
                w = torch.randn(3, 64, 128) * 0.3
                packed, qs = bnbf.quantize_4bit(w, blocksize=bs, quant_type=qt, compress_statistics=nested)
                stacks = {{"3d": stack_from_quant_state(packed, qs)}}
                if bs == 64:  # per-expert quant states (each with its own nested offset)
                    experts = parity.stock_experts("gpt_oss", 3)
                    lin = linear4bit_experts_from(experts, quant_type=qt, compress_statistics=nested)
                    stacks["linear4bit"] = consolidate_linear4bit(list(lin.down_projs), Undo().push)
                for kind, stack in stacks.items():
                    for dt in DTYPES:
                        ref = stack.dequantize(dt)
                        for lookup in ("tree", "gather"):
                            saved[("dequant", qt, nested, bs, kind, dt, lookup)] = (
                                _triton.dequantize_4bit(stack, dt, lookup), ref)

    # (2) grouped GEMM, both orientations: stack [E, 64, 128]
    use_tiles(_triton.{GEMM_TILES})
    sizes = torch.tensor({GROUP_SIZES})
    offs = sizes.cumsum(0).to(torch.int32)
    rows = int(sizes.sum())
    w = torch.randn(len(sizes), 64, 128)
    for qt, nested in (("nf4", True), ("fp4", False)):
        packed, qs = bnbf.quantize_4bit(w, blocksize=64, quant_type=qt, compress_statistics=nested)
        stack = stack_from_quant_state(packed, qs)
        for dt in (torch.float32, torch.bfloat16):
            for transpose in (False, True):
                a = torch.randn(rows, 128 if transpose else 64).to(dt)
                tiles = dataclasses.replace(_triton.{GEMM_TILES}, lookup="gather" if transpose else "tree")
                out = _triton.grouped_mm_4bit(a, stack, offs, transpose, tiles=tiles)
                saved[("gemm", qt, dt, transpose)] = (a, stack.dequantize(dt), offs, out)
        # a non-contiguous activation (a column slice): strides, not copies
        a = torch.randn(rows, 2 * 64)[:, ::2]
        saved[("gemm-strided", qt)] = (a, stack.dequantize(torch.float32), offs,
                                       _triton.grouped_mm_4bit(a, stack, offs, False))

    # (3) the whole grouped forward + backward: kernel="fused" vs kernel="dequant"
    use_tiles(_triton.{LAYER_TILES})
    CASES = [("linear4bit", "gpt_oss", True, torch.float32), ("stacked", "gpt_oss", False, torch.float32),
             ("stacked", "qwen3_moe", False, torch.float32), ("linear4bit", "gpt_oss", False, torch.bfloat16),
             ("stacked", "qwen3_moe", True, torch.bfloat16)]
    for layout, family, nested, dt in CASES:
        stock = parity.stock_experts(family, 6, dt)
        module = parity.four_bit(layout, stock, nested)
        plan, _ = parity.build_plan(parity.Found("experts", module, layout), Undo().push, True)
        x0, logits0 = parity.inputs(6)
        idx = parity.routing(6, 2)
        results = []
        for kernel in ("dequant", "fused"):
            p = dataclasses.replace(plan, kernel=kernel)
            fn = lambda x, i, r, p=p: parity._grouped.grouped_forward(p, x, i, r)
            # fresh leaves per run: parity.run's x0.to(dtype) is x0 itself in fp32, and its .grad would accumulate
            results.append(parity.run(fn, x0.clone(), logits0.clone(), idx, layout == "linear4bit", dt))
        saved[("layer", layout, family, nested, dt)] = results
    torch.save(saved, sys.argv[1])
    """
)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every interpreter result of this file, from one subprocess (interpreter start-up dominates)."""
    return run_interpreted(_SCRIPT, tmp_path_factory.mktemp("triton") / "results.pt")


def _items(results: dict, kind: str) -> list:
    found = [(key, value) for key, value in results.items() if key[0] == kind]
    assert found, f"no {kind} results"
    return found


def test_dequantize_kernel_bitwise_equals_bitsandbytes(interpreted):
    """nf4/fp4 x nested or not x blocksize 64/128 x fp32/bf16/fp16, 3-D and consolidated per-expert stacks, both code
    lookups (select tree, register gather): the GEMM's dequantize helper writes exactly bitsandbytes' values (so the
    GEMM multiplies the same operand)."""
    cases = _items(interpreted, "dequant")
    assert len(cases) == 2 * (2 * 2 * 2 * 3 + 2 * 2 * 3)  # x2: both code lookups
    for key, (ours, ref) in cases:
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, key
        assert torch.equal(ours, ref), f"{key}: max abs diff {(ours.float() - ref.float()).abs().max().item():.3g}"


def _groups(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _loop(a: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The per-group product in fp64 (exact up to fp64 rounding: the reference for both GEMMs)."""
    return torch.cat([a[lo:hi].double() @ weights[g].double() for g, (lo, hi) in enumerate(_groups(offs))])


def _operand(w: torch.Tensor, transpose: bool) -> torch.Tensor:
    return w.transpose(1, 2) if transpose else w


def _accumulation_bound(a: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``K * eps32 * (|a| @ |B_g|)`` per output element (see the module docstring)."""
    return a.shape[1] * EPS32 * _loop(a.abs(), weights.abs(), offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transpose", [False, True], ids=["W", "W^T"])
def test_grouped_gemm_matches_grouped_mm_and_loop(interpreted, dtype, transpose):
    """Groups 0/21/3/0/40/0 rows (empty first, middle and last; one larger than BLOCK_M): the fused GEMM vs
    ``grouped_mm`` on the dequantized stack and vs an fp64 per-group loop, within the summation bounds."""
    for qt in ("nf4", "fp4"):
        a, w, offs, out = interpreted[("gemm", qt, dtype, transpose)]
        b = _operand(w, transpose)
        assert out.dtype == dtype and out.shape == (a.shape[0], b.shape[2])
        ref = _grouped.grouped_mm(a, b, offs)
        acc = _accumulation_bound(a, b, offs)
        exact = _loop(a, b, offs)
        if dtype == torch.float32:
            assert_within(out, ref, acc, f"{qt} vs grouped_mm")
            assert_within(out, exact, acc / 2, f"{qt} vs fp64 loop")
        else:  # one bf16 rounding each: at most one ulp (<= eps * |value|) apart, plus the accumulation difference
            ulp = EPS_BF16 * torch.maximum(out.double().abs(), ref.double().abs())
            assert_within(out, ref, ulp + acc, f"{qt} vs grouped_mm")
            assert_within(out, exact, EPS_BF16 / 2 * out.double().abs() + acc / 2, f"{qt} vs fp64 loop")


def test_grouped_gemm_reads_strided_activations(interpreted):
    for qt in ("nf4", "fp4"):
        a, w, offs, out = interpreted[("gemm-strided", qt)]
        assert not a.is_contiguous()
        assert_within(out, _loop(a, w, offs), _accumulation_bound(a, w, offs) / 2, f"{qt} strided vs fp64 loop")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_grouped_forward_fused_matches_dequant_path(interpreted):
    """gpt-oss (clamp-SwiGLU, biases; both storage orientations: Linear4bit [E, out, in] and 3-D [E, in, out])
    and Qwen3-MoE (SiLU gate, Mixtral-like): output, hidden-state and router gradients of ``kernel="fused"``
    against the default path, fp32 and bf16, with an empty and a one-token expert (``parity.routing``)."""
    cases = _items(interpreted, "layer")
    assert len(cases) == 5
    for key, (dequant, fused) in cases:
        dtype = key[-1]
        for name, ours, ref, grads in zip(("output", "hidden grad", "router grad"), fused, dequant, (1, 2, 2)):
            assert ours.dtype == ref.dtype == dtype, (key, name)
            # two runs, two tensors (torch.save keeps aliasing: a shared .grad would compare equal to itself)
            assert ours.untyped_storage().data_ptr() != ref.untyped_storage().data_ptr(), (key, name)
            assert torch.isfinite(ours).all(), (key, name)
            bound = LAYER_REL[dtype] * (grads if dtype == torch.bfloat16 else 1)
            assert _rel(ours, ref) <= bound, f"{key} {name}: relative error {_rel(ours, ref):.3g} > {bound:.3g}"


# ------------------------------------------------------------------- offline CUDA compile (no GPU, no interpreter)


def _compile(kernel, types: dict[str, str], constexprs: dict, arch: int, **options):
    """Compile a kernel to a cubin for ``sm_<arch>`` with Triton's bundled LLVM + ptxas (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"enable_fp_fusion": _triton.FP_FUSION, **options}  # as the launcher passes it
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_for_cuda_offline(arch):
    """The interpreter runs the kernels as Python; this compiles them as a GPU would (Triton IR -> PTX -> cubin),
    bf16 with the default tiles: catches what only the compiler rejects, and checks that the GPU's fp32 -> bf16
    casts round to nearest even (``cvt.rn``), which the interpreter tests assume."""
    if _triton.INTERPRETED:
        pytest.skip("kernels were defined for the interpreter in this process")
    pytest.importorskip("triton.backends.nvidia")
    tiles = _triton.DEFAULT_TILES[torch.bfloat16]
    pointers = {"packed_ptr": "*u8", "absmax_ptr": "*fp32", "code_ptr": "*fp32", "offs_ptr": "*i32"}
    ints = {name: "i32" for name in ("N", "K", "stride_am", "stride_om")}
    gemms = [
        _compile(
            _triton.grouped_kernel,
            {**pointers, **ints, "a_ptr": "*bf16", "out_ptr": "*bf16", "expert_numel": "i64"},
            {"stride_ak": 1, "stride_on": 1, "E": 32, "E_POW2": 32, "LOG2_BLOCKSIZE": 6, "TRANSPOSED": transposed,
             "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "PRECISION": "tf32",
             "LOOKUP": lookup, "INTERPRETED": False},
            arch, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        for transposed in (False, True)
        for lookup in ("tree", "gather")
    ]  # fmt: skip
    flat = _compile(
        _triton.dequant_kernel,
        {**pointers, "out_ptr": "*bf16", "n_bytes": "i64"},
        {"LOG2_BLOCKSIZE": 6, "BLOCK": _triton.DEQUANT_BLOCK, "LOOKUP": "tree", "INTERPRETED": False},
        arch, num_warps=4,
    )  # fmt: skip
    for kernel in (*gemms, flat):
        ptx = kernel.asm["ptx"]
        assert "cvt.rn.bf16" in ptx and "cvt.rz.bf16" not in ptx
    assert all(gemm.asm["cubin"] for gemm in gemms)


# ----------------------------------------------------------------------------------- reasons (no interpreter)


def _stack(quant_type: str = "nf4", blocksize: int = 64):
    packed, qs = bnbf.quantize_4bit(torch.randn(2, 64, 64), blocksize=blocksize, quant_type=quant_type)
    return stack_from_quant_state(packed, qs)


def test_fused_reasons_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRETED", False)  # as imported in this process (no TRITON_INTERPRET)
    stack = _stack()
    reasons = _triton.fused_reasons(stack, torch.randn(4, 64))
    assert len(reasons) == 1 and "runs on CUDA tensors" in reasons[0]
    with pytest.raises(ValueError, match="runs on CUDA tensors"):  # the launcher refuses before any launch
        _triton.grouped_mm_4bit(torch.randn(4, 64), stack, torch.tensor([1, 4], dtype=torch.int32), False)
    monkeypatch.setattr(_triton, "INTERPRETED", True)
    assert _triton.fused_reasons(stack, torch.randn(4, 64)) == []


def test_fused_reasons_name_what_the_kernel_cannot_do(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRETED", True)  # device checks pass on CPU: only the listed problem is reported
    stack = _stack()
    a = torch.randn(4, 64)

    def only(reasons: list[str], needle: str) -> None:
        assert len(reasons) == 1 and needle in reasons[0], reasons

    only(_triton.fused_reasons(stack, a.double()), "bf16/fp16/fp32, not torch.float64")
    only(_triton.fused_reasons(stack, a[None]), "must be 2-D")
    only(_triton.fused_reasons(dataclasses.replace(stack, quant_type="int4"), a), "unknown 4-bit quant_type 'int4'")
    odd = _triton.fused_reasons(dataclasses.replace(stack, blocksize=48), a)  # also not whole blocks: 3 reasons
    assert any("blocksize 48 is not a power of two" in r for r in odd), odd
    only(_triton.fused_reasons(dataclasses.replace(stack, data=stack.data[:-1]), a), "uint8 bytes")
    # 2 experts of 96 elements: 3 whole 64-blocks in all, but expert 1 would start mid-block
    odd_experts = dataclasses.replace(stack, shape=(2, 8, 12), data=stack.data[:96], absmax=stack.absmax[:3])
    only(_triton.fused_reasons(odd_experts, torch.randn(4, 8)), "an expert's 8x12 elements are not a whole number")
    only(_triton.fused_reasons(dataclasses.replace(stack, absmax=stack.absmax[:-1]), a), "one fp32 scale per")
    only(_triton.fused_reasons(stack, a, torch.tensor([1, 4])), "offs must be int32 [2]")
    only(_triton.fused_reasons(stack, a, torch.tensor([1, 4], dtype=torch.int32, device="meta")), "one device")
    monkeypatch.setattr(_triton, "triton", None)
    only(_triton.fused_reasons(stack, a), "triton not installed")


def test_unknown_kernel_name_raises():
    with pytest.raises(ValueError, match="unknown experts kernel 'cutlass'"):
        _grouped.ExpertsPlan(2, 64, None, None, lambda h: h, False, kernel="cutlass")


def test_unknown_code_lookup_raises():
    with pytest.raises(ValueError, match="unknown code lookup 'table'"):
        _triton.TileConfig(lookup="table")
