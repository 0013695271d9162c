"""Packed 4-bit expert stacks: one contiguous buffer of packed bytes + absmax per projection, dequantized by one
bitsandbytes call (chunked past bitsandbytes' 32-bit element count).

bitsandbytes packs row-major, two elements per byte, one absmax per ``blocksize`` consecutive elements. So the
concatenation of per-expert packed bytes and absmax is the packed form of the stacked ``[E, rows, cols]`` tensor
whenever each expert's element count is a multiple of the blocksize (checked by the probe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


# Called with each restore step as it becomes due (the caller records it on its undo stack, e.g. ``undo.push``).
Record = Callable[[Callable[[], None]], None]


# The stock names every layout reads: the 3-D experts' weight stacks and biases (transformers 5.x), and the gated
# expert MLPs' projections as (gate, up, down) (transformers 4.x: act(gate(x)) * up(x) -> down).
STACK_NAMES = ("gate_up_proj", "down_proj")
BIAS_NAMES = ("gate_up_proj_bias", "down_proj_bias")
EXPERT_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# bitsandbytes' CUDA dequantize entry points take a C ``int n``: stay strictly below 2**31 elements per call.
MAX_ELEMENTS_PER_CALL = 2**31 - 1
NESTED_BLOCKSIZE = 256  # bitsandbytes' double quantization always uses 256-element absmax blocks


def state_tensors(qs) -> dict[str, torch.Tensor]:
    """Every tensor of a bitsandbytes ``QuantState`` by name: absmax, code; nested: offset, nested absmax and code."""
    found = {"absmax": qs.absmax, "code": qs.code}
    if qs.nested:
        found.update(offset=qs.offset, nested_absmax=qs.state2.absmax, nested_code=qs.state2.code)
    return {name: t for name, t in found.items() if isinstance(t, torch.Tensor)}


@dataclass
class NestedAbsmax:
    """Double-quantized absmax of a stack: uint8 codes ``[G, nb_pad]`` (each group padded to whole 256-blocks),
    the concatenated second-level fp32 absmax, the shared 8-bit code and one offset per group ``[G, 1]``."""

    codes: torch.Tensor
    absmax2: torch.Tensor
    code: torch.Tensor
    offsets: torch.Tensor
    per_group: int  # real (unpadded) absmax entries per group

    def decode(self) -> torch.Tensor:
        """fp32 absmax, exactly as bitsandbytes decodes each group (``dequantize_blockwise(...) + offset``)."""
        import bitsandbytes.functional as bnbf

        state2 = bnbf.QuantState(absmax=self.absmax2, code=self.code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        flat = bnbf.dequantize_blockwise(self.codes.reshape(-1), state2)
        return (flat.view(self.codes.shape[0], -1)[:, : self.per_group] + self.offsets).reshape(-1)


@dataclass
class PackedStack:
    """A frozen ``[E, rows, cols]`` weight stack in bitsandbytes 4-bit form."""

    data: torch.Tensor  # uint8, flat, E*rows*cols/2 bytes
    shape: tuple[int, int, int]
    blocksize: int
    quant_type: str
    absmax: torch.Tensor | None  # fp32 [E*rows*cols/blocksize] when not nested
    nested: NestedAbsmax | None = None

    @property
    def numel(self) -> int:
        e, r, c = self.shape
        return e * r * c

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a dequantize reads (all on one device, or a kernel reads foreign pointers)."""
        if self.nested is None:
            return [self.data, self.absmax]
        n = self.nested
        return [self.data, n.codes, n.absmax2, n.code, n.offsets]

    def absmax_fp32(self) -> torch.Tensor:
        return self.nested.decode() if self.nested is not None else self.absmax

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole stack in ``dtype``: one ``dequantize_4bit`` call, or one per chunk of experts past 2**31."""
        return dequantize_stack(self.data, self.absmax_fp32(), self.shape, self.blocksize, self.quant_type, dtype)


def dequantize_stack(
    data: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, int, int] | list[int],
    blocksize: int,
    quant_type: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A packed ``[E, rows, cols]`` stack (flat uint8 ``data``, fp32 ``absmax``) in ``dtype``, through bitsandbytes'
    own ``dequantize_4bit`` op: one call, or one per chunk of experts past bitsandbytes' 32-bit element count."""
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

    kernel = torch.ops.bitsandbytes.dequantize_4bit
    experts, rows, cols = (int(s) for s in shape)
    per_expert, bs = rows * cols, int(blocksize)
    step = max(1, MAX_ELEMENTS_PER_CALL // per_expert)
    # Shape (blocks, blocksize): every row is one whole block, which also sidesteps bitsandbytes' CPU kernel bug for
    # rows that are not a multiple of the blocksize; on CUDA the shape is only the element count.
    if step >= experts:
        n = experts * per_expert
        return kernel.default(data.view(-1, 1), absmax, bs, quant_type, [n // bs, bs], dtype).view(experts, rows, cols)
    out = torch.empty(experts, rows, cols, dtype=dtype, device=data.device)
    for first in range(0, experts, step):  # a handful of chunks, only for stacks past 2**31 elements
        last = min(experts, first + step)
        n, lo = (last - first) * per_expert, first * per_expert
        packed = data[lo // 2 : (lo + n) // 2].view(-1, 1)
        part = absmax[lo // bs : (lo + n) // bs]
        target = out[first:last].view(n // bs, bs)
        if data.device.type == "cuda":
            kernel.out(packed, part, bs, quant_type, [n // bs, bs], dtype, out=target)
        else:  # bitsandbytes registers no out= kernel on CPU
            target.copy_(kernel.default(packed, part, bs, quant_type, [n // bs, bs], dtype))
    return out


def _concat_nested(states: list, record: Record) -> NestedAbsmax:
    """Move each expert's uint8 absmax into one padded buffer and its second-level absmax into another; re-point
    every expert's quant state at its slice (bitwise the same values, no persistent extra memory)."""
    first = states[0]
    per_group = first.absmax.numel()
    padded = -(-per_group // NESTED_BLOCKSIZE) * NESTED_BLOCKSIZE
    codes = torch.zeros(len(states), padded, dtype=torch.uint8, device=first.absmax.device)
    codes[:, :per_group] = torch.stack([qs.absmax for qs in states])
    absmax2 = torch.cat([qs.state2.absmax.reshape(-1) for qs in states])
    offsets = torch.stack([torch.as_tensor(qs.offset, dtype=torch.float32).reshape(()) for qs in states]).view(-1, 1)
    per2 = first.state2.absmax.numel()
    for e, qs in enumerate(states):
        _repoint(record, qs, "absmax", codes[e, :per_group])
        _repoint(record, qs.state2, "absmax", absmax2[e * per2 : (e + 1) * per2])
    return NestedAbsmax(codes, absmax2, first.state2.code, offsets.to(first.absmax.device), per_group)


def _repoint(record: Record, obj: object, name: str, view: torch.Tensor) -> None:
    """Point ``obj.name`` at a view of a shared buffer; the recorded restore gives it a private copy again (the old
    tensor is not kept alive, so consolidation costs no memory while patched)."""
    setattr(obj, name, view)
    record(lambda: setattr(obj, name, getattr(obj, name).clone()))


def consolidate_linear4bit(linears: list, record: Record) -> PackedStack:
    """One contiguous stack from per-expert ``bnb.nn.Linear4bit`` modules; every expert's ``weight.data`` (and
    absmax) becomes a view into it, so the per-expert modules keep working for the stock loop. Each restore step
    (a private copy again) goes to ``record`` as soon as its change is made."""
    weights = [m.weight for m in linears]
    states = [w.quant_state for w in weights]
    rows, cols = (int(s) for s in states[0].shape)
    half = rows * cols // 2
    data = torch.cat([w.data.reshape(-1) for w in weights])
    for e, w in enumerate(weights):
        old_shape = w.data.shape
        w.data = data[e * half : (e + 1) * half].view(old_shape)
        record(lambda w=w: setattr(w, "data", w.data.clone()))
    if states[0].nested:
        absmax, nested = None, _concat_nested(states, record)
    else:
        nested = None
        absmax = torch.cat([qs.absmax.reshape(-1) for qs in states])
        per = states[0].absmax.numel()
        for e, qs in enumerate(states):
            _repoint(record, qs, "absmax", absmax[e * per : (e + 1) * per])
    first = states[0]
    return PackedStack(data, (len(linears), rows, cols), int(first.blocksize), first.quant_type, absmax, nested)


def stack_from_quant_state(packed: torch.Tensor, qs) -> PackedStack:
    """A view of one packed 3-D stack (``leantrain.quantize_experts_4bit`` / bitsandbytes' parametrization)."""
    experts, rows, cols = (int(s) for s in qs.shape)
    nested = None
    absmax = qs.absmax
    if qs.nested:
        per_group = qs.absmax.numel()
        padded = -(-per_group // NESTED_BLOCKSIZE) * NESTED_BLOCKSIZE
        codes = qs.absmax.reshape(1, -1)
        if padded != per_group:  # a single group: pad a copy of the (tiny) uint8 codes to whole 256-blocks
            codes = torch.nn.functional.pad(codes, (0, padded - per_group))
        offset = torch.as_tensor(qs.offset, dtype=torch.float32, device=qs.absmax.device).reshape(1, 1)
        nested, absmax = NestedAbsmax(codes, qs.state2.absmax, qs.state2.code, offset, per_group), None
    return PackedStack(packed.reshape(-1), (experts, rows, cols), int(qs.blocksize), qs.quant_type, absmax, nested)
