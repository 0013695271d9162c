"""The compiled layer function and the pay-back arithmetic, in plain values (functions, numbers, strings).

The layer's forward is compiled as a private copy (``leantrain.compiling.private_copy``): every layer instance of one
model runs that one copy (Dynamo treats the layer's parameters as inputs, so one compiled entry serves all of them),
and it goes away with the patch."""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _triton


@dataclass(frozen=True)
class Payback:
    """Whether compiling pays for itself within a run: ``steps`` optimizer steps, each ``saving_ms`` faster, against
    ``compile_s`` seconds of compiling (the first step's extra time)."""

    steps: int
    saving_ms: float
    compile_s: float

    @property
    def break_even(self) -> int:
        """The step count from which the saving exceeds the compile time."""
        if self.saving_ms <= 0:
            return -1
        return int(self.compile_s * 1000.0 / self.saving_ms) + 1

    @property
    def pays(self) -> bool:
        return self.saving_ms > 0 and self.steps * self.saving_ms / 1000.0 > self.compile_s

    def sentence(self) -> str:
        if self.saving_ms <= 0:
            return "compiling measured no saving a step"
        return (
            f"{self.steps} steps x {self.saving_ms:.0f} ms saved = {self.steps * self.saving_ms / 1000.0:.1f} s "
            f"against {self.compile_s:.0f} s of compiling (pays back from step {self.break_even})"
        )


def checkpointing_inner(forward: Callable[..., Any]) -> Callable[..., Any] | None:
    """The layer's own forward when ``forward`` is transformers' ``forward_with_checkpointing`` (recent releases
    replace a ``GradientCheckpointingLayer`` subclass's ``forward`` with it, so the checkpoint runs inside
    ``forward``); None when ``forward`` is the layer's own (older releases checkpoint in ``__call__``)."""
    code = getattr(forward, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing" or "forward" not in code.co_freevars:
        return None
    return forward.__closure__[code.co_freevars.index("forward")].cell_contents


def with_inner(wrapper: types.FunctionType, inner: Callable[..., Any]) -> types.FunctionType:
    """A copy of the checkpointing ``wrapper`` that calls ``inner`` where it called the layer's own forward; its other
    free variables (the wrapper itself, for its outermost-wrapper check) are the original's cells."""
    code = wrapper.__code__
    cells = tuple(
        types.CellType(inner) if name == "forward" else cell
        for name, cell in zip(code.co_freevars, wrapper.__closure__, strict=True)
    )
    copy = types.FunctionType(code, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, cells)
    copy.__kwdefaults__ = wrapper.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = wrapper.__qualname__, wrapper.__doc__, wrapper.__module__
    return copy


def recomputing_elementwise(backend: Callable[..., Any]) -> Callable[..., Any]:
    """``backend`` partitioning each graph it compiles with torch's aggressive recomputation: the forward saves only
    what an elementwise op cannot rebuild (matmul, attention and reduction outputs); norms, activations and dtype
    casts are recomputed in the backward (where the default partition saves their outputs to spare that work). The
    switch is set while the graph compiles only (the partition is decided then), so the compiled code pays nothing
    per call and other compiles in the process keep torch's defaults."""

    def compile_graph(gm: Any, example_inputs: list[Any]) -> Any:
        with torch._functorch.config.patch(aggressive_recomputation=True):
            return backend(gm, example_inputs)

    return compile_graph


def power_of_two(value: Any) -> bool:
    """Multiplying by ``value`` is exact in floating point (barring overflow and subnormals): a power of two."""
    return isinstance(value, (int, float)) and value > 0 and math.frexp(value)[0] == 0.5


def lora_scaled_on_rank(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's LoRA ``Linear.forward`` with the adapter's scaling applied to ``lora_A``'s rank-r output instead of
    ``lora_B``'s full-width one: ``base(x) + B(A(x) * s)`` for PEFT's ``base(x) + B(A(x)) * s``, in 16-bit compute
    with the wide side as one GEMM (``one_gemm_side``, ``OneGemmLora``).

    With ``s`` a power of two both are the same bits, forward and backward (scaling by 2^k commutes with every
    rounding). What changes is the backward's memory: PEFT's form makes autograd (and inductor) build ``grad * s``,
    a scaled copy of the layer's full-width output gradient (at the MLP, tokens x intermediate), kept alongside the
    unscaled one while the two projections' backwards run; here the scaled tensor is rank-r. Any other state
    (several or disabled adapters, merged weights, DoRA and other variants, a LoRA bias, another scaling, extra
    arguments) runs PEFT's own forward."""
    name = rank_side_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    side = one_gemm_side(self, x)
    if side is None:
        return lora_two_gemms(self, x, name)
    return one_gemm(self, x, name, side)


def one_gemm(self: torch.nn.Module, x: torch.Tensor, name: Any, side: str) -> torch.Tensor:
    """``OneGemmLora`` on a LoRA linear's base weight (plain, or bitsandbytes 4-bit with its quant state)."""
    x_a = self.lora_dropout[name](x)
    weight = self.base_layer.weight
    quant_state = getattr(weight, "quant_state", None)
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    return OneGemmLora.apply(
        x, None if x_a is x else x_a, weight, quant_state, lora_a, lora_b, self.scaling[name], side
    )


def lora_two_gemms(self: torch.nn.Module, x: torch.Tensor, name: Any) -> torch.Tensor:
    """The rank-side forward as PEFT computes it: the base and the adapter as two GEMMs, summed (PEFT's bits)."""
    result = self.base_layer(x)
    lora_A = self.lora_A[name]
    # PEFT casts x to the adapter's dtype, which autocast's linear casts straight back: a 16-bit x in its autocast
    # dtype is then used as is (the same bits both ways), so every projection reading x saves x itself, not a copy
    device = x.device.type
    if not (torch.is_autocast_enabled(device) and x.dtype == torch.get_autocast_dtype(device)):
        x = self._cast_input_dtype(x, lora_A.weight.dtype)
    scaled = lora_A(self.lora_dropout[name](x)) * self.scaling[name]
    return (result + self.lora_B[name](scaled)).to(result.dtype)


HALF = (torch.bfloat16, torch.float16)


def one_gemm_side(module: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Where a LoRA linear's wide side can be one GEMM: ``"out"`` when its output is the wide side (the forward's
    base and adapter outputs as one product), ``"in"`` when its input is (the backward's two input gradients as one),
    None to keep PEFT's two GEMMs: square layers, a bias or hooks on the base linear, a trained base weight, or fp32
    compute (where the two GEMMs keep PEFT's bits exactly; the memory this saves matters in 16-bit training), and
    16-bit layers with fp32 adapters outside autocast (PEFT computes those adapters in fp32)."""
    base = module.base_layer
    if type(base) is not torch.nn.Linear and not is_4bit_linear(base):
        return None
    if base.bias is not None or base.weight.requires_grad:
        return None
    if base._forward_hooks or base._forward_pre_hooks or base.in_features == base.out_features:
        return None
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    else:  # without autocast PEFT runs the adapter in its own dtype (fp32 adapters: fp32 compute): keep that
        name = module.active_adapters[0]
        dtypes = {x.dtype, base.weight.dtype, module.lora_A[name].weight.dtype, module.lora_B[name].weight.dtype}
        dtype = x.dtype if len(dtypes) == 1 else None
    if dtype not in HALF:
        return None
    # bitsandbytes computes in its compute dtype (else the input's) and dequantizes to the weight's own dtype
    if is_4bit_linear(base) and not (base.compute_dtype or x.dtype) == base.weight.quant_state.dtype == dtype:
        return None
    return "out" if base.out_features > base.in_features else "in"


def is_4bit_linear(module: torch.nn.Module) -> bool:
    """bitsandbytes' ``Linear4bit`` (by name: bitsandbytes is not imported here) with its weight's quant state."""
    return type(module).__name__ == "Linear4bit" and getattr(module.weight, "quant_state", None) is not None


def dense_weight(weight: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:
    """The base weight in ``dtype``: dequantized from 4 bits when ``quant_state`` is given (bitsandbytes' own
    dequantize, as its 4-bit matmul's backward does)."""
    if quant_state is None:
        return weight.to(dtype)
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.dequantize_4bit(weight, quant_state).to(dtype)


class OneGemmLora(torch.autograd.Function):
    """``x W^T + s (x_a A^T) B^T`` with no full-width temporary beside the result (``x_a``: the dropped-out input of
    the adapter, None when it is ``x``; ``s``: the scaling, applied on the rank-r side).

    The two GEMMs PEFT runs leave a tokens x wide-side product beside the base one until they are summed: at a
    Llama MLP, the up/gate adapter outputs in the forward and down's adapter input gradient in the backward, each as
    large as the activation itself. Concatenating along the shared dimension (r columns more) makes each one GEMM:
    ``side="out"``: ``[x, s x_a A^T] @ [W, B]^T``; ``side="in"``: ``dx = [dy, s dy B] @ [W; A]``. The other
    direction keeps PEFT's ops, so its results are PEFT's bits; the concatenated one rounds once where PEFT rounds
    the two products and their sum (within one 16-bit ulp of the result's terms). The weights' copies (r rows or
    columns more) cost a few percent of one GEMM's traffic, against the full-width temporary they spare.
    Adapter gradients come back in the adapters' dtype, computed as autocast's linear computes them (16-bit GEMM,
    then cast); the base weight is frozen (``one_gemm_side`` checks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_a: torch.Tensor | None, weight: torch.Tensor, quant_state: Any,
                lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, side: str) -> torch.Tensor:  # fmt: skip
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x16 = x.to(dtype)
        x_a16 = x16 if x_a is None else x_a.to(dtype)
        w, a, b = dense_weight(weight, quant_state, dtype), lora_a.to(dtype), lora_b.to(dtype)
        scaled = torch.nn.functional.linear(x_a16, a) * scale
        if side == "out":
            out = torch.nn.functional.linear(torch.cat([x16, scaled], -1), torch.cat([w, b], -1))
        else:
            out = torch.nn.functional.linear(x16, w) + torch.nn.functional.linear(scaled, b)
        ctx.save_for_backward(x_a16, scaled, weight, lora_a, lora_b)
        ctx.scale, ctx.side, ctx.shared, ctx.quant_state = scale, side, x_a is None, quant_state
        ctx.x_dtype, ctx.x_a_dtype = x.dtype, None if x_a is None else x_a.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_a16, scaled, weight, lora_a, lora_b = ctx.saved_tensors
        dtype = scaled.dtype
        grad = grad.to(dtype)
        # a 4-bit weight is dequantized again, from a flat view of its packed bytes: a different graph node from the
        # forward's dequantize, so common-subexpression elimination cannot merge the two into one 16-bit weight kept
        # for the backward (inductor's partitioner may still keep it: compile_layers.md gives the measured saves)
        packed = weight if ctx.quant_state is None else weight.view(-1)
        w, a, b = dense_weight(packed, ctx.quant_state, dtype), lora_a.to(dtype), lora_b.to(dtype)
        grad_scaled = grad @ b
        grad_a_out = grad_scaled * ctx.scale
        rows = grad.reshape(-1, grad.shape[-1])
        grad_b = (rows.t() @ scaled.reshape(-1, scaled.shape[-1])).to(lora_b.dtype)
        grad_a = grad_a_out.reshape(-1, grad_a_out.shape[-1]).t() @ x_a16.reshape(-1, x_a16.shape[-1])
        grad_a = grad_a.to(lora_a.dtype)
        if ctx.side == "in" and ctx.shared:
            grad_x = (torch.cat([grad, grad_a_out], -1) @ torch.cat([w, a], 0)).to(ctx.x_dtype)
            return grad_x, None, None, None, grad_a, grad_b, None, None
        # each input gradient in its input's dtype before they add up, as autograd sums the two paths'
        grad_x = (grad @ w).to(ctx.x_dtype)
        grad_x_a = (grad_a_out @ a).to(ctx.x_dtype if ctx.shared else ctx.x_a_dtype)
        if ctx.shared:
            return grad_x + grad_x_a, None, None, None, grad_a, grad_b, None, None
        return grad_x, grad_x_a, None, None, grad_a, grad_b, None, None


def lora4bit_scaled_on_rank(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``lora_scaled_on_rank`` for PEFT's bitsandbytes ``Linear4bit`` (QLoRA), whose forward clones the 4-bit base
    output and casts the LoRA input and output only outside autocast: the same steps, the scaling on the rank-r
    side."""
    name = rank_side_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    side = one_gemm_side(self, x)
    if side is not None:
        return one_gemm(self, x, name, side)
    result = self.base_layer(x).clone()  # as PEFT: backprop through a view of the 4-bit output can fail
    lora_A = self.lora_A[name]
    convert = not torch.is_autocast_enabled()
    if convert:
        x = self._cast_input_dtype(x, lora_A.weight.dtype)
    output = self.lora_B[name](lora_A(self.lora_dropout[name](x)) * self.scaling[name])
    return result + (output.to(result.dtype) if convert else output)


def rank_side_adapter(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The adapter a rank-side forward serves for this call (the one active adapter, when ``scaling_folds``), or
    None: PEFT's own forward serves the call."""
    active = module.active_adapters
    name = active[0] if len(active) == 1 else None
    if args or kwargs or module.disable_adapters or module.merged or not scaling_folds(module, name):
        return None
    return name


def scaling_folds(module: torch.nn.Module, name: Any) -> bool:
    """Adapter ``name`` of a PEFT LoRA linear is vanilla LoRA (no DoRA or other variant, no LoRA bias) with a
    power-of-two scaling: ``lora_scaled_on_rank`` serves it with the same bits."""
    return (
        name in module.lora_A
        and name not in getattr(module, "lora_variant", {})
        and not getattr(module, "use_dora", {}).get(name, False)
        and module.lora_B[name].bias is None
        and power_of_two(module.scaling[name])
    )


# the stock gated MLPs: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU ``act_fn``
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU = frozenset({"SiLU", "SiLUActivation"})
MLP_MIN_ROWS = 1024  # rows per chunk at least: fewer launches where the full-width buffers are small anyway


def mlp_min_rows(chunks: int, tokens_per_micro_batch: int | None) -> int:
    """The rows (tokens) from which a micro-batch takes the chunked MLP backward: half the most the trainer can build
    (batch x max_length), where it says; else 0, every micro-batch. A run's peak is set by its largest micro-batches
    (with varying lengths, the few longest ones): the chunks lower it there, and elsewhere they would only add their
    host work (on padding-free Llama-3.2-1B, an H200: +12.7% a step, chunking every micro-batch)."""
    if chunks <= 0 or not tokens_per_micro_batch:
        return 0
    return tokens_per_micro_batch // 2


def is_gated_lora_mlp(module: torch.nn.Module) -> bool:
    """A stock SiLU-gated MLP whose three projections are PEFT LoRA linears on plain ``nn.Linear`` bases."""
    if type(module).__name__ not in GATED_MLPS or type(getattr(module, "act_fn", None)).__name__ not in SILU:
        return False
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return all(type(p).__name__ == "Linear" and type(getattr(p, "base_layer", None)) is torch.nn.Linear
               for p in projections)  # fmt: skip


def gated_lora_mlp(self: torch.nn.Module, x: torch.Tensor, chunks: int = 4, min_rows: int = 0) -> torch.Tensor:
    """The MLP's forward as ``GatedLoraMlp`` (its backward in ``chunks`` row chunks) for a micro-batch of at least
    ``min_rows`` rows whose three LoRA projections take the one-GEMM path (one active vanilla adapter of
    power-of-two scaling without dropout on each; gate and up wide at the output, down at the input; no hooks on the
    projections or the activation), else the stock forward (whose projections run ``lora_scaled_on_rank``). Under
    the compiler the row count is a guard: a run of both sizes holds one more graph."""
    if math.prod(x.shape[:-1]) < min_rows:
        return type(self).forward(self, x)
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    names = {rank_side_adapter(p, (), {}) for p in (gate, up, down)}
    name = names.pop() if len(names) == 1 else None
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (gate, up, down, self.act_fn))
    if name is None or hooked or not all(type(p.lora_dropout[name]) is torch.nn.Identity for p in (gate, up, down)):
        return type(self).forward(self, x)
    if (one_gemm_side(gate, x), one_gemm_side(up, x), one_gemm_side(down, x)) != ("out", "out", "in"):
        return type(self).forward(self, x)
    projections = (gate, up, down)
    weights = [t for p in projections for t in (p.base_layer.weight, p.lora_A[name].weight, p.lora_B[name].weight)]
    scales = [float(p.scaling[name]) for p in projections]
    return GatedLoraMlp.apply(x, scales, chunks, *weights)


class GatedLoraMlp(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))`` with the three projections as ``OneGemmLora`` computes them (the forward's
    very ops: the same bits), and a backward that runs over row chunks (``lora_mlp_backward``).

    Autograd's backward of the three projections holds four tokens x intermediate buffers at once: the saved gate
    and up outputs, the gradient of their product and one of the gradients of gate or up; and the forward saves the
    product itself for down's adapter. Unsloth's fused LoRA MLP holds three (its kernel overwrites the saved
    outputs). Here the forward saves gate and up only, and the backward builds the rest a chunk of rows at a time:
    two full-width buffers plus two chunk-sized ones. The input gradient's rows are computed as autograd computes
    them, up to the order of the rounded additions; the adapters' gradients that sum over full-width rows are summed
    over the chunks in fp32, each chunk's GEMM rounded to the compute dtype (one chunk: autograd's ops)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scales: list[float], chunks: int, *weights: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x16 = x.to(dtype)
        w_g, a_g, b_g, w_u, a_u, b_u, w_d, a_d, b_d = (t.to(dtype) for t in weights)
        s_g, s_u, s_d = scales
        scaled_g = torch.nn.functional.linear(x16, a_g) * s_g
        gate = torch.nn.functional.linear(torch.cat([x16, scaled_g], -1), torch.cat([w_g, b_g], -1))
        scaled_u = torch.nn.functional.linear(x16, a_u) * s_u
        up = torch.nn.functional.linear(torch.cat([x16, scaled_u], -1), torch.cat([w_u, b_u], -1))
        h = torch.nn.functional.silu(gate) * up
        scaled_d = torch.nn.functional.linear(h, a_d) * s_d
        out = torch.nn.functional.linear(h, w_d) + torch.nn.functional.linear(scaled_d, b_d)
        ctx.save_for_backward(x16, gate, up, scaled_g, scaled_u, scaled_d, *weights)
        ctx.scales, ctx.chunks, ctx.x_dtype = scales, chunks, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x16, gate, up, scaled_g, scaled_u, scaled_d, *weights = ctx.saved_tensors
        dtype = gate.dtype
        grads = lora_mlp_backward(
            grad.to(dtype), x16, gate, up, scaled_g, scaled_u, scaled_d, [t.to(dtype) for t in weights], ctx.scales,
            ctx.chunks, MLP_MIN_ROWS,
        )  # fmt: skip
        grad_x, adapter_grads = grads[0], grads[1:]
        adapters = [t for i, t in enumerate(weights) if i % 3]  # A and B of gate, up, down (the W are frozen)
        a_g, b_g, a_u, b_u, a_d, b_d = (g.to(a.dtype) for g, a in zip(adapter_grads, adapters, strict=True))
        return grad_x.to(ctx.x_dtype), None, None, None, a_g, b_g, None, a_u, b_u, None, a_d, b_d


@torch.library.custom_op("leantrain::lora_mlp_backward", mutates_args=())
def lora_mlp_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    scaled_g: torch.Tensor,
    scaled_u: torch.Tensor,
    scaled_d: torch.Tensor,
    weights: list[torch.Tensor],
    scales: list[float],
    chunks: int,
    min_rows: int,
) -> list[torch.Tensor]:
    """The gradients of ``GatedLoraMlp`` (16-bit operands; ``weights``: W, A, B of gate, up and down): the input's
    (in the compute dtype) and the six adapter weights' (fp32 where summed over chunks). What is full width
    (tokens x intermediate) is built ``chunks`` chunks of at least ``min_rows`` rows at a time; what is hidden or
    rank wide, over all rows at once. An op of its own so that inductor runs it as one call: traced, its chunks
    would be scheduled (and fused) together, and their buffers alive together.

    The loop is the op's host cost (the layer's backward is issued about as fast as the GPU runs it), so each chunk
    is nine launches: one buffer of [gate gradient | up gradient] rows (the second half first holds ``silu(g) u``)
    lets one GEMM take both rank-side products and one the gradients of both B; each chunk's product that sums over
    rows goes to its own slot, summed over the slots in fp32 once."""
    w_g, a_g, b_g, w_u, a_u, b_u, w_d, a_d, b_d = weights
    s_g, s_u, s_d = scales
    rows = x.reshape(-1, x.shape[-1])
    n, width, r_g = rows.shape[0], gate.shape[-1], b_g.shape[1]
    grad, gate, up = (t.reshape(n, t.shape[-1]).contiguous() for t in (grad, gate, up))
    scaled_gu = torch.cat([scaled_g.reshape(n, -1), scaled_u.reshape(n, -1)], -1)
    # B * s is exact (s a power of two), so (g @ (B s)) is (g @ B) * s bit for bit, in one launch; gate's and up's
    # on the diagonal of one matrix (the zeros add exact zeros)
    b_gu = grad.new_zeros(2 * width, scaled_gu.shape[1])
    torch.mul(b_g, s_g, out=b_gu[:width, :r_g])
    torch.mul(b_u, s_u, out=b_gu[width:, r_g:])
    grad_scaled_d = grad @ (b_d * s_d)
    grad_b_d = grad.t() @ scaled_d.reshape(n, -1)
    grad_scaled_gu = torch.empty_like(scaled_gu)
    grad_x = torch.empty_like(rows)
    step = max(min_rows, -(-n // max(chunks, 1)), 1)
    slots = -(-n // step)
    down_a = grad.new_empty(slots, a_d.shape[0], width)
    gate_up_b = grad.new_empty(slots, 2 * width, scaled_gu.shape[1])
    pair = grad.new_empty(min(step, n), 2 * width)
    for slot, start in enumerate(range(0, n, step)):
        stop = min(start + step, n)
        both = pair[: stop - start]
        grad_g, h_then_grad_u = both[:, :width], both[:, width:]
        g, u, dy, dy_scaled = gate[start:stop], up[start:stop], grad[start:stop], grad_scaled_d[start:stop]
        silu_mul(g, u, h_then_grad_u)
        torch.mm(dy_scaled.t(), h_then_grad_u, out=down_a[slot])  # down's A
        torch.mm(dy, w_d, out=grad_g).addmm_(dy_scaled, a_d)  # d(silu(g) u), then gate's gradient
        silu_mul_backward_(grad_g, g, u, h_then_grad_u)
        torch.mm(both, b_gu, out=grad_scaled_gu[start:stop])
        torch.mm(both.t(), scaled_gu[start:stop], out=gate_up_b[slot])  # gate's and up's B on the diagonal
        torch.mm(grad_g, w_g, out=grad_x[start:stop]).addmm_(h_then_grad_u, w_u)
    grad_x.addmm_(grad_scaled_gu, torch.cat([a_g, a_u], 0))
    grad_a_g, grad_a_u = grad_scaled_gu[:, :r_g].t() @ rows, grad_scaled_gu[:, r_g:].t() @ rows
    fp32 = torch.float32
    grad_b_g = torch.sum(gate_up_b[:, :width, :r_g], 0, dtype=fp32)
    grad_b_u = torch.sum(gate_up_b[:, width:, r_g:], 0, dtype=fp32)
    grad_a_d = torch.sum(down_a, 0, dtype=fp32)
    return [grad_x.reshape(x.shape), grad_a_g, grad_b_g, grad_a_u, grad_b_u, grad_a_d, grad_b_d]


@lora_mlp_backward.register_fake
def _lora_mlp_backward_fake(grad, x, gate, up, scaled_g, scaled_u, scaled_d, weights, scales, chunks, min_rows):
    w_g, a_g, b_g, w_u, a_u, b_u, w_d, a_d, b_d = weights
    fp32 = torch.float32
    return [torch.empty_like(x), a_g.new_empty(a_g.shape), b_g.new_empty(b_g.shape, dtype=fp32),
            a_u.new_empty(a_u.shape), b_u.new_empty(b_u.shape, dtype=fp32), a_d.new_empty(a_d.shape, dtype=fp32),
            b_d.new_empty(b_d.shape)]  # fmt: skip


def silu_mul(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(g) * u`` computed in fp32, rounded once (Triton on CUDA, torch ops elsewhere). ``g`` and ``u``
    contiguous rows; ``out``'s rows may be strided (a column slice of a wider buffer)."""
    if g.is_cuda and _triton.triton is not None:
        _triton.silu_mul(g, u, out)
        return
    out.copy_(torch.nn.functional.silu(g.float()) * u.float())


def silu_mul_backward_(grad_h: torch.Tensor, g: torch.Tensor, u: torch.Tensor, grad_u: torch.Tensor) -> None:
    """The gradients of ``silu(g) * u`` (fp32 compute): ``u``'s into ``grad_u``, ``g``'s written over ``grad_h``.
    ``g`` and ``u`` contiguous rows; ``grad_h`` and ``grad_u`` rows of the same stride (may be strided)."""
    if g.is_cuda and _triton.triton is not None:
        _triton.silu_mul_backward_(grad_h, g, u, grad_u)
        return
    g32, dh = g.float(), grad_h.float()
    sig = torch.sigmoid(g32)
    grad_u.copy_(dh * (g32 * sig))
    grad_h.copy_(dh * u.float() * (sig * (1 + g32 * (1 - sig))))
