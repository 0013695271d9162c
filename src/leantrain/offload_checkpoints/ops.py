"""Checkpointed layer inputs in host memory: the saved-tensor hooks and the host budget, in plain values.

Activation checkpointing keeps one tensor per checkpointed layer through the forward: the layer's input, which the
backward feeds to the recompute. Both of torch's checkpoint modes save it as a saved tensor *outside* the checkpoint's
own hooks (the non-reentrant mode's saved inputs, the reentrant mode's ``save_for_backward``), so saved-tensor hooks
entered around the checkpoint call see exactly those inputs and nothing of the layer's inside.

:class:`HostOffload` is that pair of hooks. On CUDA the pack copies the input to pinned host memory on a side stream
(the compute stream goes on; the allocator keeps the device block until the copy ends), and keeps the device tensor of
the most recent input until the next one is packed: the last layer's input is the first the backward needs, so it
never waits for a copy back. The unpack of one input starts the copy back of the input packed before it (the next the
backward needs) on the side stream, so each copy hides under a layer's recompute and backward. Host memory is bounded:
an input past the budget stays on the device (stock checkpointing for that layer) and is counted. On the host itself
(a model on CPU) the pack keeps a copy, which is how the mechanism is tested without a GPU.

Where the host issues the step about as fast as the GPU runs it, the hooks' own host work is the offload's cost, so
each layer makes only the CUDA calls that queue work (:class:`SideStream`): no stream context manager, no new
``Stream`` or ``Event`` object per call; and the pinned host buffers are the hooks' own (:class:`PinnedPool`), reused
across layers and steps whatever the lengths, each with the typed view its last input had."""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


GIB = 1024**3
# The current stream's raw handle, without building a ``Stream`` object (the call inductor's generated code makes);
# absent from builds without CUDA.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass
class OffloadStats:
    """What the hooks did (read live from ``leantrain.offload_checkpoints.stats(trainer)``).

    ``packed``/``packed_bytes``: inputs moved to host memory since the start; ``kept``: inputs left on the device
    because the host budget was full; ``leaves``: inputs left on the device because autograd holds them until the
    backward ends whatever the hooks do (a leaf that requires grad, see ``HostOffload.pack``); ``live_bytes``: host
    bytes held now (freed as the backward unpacks and drops them); ``peak_bytes``: the most host bytes held at once
    (a step's checkpointed inputs)."""

    packed: int = 0
    packed_bytes: int = 0
    kept: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    leaves: int = 0  # inputs left on the device because their AccumulateGrad node holds them anyway
    short: int = 0  # inputs left on the device because their micro-batch had fewer tokens than ``min_tokens``
    sunk: int = 0  # embedding outputs handed to the first layer without the gradient only PEFT's hook asked for
    pinned_bytes: int = 0  # pinned host memory the hooks hold now, buffers in use and free (CUDA; within the budget)
    fetched_ahead: int = 0  # unpacks served by a copy started one layer ahead (CUDA)
    waited: int = 0  # unpacks that had to start their own copy back (CUDA)
    failures: list[str] = field(default_factory=list)

    def hold(self, nbytes: int) -> None:
        self.packed += 1
        self.packed_bytes += nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


class Offloaded:
    """One checkpointed input in host memory, and what the backward needs to bring it back."""

    __slots__ = (
        "__weakref__", "buffer", "device", "device_copy", "fetched", "host", "lane", "nbytes", "pool", "previous",
        "stats",
    )  # fmt: skip

    def __init__(
        self, host: torch.Tensor, nbytes: int, device: torch.device, stats: OffloadStats, previous: Any
    ) -> None:
        self.host = host
        self.buffer: torch.Tensor | None = None  # the pool's buffer ``host`` views (CUDA), given back at the end
        self.pool: PinnedPool | None = None
        self.device = device
        self.nbytes = nbytes
        self.stats = stats
        self.previous = previous  # weakref to the input packed before this one (the next the backward needs)
        self.device_copy: torch.Tensor | None = None  # the original, kept while this is the newest input (CUDA)
        self.fetched: torch.Tensor | None = None  # a copy back started ahead of the unpack
        self.lane: SideStream | None = None  # the side stream that copy runs on
        stats.hold(self.nbytes)

    def __del__(self) -> None:
        # A copy back that no unpack waited for (the graph dropped before its backward): the copy may still be
        # writing, so the block must not go back to the compute stream's pool before it ends. A copy that was
        # waited for needs nothing: every later use of the block is queued after that wait.
        if self.fetched is not None and self.lane is not None:
            self.fetched.record_stream(self.lane.stream)
        if self.pool is not None and self.buffer is not None:
            self.pool.give(self.buffer, self.device.index)
        self.stats.release(self.nbytes)


class PinnedPool:
    """The pinned host buffers the moved inputs live in, kept and reused (CUDA).

    Every copy into or out of one device's buffers runs on that device's one side stream, so a buffer handed out
    again is written only after its earlier copies have run, in stream order: reuse needs no event. A request takes
    the smallest free buffer that holds it, so the varying lengths of padding-free batches reuse the buffers an
    earlier, longer step left: torch's caching host allocator keeps a free list per power-of-two size, and each step
    whose inputs first reach a new size pinned a new block for every layer (measured: a 0.86 s step among 0.2 s
    ones). New buffers are a power of two (few sizes over a run). ``held_bytes``, free and in use, stays within
    ``budget_bytes``: a request that would pass it first releases free buffers, smallest first, and gets None if it
    still would. A released buffer goes back to torch's allocator, which reuses it only after its last copy (each copy
    recorded the side stream on it)."""

    def __init__(self, budget_bytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.budget_bytes = budget_bytes
        self.allocate = allocate  # a flat uint8 buffer of that many bytes (pinned, on CUDA)
        self.held_bytes = 0
        self._free: dict[Any, tuple[list[int], list[torch.Tensor]]] = {}  # per device: sizes ascending, buffers
        # per held buffer (by id: a buffer dies only after ``_release`` drops it here): its last typed view
        self._typed: dict[int, tuple[torch.dtype, torch.Size, torch.Tensor]] = {}

    def take(self, nbytes: int, device: Any = None) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` for ``device``'s copies (its first ``nbytes`` are the input's), or None
        past the budget. Raises what ``allocate`` raises (pinned memory refused)."""
        sizes, buffers = self._free.setdefault(device, ([], []))
        at = bisect.bisect_left(sizes, nbytes)
        if at < len(sizes):
            sizes.pop(at)
            return buffers.pop(at)
        size = 1 << max(nbytes - 1, 0).bit_length()
        size = size if size <= self.budget_bytes else nbytes  # a small budget: the exact size where that fits
        if self.held_bytes + size > self.budget_bytes:
            self._release(self.held_bytes + size - self.budget_bytes)
        if self.held_bytes + size > self.budget_bytes:
            return None
        buffer = self.allocate(size)
        self.held_bytes += size
        return buffer

    def typed(self, buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """``buffer``'s first bytes as a tensor of ``dtype`` and ``shape``. The view of a buffer's last request is
        kept and handed out again for the same dtype and shape (each layer's input, every step): a slice and two
        views cost about a quarter of a pack's host time (measured, 12 of 49 us on an H200 host)."""
        kept = self._typed.get(id(buffer))
        if kept is not None and kept[0] == dtype and kept[1] == shape:
            return kept[2]
        view = buffer[: shape.numel() * dtype.itemsize].view(dtype).view(shape)
        self._typed[id(buffer)] = (dtype, shape, view)
        return view

    def give(self, buffer: torch.Tensor, device: Any = None) -> None:
        sizes, buffers = self._free.setdefault(device, ([], []))
        at = bisect.bisect_left(sizes, buffer.numel())
        sizes.insert(at, buffer.numel())
        buffers.insert(at, buffer)

    def _release(self, nbytes: int) -> None:
        """Free buffers back to torch's allocator, smallest first, until ``nbytes`` are released or none is left."""
        released = 0
        for sizes, buffers in self._free.values():
            while sizes and released < nbytes:
                released += sizes.pop(0)
                self._typed.pop(id(buffers.pop(0)), None)
        self.held_bytes -= released


class SideStream:
    """One device's side stream and the few CUDA calls a layer's copies need, each without the host work of torch's
    conveniences: ``torch.cuda.current_stream`` builds a new ``Stream`` object per call (kept here per raw stream),
    ``with torch.cuda.stream(...)`` looks up and sets streams on two devices (here one ``set_stream`` each way), and
    a copy back records one event shared by all (a wait on it covers every copy queued before, in stream order)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = torch.cuda.Stream(self.index)
        self.compute_done = torch.cuda.Event()  # the compute stream's position, for the side stream to wait on
        self.copied_back = torch.cuda.Event()  # the newest copy back, for the compute stream to wait on
        self._compute: dict[int, torch.cuda.Stream] = {}

    def compute(self) -> torch.cuda.Stream:
        """The device's current stream: where the layer's work and the unpacked input's users run."""
        if _raw_stream is None:
            return torch.cuda.current_stream(self.index)
        raw = _raw_stream(self.index)
        stream = self._compute.get(raw)
        if stream is None:
            stream = self._compute[raw] = torch.cuda.current_stream(self.index)
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, compute: torch.cuda.Stream) -> None:
        """``dst.copy_(src)`` on the side stream, after all the compute stream has queued so far (``src`` is
        computed there; ``dst``'s block may have had users there). The event is recorded anew each time: a wait takes
        the record current when it is queued, and ``Stream.wait_stream`` would create an event per call."""
        self.compute_done.record(compute)
        self.stream.wait_event(self.compute_done)
        if torch.cuda.current_device() != self.index:  # set_stream would also switch the current device
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
            return
        torch.cuda.set_stream(self.stream)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(compute)


class HostOffload:
    """Saved-tensor hooks that keep checkpointed layer inputs in host memory (``torch.autograd.graph``'s
    ``saved_tensors_hooks(offload.pack, offload.unpack)`` around the checkpoint call).

    ``budget_bytes``: the most host bytes held at once; past it an input stays on the device. ``min_bytes``: inputs
    smaller than this stay on the device (a copy costs more than it frees). ``min_tokens``: inputs of fewer tokens
    (all dimensions but the last, the hidden one) stay on the device, counted in ``stats.short`` (auto mode: the
    micro-batch size from which the offload's step cost was measured small). ``on_failure(reason)``: called once when
    host memory cannot be had (pinned allocation fails); every later input then stays on the device. ``paused``: while
    True, the patch calls the checkpoint outside the hooks (stock checkpointing), from the next layer on: the same
    trainer's steps with and without the offload, a step apart (``benchmarks/bench_offload_toggle.py``)."""

    def __init__(
        self,
        budget_bytes: int,
        min_bytes: int = 0,
        on_failure: Callable[[str], None] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        self.min_tokens = min_tokens
        self.on_failure = on_failure
        self.stats = OffloadStats()
        self.failed = False
        self.paused = False
        self.pool = PinnedPool(budget_bytes, pinned_buffer)
        self._newest: weakref.ref[Offloaded] | None = None
        self._lanes: dict[torch.device, SideStream] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)  # holds no state: reused

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        return self._hooks

    # -- the forward
    def pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        # An empty tensor is no input (torch <= 2.11's non-reentrant checkpoint saves a 0-element dummy beside the
        # inputs): moving it frees nothing and would take the newest input's place on the device.
        if self.failed or nbytes == 0 or nbytes < self.min_bytes:
            return tensor
        if self.min_tokens and tokens_of(tensor) < self.min_tokens:
            self.stats.short += 1
            return tensor
        # A leaf that requires grad stays alive until the backward ends whatever the hooks do: the AccumulateGrad
        # node every use links to holds it. PEFT's input-gradient hook (``enable_input_require_grads``, which
        # trainers call with checkpointing on a LoRA or QLoRA model) makes the embedding output, the first layer's
        # input, such a leaf: a host copy would free nothing, and its copy back would be a second device copy of it.
        if tensor.is_leaf and tensor.requires_grad:
            self.stats.leaves += 1
            return tensor
        if self.stats.live_bytes + nbytes > self.budget_bytes:
            self.stats.kept += 1
            return tensor
        device = tensor.device  # a new object per read: read once
        try:
            host, buffer = self._to_host(tensor, nbytes, device)
        except RuntimeError as error:  # pinned host memory exhausted, or the host allocator refused
            self._fail(f"{type(error).__name__}: {error}")
            return tensor
        if host is None:  # the pinned buffers held reach the budget
            self.stats.kept += 1
            return tensor
        item = Offloaded(host, nbytes, device, self.stats, self._newest)
        if buffer is not None:  # on CUDA
            item.buffer, item.pool = buffer, self.pool
            self.stats.pinned_bytes = self.pool.held_bytes
            newest = self._newest() if self._newest is not None else None
            if newest is not None:
                newest.device_copy = None  # its copy is queued; the allocator waits for it before reusing the block
            item.device_copy = tensor
        self._newest = weakref.ref(item)
        return item

    def _to_host(
        self, tensor: torch.Tensor, nbytes: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The host copy of ``tensor`` (on ``device``) and, on CUDA, the pool's buffer it views; (None, None) where
        the pinned buffers held would pass the budget."""
        if device.type != "cuda":
            return tensor.detach().clone(), None
        buffer = self.pool.take(nbytes, device.index)
        if buffer is None:
            return None, None
        lane = self._lane(device)
        host = self.pool.typed(buffer, tensor.dtype, tensor.shape)
        try:
            lane.copy(host, tensor, lane.compute())
        except RuntimeError:
            self.pool.give(buffer, device.index)
            raise
        tensor.record_stream(lane.stream)  # its block is not reused before the copy has read it
        return host, buffer

    # -- the backward
    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        tensor = self._take(packed)
        previous = packed.previous() if packed.previous is not None else None
        if previous is not None and previous.device_copy is None and previous.fetched is None:
            self._fetch(previous)  # the next input the backward needs, copied while this layer recomputes
            self.stats.fetched_ahead += 1
        return tensor

    def _take(self, item: Offloaded) -> torch.Tensor:
        if item.device.type != "cuda":
            return item.host
        if item.device_copy is not None:  # the newest input: still on the device
            tensor, item.device_copy = item.device_copy, None
            return tensor
        if item.fetched is None:
            self.stats.waited += 1
            self._fetch(item)
        lane = item.lane
        lane.compute().wait_event(lane.copied_back)  # recorded at or after this item's copy back
        tensor, item.fetched = item.fetched, None
        return tensor

    def _fetch(self, item: Offloaded) -> None:
        if item.device.type != "cuda":
            return
        lane = self._lane(item.device)
        # on the compute stream; empty_like: a third of the host time of torch.empty(shape, dtype=, device=) there
        tensor = torch.empty_like(item.host, device=item.device)
        lane.copy(tensor, item.host, lane.compute())
        lane.copied_back.record(lane.stream)
        item.fetched, item.lane = tensor, lane

    def _lane(self, device: torch.device) -> SideStream:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = SideStream(device)
        return lane

    def _fail(self, reason: str) -> None:
        self.failed = True
        self.stats.failures.append(reason)
        if self.on_failure is not None:
            self.on_failure(reason)


class GradientSink(torch.autograd.Function):
    """``x``'s values as a tensor that requires grad (through ``anchor``, a 0-element leaf that does) and whose
    gradient is dropped.

    PEFT's input-gradient hook makes the embedding output a leaf that requires grad so that checkpointed layers get
    an input that does; autograd then holds that leaf until the backward ends (its AccumulateGrad node), beside every
    offloaded input, and fills its ``.grad``, which nothing reads. Handed this instead, the first layer gets the same
    values and the same ``requires_grad`` (the compiled layers see what they saw), its input is an ordinary tensor the
    hooks move like any other, and the leaf is freed once the forward is done with it. The gradients of every
    parameter are autograd's own: this only drops the one the leaf would have kept."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


class EmbeddingOutput:
    """The input embedding's latest output (a weak reference, recorded by a forward hook) and what hands it to the
    first layer without its unused gradient (``GradientSink``)."""

    def __init__(self) -> None:
        self.latest: weakref.ref[torch.Tensor] | None = None
        self._anchors: dict[torch.device, torch.Tensor] = {}

    def record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.latest = weakref.ref(output) if isinstance(output, torch.Tensor) else None

    def only_hook_made(self, tensor: Any) -> bool:
        """``tensor`` is the embedding output of this forward, a leaf that requires grad: nothing upstream trains
        (the embedding is frozen, else the output would not be a leaf), so only a hook made it require grad."""
        latest = self.latest() if self.latest is not None else None
        return tensor is latest and tensor.is_leaf and tensor.requires_grad

    def sink(self, tensor: torch.Tensor) -> torch.Tensor:
        anchor = self._anchors.get(tensor.device)
        if anchor is None:
            anchor = self._anchors[tensor.device] = torch.zeros(0, device=tensor.device, requires_grad=True)
        return GradientSink.apply(anchor, tensor.detach())


def tokens_of(tensor: torch.Tensor) -> int:
    """A layer input's tokens: its elements over the last (hidden) dimension's size."""
    return tensor.numel() // tensor.shape[-1] if tensor.dim() and tensor.shape[-1] else tensor.numel()


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A flat pinned host buffer (torch's caching host allocator: a block it reuses only after the copies recorded
    on it have run)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def spread_layers(total: int, count: int) -> list[int]:
    """The indices of ``count`` of ``total`` layers spread evenly over the stack, each in the middle of its equal
    share (every other one for half of them), or every index for ``count`` 0. Spread, each copy has the compute of
    the layers between it and the next to hide under."""
    if count <= 0 or count >= total:
        return list(range(total))
    return [(2 * i + 1) * total // (2 * count) for i in range(count)]


def host_budget_bytes(max_host_gib: float, available_bytes: int, local_processes: int) -> int:
    """The host bytes one process may hold: ``max_host_gib`` if set (> 0), else half of what the host has
    available, shared by the processes on this host (each offloads its own inputs)."""
    if max_host_gib > 0:
        return int(max_host_gib * GIB)
    return available_bytes // 2 // max(local_processes, 1)
