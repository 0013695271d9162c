"""Inductor's compile in a child process while training goes on: a ``torch.compile`` backend that does not block.

A cold compile of a decoder layer takes 10-25 s, and the first step waits for all of it. With this backend Dynamo
still traces in the training process (the guards and the graph stay here), but the graph goes to a child process
(``_child.py``) that compiles it with inductor, forward and backward, into inductor's on-disk FX-graph cache (the
same directory: torch's per-user default or ``TORCHINDUCTOR_CACHE_DIR``). The step that traced runs the traced graph
(the layer's own ops, stock speed; its ``autograd.Function`` calls through ``run_function``, see ``eager_graph``);
from the next step boundary until the children finish, :attr:`eager` tells the owner to call its uncompiled code
instead, which is what a run without compile runs. :meth:`BackgroundBackend.promote`,
called at a step boundary, sees which children finished and drops Dynamo's entries for the compiled code
(``on_ready``): the next call traces again and compiles here, where inductor finds both graphs' code in the cache and
builds no kernel (a warm second launch's cost, seconds instead of the cold compile). Only at a step boundary, so a
checkpoint's recompute in the backward runs the path its forward ran.

The child gets what decides the compiled code: the graph (``GraphPickler``), each input's shape, stride, storage
offset, dtype, device and ``requires_grad``, which inputs Dynamo marked static (parameters), the process's inductor
and functorch settings (a patch active around the backend call included), the grad mode, autocast state, fp32
precision settings and intra-op thread count, and the modules that define the graph's custom ops.
A graph it cannot take (symbolic shapes, aliased or subclassed inputs, something that does not pickle) compiles
here as before; a child that fails or runs past the deadline reports through ``on_failure`` (the owner's run-time
fallback) and its graph keeps running uncompiled."""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


logger = logging.getLogger("leantrain")

CHILD_MODULE = "leantrain.compiling._child"
DEADLINE_S = 1800.0  # a child still compiling after this long is stopped (its graph stays uncompiled)
GIB = 1024**3
# What a child holds on a GPU: its CUDA context, nothing of the layer (it compiles from fake inputs). Measured on an
# H200 (torch 2.11, CUDA 13.0, 2026-12-02; nvidia-smi's per-process memory, one Qwen3-30B-A3B MoE layer in QLoRA):
# 0.60 GiB at most. A child starts only where twice that is free after the first step.
CHILD_GPU_BYTES = int(0.6 * GIB)
# namespaces of ops that torch defines itself: the child has them without importing anything
_TORCH_NAMESPACES = frozenset({"aten", "prims", "higher_order", "_c10d_functional", "c10d", "profiler", "inductor"})
# precision settings the FX-graph cache's key reads, (owner under torch, name), set in this order in the child:
# the global fp32 precision, then each backend's (torch's newer API only: reading a legacy allow_tf32 switch raises
# where a process set the newer one)
_FLAGS = (
    ("backends", "fp32_precision"),
    ("backends.cuda.matmul", "fp32_precision"),
    ("backends.cudnn", "fp32_precision"),
    ("backends.cudnn.conv", "fp32_precision"),
    ("backends.cudnn.rnn", "fp32_precision"),
    ("backends.mkldnn", "fp32_precision"),
    ("backends.mkldnn.matmul", "fp32_precision"),
    ("backends.mkldnn.conv", "fp32_precision"),
    ("backends.mkldnn.rnn", "fp32_precision"),
    ("backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
)
# node meta the child does not need (fake values, module stacks, Dynamo's input bookkeeping): dropped before
# pickling, as torch's own GraphModuleSerializableCallable does
_META_DROPPED = (
    "nn_module_stack", "source_fn_stack", "example_value", "stack_trace", "val", "tensor_meta",
    "grapharg", "tensor_dict",
)  # fmt: skip


class Job:
    """One graph to compile in a child process (``start()``); called as the compiled function, it runs the traced
    graph."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        directory: Path,
        process: subprocess.Popen[bytes] | None = None,
        devices: tuple[torch.device, ...] = (),
    ) -> None:
        self.gm, self.directory, self.process, self.devices = gm, directory, process, devices
        self.started = time.perf_counter()
        self.done = False
        self.failed: str | None = None
        self.here: str | None = None  # why it compiles in the training process instead (no room for a child)
        self.seconds: float | None = None  # from the child's start to the step boundary that saw it finished

    def __call__(self, *args: Any) -> Any:
        return self.gm.forward(*args)

    def start(self) -> None:
        """The child process, compiling the job's files (written at the hand-over)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with open(self.directory / "child.log", "wb") as log:
            command = [sys.executable, "-m", CHILD_MODULE, str(self.directory)]
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started = time.perf_counter()

    def error_line(self) -> str:
        """How the child ended: its exit code or signal, and its last error line (or last line)."""
        try:
            lines = (self.directory / "child.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        code = self.process.returncode if self.process is not None else None
        how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        errors = [line for line in lines if "Error" in line or "error" in line]
        last = (errors or lines or [""])[-1].strip()[:300]
        return f"{how}: {last}" if last else how


class BackgroundBackend:
    """``backend`` for ``torch.compile``: each graph it can hand over compiles in a child while the traced graph
    runs; any other graph goes to ``inner`` at once, as does a finished child's graph when Dynamo traces it again
    after ``promote()`` (its code is in the cache then). ``close()`` stops the children and removes their files
    (also when collected and at interpreter exit)."""

    def __init__(
        self,
        inner: Callable[..., Any],
        on_ready: Callable[[], None],
        on_failure: Callable[[str], None],
        deadline_s: float = DEADLINE_S,
    ) -> None:
        self.inner, self.on_ready, self.on_failure, self.deadline_s = inner, on_ready, on_failure, deadline_s
        self.jobs: dict[str, Job] = {}  # by graph_key
        self.in_process: list[str] = []  # why each graph compiled here at once
        self.retraced = 0  # finished children's graphs compiled here from the warm cache
        # the owner's uncompiled code serves the calls: from the step after a trace until every child has finished
        self.eager = False
        self.eager_steps = 0  # steps that began with a child still compiling
        self._roots: list[Path] = []  # the job directories' parent, made at the first hand-over
        # stops the children and removes their files on close(), when collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, _stop_all, self.jobs, self._roots)

    # --- the backend ----------------------------------------------------------------------------------------------
    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        reason = why_not_background(gm, example_inputs)
        if reason is None:
            key = graph_key(gm, example_inputs)
            job = self.jobs.get(key)
            if job is not None and job.done:  # traced again after promote(): the cache holds its code
                self.retraced += job.here is None
                return self.inner(gm, example_inputs)
            if job is not None:  # traced again while its child still compiles (another graph was ready)
                return job
            try:
                job = self._submit(gm, example_inputs)
            except Exception as error:  # noqa: BLE001 - anything the hand-over trips on: compile here as before
                reason = f"the graph could not be handed to a child process ({type(error).__name__}: {error})"
            else:
                self.jobs[key] = job
                logger.info(
                    "leantrain: a child process compiles this graph from the next step on (%s); the traced graph "
                    "runs meanwhile",
                    job.directory,
                )
                return job
        self.in_process.append(reason)
        logger.info("leantrain: compiling in this process: %s", reason)
        return self.inner(gm, example_inputs)

    def seen(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> bool:
        """Whether this graph was handed to a child before (Dynamo traced it again: not a new compile)."""
        return why_not_background(gm, example_inputs) is None and graph_key(gm, example_inputs) in self.jobs

    def _submit(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Job:
        job = {
            "graph": graph_bytes(gm),
            "inputs": [input_spec(x) for x in example_inputs],
            "static": static_inputs(gm),
            "imports": op_modules(gm),
            "configs": configs(),
            "state": global_state(),
        }
        eager_graph(gm)  # the child has its copy (pickled above): this one only runs here
        directory = Path(tempfile.mkdtemp(prefix=f"job{len(self.jobs)}-", dir=self._directory()))
        (directory / "job.pkl").write_bytes(pickle.dumps(job))
        devices = tuple(dict.fromkeys(x.device for x in example_inputs if isinstance(x, torch.Tensor)))
        return Job(gm, directory, devices=devices)

    def _directory(self) -> Path:
        if not self._roots:
            self._roots.append(Path(tempfile.mkdtemp(prefix="leantrain-compile-")))
        return self._roots[0]

    # --- at a step boundary ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> list[Job]:
        return [j for j in self.jobs.values() if not j.done and j.failed is None]

    def start(self) -> int:
        """Start the child of every job handed over since the last step boundary, where its device has room for
        one (``room_for_child``: checked now, after a step, when the training process holds its step's memory);
        a job without room compiles here instead (at the next call: ``on_ready()``). How many started."""
        started, here = 0, 0
        for job in self.pending:
            if job.process is not None:
                continue
            job.here = room_for_child(job.devices)
            if job.here is None:
                job.start()
                started += 1
                continue
            job.done = True
            here += 1
            self.in_process.append(job.here)
            logger.info("leantrain: compiling in this process: %s", job.here)
        if here:
            self.on_ready()
        return started

    def promote(self) -> int:
        """Start the children of the graphs handed over since (``start``); mark every child that finished; where
        any did, ``on_ready()`` (Dynamo traces again at the next call and those graphs compile here from the
        cache). A failed or overdue child goes to ``on_failure``. How many finished now."""
        self.start()
        finished = 0
        for job in self.pending:
            code = job.process.poll()
            if code is None and time.perf_counter() - job.started > self.deadline_s:
                job.process.kill()
                self._fail(job, f"still compiling after {self.deadline_s:.0f} s, stopped")
            elif code is not None and code != 0:
                self._fail(job, job.error_line())
            elif code == 0:
                job.done, job.seconds = True, time.perf_counter() - job.started
                finished += 1
                logger.info("leantrain: a background compile finished (%.1f s after the trace)", job.seconds)
        if finished:
            self.on_ready()
        self.eager = bool(self.pending)
        self.eager_steps += self.eager
        return finished

    def _fail(self, job: Job, reason: str) -> None:
        job.failed = reason
        self.on_failure(f"the background compile failed: {reason}")

    def wait(self, timeout_s: float | None = None) -> None:
        """Start the children not started yet, then block until every child has exited (tests, benchmarks); the
        next :meth:`promote` sees them finished."""
        self.start()
        for job in self.pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.process.wait(timeout_s)

    def close(self) -> None:
        self._finalizer()


def room_for_child(devices: tuple[torch.device, ...]) -> str | None:
    """Why a child process would not fit beside training on the job's GPU (its CUDA context, ``CHILD_GPU_BYTES``,
    twice over: later steps may need more than the first), or None. Nothing to check on the host."""
    for device in devices:
        if device.type != "cuda":
            continue
        free, _ = torch.cuda.mem_get_info(device)
        if free < 2 * CHILD_GPU_BYTES:
            return (
                f"{free / GIB:.2f} GiB free on {device} after the first step, under twice a compiling child's "
                f"{CHILD_GPU_BYTES / GIB:.1f} GiB (its CUDA context): compiled in the training process, so the "
                "child cannot leave training short of memory"
            )
    return None


def _stop_all(jobs: dict[str, Job], roots: list[Path]) -> None:
    for job in jobs.values():
        if job.process is not None and job.process.poll() is None:
            job.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.process.wait(5)
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


# --- running the traced graph here ---------------------------------------------------------------------------------
# the keyword arguments of autograd_function_apply that run_function implements, in its ``indices`` order (torch 2.11
# passes the last two)
_FUNCTION_KWARGS = ("dirty_idx", "non_differentiable_idx", "saved_for_backward_idx")


def eager_graph(gm: torch.fx.GraphModule) -> int:
    """Make the traced graph's ``autograd.Function`` calls run through :class:`TracedFunction` (in place; every
    graph module inside included); how many calls. Dynamo records them as the higher-order op
    ``autograd_function_apply``, whose eager form makes a class per call and keeps the call's saved tensors in that
    class's closure: past the backward, until Python's cycle collector frees them, and the tensors' autograd history
    chains each call's class to the one before, so each collection frees one more link (measured on an H200: an MoE
    layer's peak grew by its saved activations every step, to 103 GiB after 467 steps). A call with keyword
    arguments this does not know (another torch's form) stays as it is."""
    from torch._functorch.autograd_function import autograd_function_apply

    replaced = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.find_nodes(op="call_function", target=autograd_function_apply):
            if not set(node.kwargs) <= set(_FUNCTION_KWARGS):
                continue
            fwd, bwd, *args = node.args
            indices = (*(tuple(node.kwargs.get(k) or ()) for k in _FUNCTION_KWARGS), read_placeholders(module, bwd))
            node.target, node.args, node.kwargs = run_function, (fwd, bwd, indices, *args), {}
            changed = True
            replaced += 1
        if changed:
            module.recompile()
    return replaced


def read_placeholders(module: torch.fx.GraphModule, bwd: Any) -> tuple[int, ...] | None:
    """The positions of the backward graph's inputs that it reads (its first inputs are the output gradients), or
    None where ``bwd`` is not a graph module of ``module`` (every gradient then counts as read)."""
    graph = getattr(module, bwd.target, None) if isinstance(bwd, torch.fx.Node) and bwd.op == "get_attr" else None
    if not isinstance(graph, torch.fx.GraphModule):
        return None
    return tuple(i for i, node in enumerate(graph.graph.find_nodes(op="placeholder")) if node.users)


def run_function(fwd: Any, bwd: Any, indices: tuple[Any, ...], *args: Any) -> Any:
    """``autograd_function_apply(fwd, bwd, *args, ...)`` as :class:`TracedFunction` (the graph's call target)."""
    return TracedFunction.apply(fwd, bwd, indices, *args)


class TracedFunction(torch.autograd.Function):
    """A traced ``autograd.Function``: ``fwd`` returns the output and the values its backward reads, ``bwd`` takes
    the output gradients and those values. Kept as the original function keeps them: what it passed to
    ``save_for_backward`` is saved so (freed after the backward, dropped and recomputed under non-reentrant
    checkpointing, version-checked), what it stashed on ctx is stashed on ctx. ``indices``: the outputs marked
    dirty, the non-differentiable ones, the saved values that went through ``save_for_backward``, and the gradients
    ``bwd`` reads (None: all). An output no gradient reached gets zeros only where ``bwd`` reads its gradient: Dynamo
    may return a function's intermediates as extra outputs (torch 2.11 does where the forward sets ``ctx``
    attributes), whose zero gradients autograd would otherwise make, each an intermediate's size, at every
    backward (measured on an H200: three of 128 MiB in an MoE layer's backward)."""

    @staticmethod
    def forward(ctx: Any, fwd: Any, bwd: Any, indices: tuple[Any, ...], *args: Any) -> Any:
        dirty, non_differentiable, saved_for_backward, ctx.read_grads = indices
        output, saved = fwd(*args)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        ctx.bwd = bwd
        ctx.through_save = [i for i in saved_for_backward if isinstance(saved[i], torch.Tensor)]
        ctx.save_for_backward(*(saved[i] for i in ctx.through_save))
        ctx.stashed = [None if i in ctx.through_save else value for i, value in enumerate(saved)]
        ctx.layouts = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outputs]
        ctx.set_materialize_grads(False)
        if dirty:
            ctx.mark_dirty(*(outputs[i] for i in dirty))
        if non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in non_differentiable))
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        saved = list(ctx.stashed)
        for i, tensor in zip(ctx.through_save, ctx.saved_tensors, strict=True):
            saved[i] = tensor
        grads = tuple(_zeros_if_read(ctx, i, g) for i, g in enumerate(grads))
        result = ctx.bwd(*grads, *saved)
        return (None, None, None, *(result if isinstance(result, (tuple, list)) else (result,)))


def _zeros_if_read(ctx: Any, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient autograd would have made for output ``i`` (zeros), where none reached it and ``bwd`` reads it."""
    if grad is not None or ctx.layouts[i] is None or (ctx.read_grads is not None and i not in ctx.read_grads):
        return grad
    shape, dtype, device = ctx.layouts[i]
    return torch.zeros(shape, dtype=dtype, device=device)


# --- what the child needs (plain values) -------------------------------------------------------------------------
def why_not_background(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str | None:
    """Why the child could not compile the same code for this graph, or None."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or (
            isinstance(value, torch.Tensor) and not all(isinstance(s, int) for s in value.shape)
        ):
            return "symbolic shapes (a dynamic graph compiles in the training process)"
    storages = set()
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            if not _plain(x):
                return f"an input of type {type(x).__name__} (a tensor subclass: plain tensors and parameters only)"
            storage = (x.device, x.untyped_storage().data_ptr())
            if x.untyped_storage().nbytes() and storage in storages:
                return "inputs sharing storage"
            storages.add(storage)
        elif not isinstance(x, (int, float, bool)):
            return f"an input of type {type(x).__name__}"
    return None


def static_inputs(gm: torch.fx.GraphModule) -> list[str | None]:
    """Dynamo's static-input mark of each placeholder (parameters): AOTAutograd's partitioner saves such an input
    for the backward at no cost, so the mark decides what the compiled forward saves."""
    return [
        (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
        for node in gm.graph.find_nodes(op="placeholder")
    ]


def _plain(x: torch.Tensor) -> bool:
    """A tensor whose compiled code a plain tensor's stands for: torch's own classes, or a parameter subclass that
    adds attributes only (bitsandbytes' ``Params4bit``); not one with its own ``__torch_dispatch__`` (a DTensor,
    a wrapper subclass), which AOTAutograd traces through."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if type(x) in (torch.Tensor, torch.nn.Parameter):
        return True
    own_dispatch = type(x).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    return isinstance(x, torch.nn.Parameter) and not own_dispatch and not is_traceable_wrapper_subclass(x)


def input_spec(x: Any) -> tuple[Any, ...]:
    """What the compiled code (and the FX-graph cache's key) reads of an input: a tensor's layout, not its values."""
    if isinstance(x, torch.Tensor):
        layout = (tuple(x.shape), tuple(x.stride()), x.storage_offset())
        return ("tensor", *layout, x.dtype, str(x.device), x.requires_grad)
    return ("value", x)


def graph_bytes(gm: torch.fx.GraphModule) -> bytes:
    """The graph pickled without its fake values, module stacks and Dynamo's bookkeeping of its inputs (a copy: the
    caller's graph runs meanwhile). The child's lowering traces the graph again from real inputs: no node's meta
    decides its code, and one that does not pickle (Dynamo's ``grapharg`` holds the fake input) is left out."""
    from torch.fx._graph_pickler import GraphPickler, Options

    options = Options(ops_filter=None)
    clean = copy.deepcopy(gm)
    for module in clean.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                for key in _META_DROPPED:
                    node.meta.pop(key, None)
                for key, value in list(node.meta.items()):
                    try:
                        GraphPickler.dumps(value, options)
                    except Exception:  # noqa: BLE001 - whatever fails to pickle stays behind
                        del node.meta[key]
    return GraphPickler.dumps(clean, options)


def op_modules(gm: torch.fx.GraphModule) -> list[str]:
    """The modules the child imports so that the graph's custom ops exist there: a ``torch.library.custom_op``'s
    defining module, else a loaded module named as the op's namespace (``bitsandbytes``)."""
    from torch._library.custom_ops import OPDEFS

    names: list[str] = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            op = node.target
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                continue
            packet = op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op
            qualified = packet._qualified_op_name  # "namespace::name"
            namespace = qualified.split("::")[0]
            if namespace in _TORCH_NAMESPACES:
                continue
            opdef = OPDEFS.get(qualified)
            name = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
            name = name or (namespace if namespace in sys.modules else None)
            if name is None:
                raise LookupError(f"no module known to define the op {qualified}")
            if name not in names:
                names.append(name)
    return names


def global_state() -> dict[str, Any]:
    """What the trace and inductor's compile read from the process besides the graph and its inputs (the FX-graph
    cache's key includes the matmul flags)."""
    state: dict[str, Any] = {
        "grad": torch.is_grad_enabled(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
        ),
        "default_dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),  # inductor's C++ code for the CPU is built for this many
        "autocast": {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)},
        "flags": [(path, name, value) for path, name in _FLAGS if (value := _flag(path, name)) is not None],
    }
    return state


# the config modules whose settings decide the compiled code (the FX-graph cache's key reads the first two)
CONFIG_MODULES = ("torch._inductor.config", "torch._inductor.config_comms", "torch._functorch.config")


def configs() -> dict[str, dict[str, Any]]:
    """Each config module's settings, private ones included (the key includes them), where this torch has it."""
    import importlib

    out = {}
    for name in CONFIG_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        out[name] = module.save_config_portable(ignore_private_configs=False)
    return out


def _flag(path: str, name: str) -> Any:
    """A precision setting's value, or None where this torch has no such setting."""
    try:
        return getattr(operator.attrgetter(path)(torch), name)
    except (AttributeError, RuntimeError):
        return None


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """The same for the same graph traced again (its code, its inputs' specs, the state it compiles under)."""
    return repr((gm.code, [input_spec(x) for x in example_inputs], global_state()))
