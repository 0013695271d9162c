"""The child process of ``background.py``: ``python -m leantrain.compiling._child <job directory>``.

Reads ``job.pkl`` (the graph, its inputs' specs, the parent's settings and state, the modules defining its custom
ops) and compiles the graph with inductor, forward and backward, into inductor's on-disk cache; exit code 0 when
done. Runs at a lower CPU priority than the training process it serves. Imports nothing of
leantrain beyond the modules the job names."""

from __future__ import annotations

import contextlib
import importlib
import operator
import os
import pickle
import sys
from pathlib import Path
from typing import Any


def main(directory: Path) -> None:
    with contextlib.suppress(OSError):
        os.nice(10)  # the training process's host thread comes first
    job = pickle.loads((directory / "job.pkl").read_bytes())

    for name in job["imports"]:
        importlib.import_module(name)
    for name, settings in job["configs"].items():
        importlib.import_module(name).load_config(settings)
    gm = load_graph(job["graph"])
    dynamo_metadata(gm, job["static"])
    mode = fake_mode()
    with mode:  # fake inputs: nothing of the layer is allocated on the parent's GPU
        inputs = [make_input(spec) for spec in job["inputs"]]
    with parent_state(job["state"]):
        fake_values(gm, inputs, mode)
        compile_into_cache(gm, inputs, mode)


def fake_mode() -> Any:
    """The fake mode of the child's inputs and of its compile's tracing context (one: AOTAutograd takes the inputs'
    mode and checks it against the context's), with a shape env (without one the caches are bypassed)."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def compile_into_cache(gm: Any, inputs: list[Any], mode: Any) -> None:
    """Inductor's compile of the graph, as Dynamo's backend call runs it (in a tracing context of the inputs' fake
    mode), with the backward lowered now rather than at a first backward that never comes here. Its FX graphs land
    in the on-disk cache; the compiled function is dropped. Nothing runs on the device: inductor tunes a kernel when
    it first runs, which is in the training process."""
    import torch
    from torch._inductor.compile_fx import compile_fx

    context = torch._guards.TracingContext(mode)
    with torch._guards.tracing(context), torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        # static shapes, as Dynamo traced them (its inputs' symbolic contexts say so in the parent)
        compile_fx(gm, inputs, ignore_shape_env=True)


def load_graph(data: bytes) -> Any:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    gm.recompile()
    return gm


def dynamo_metadata(gm: Any, static: list[str | None]) -> None:
    """What AOTAutograd reads from a Dynamo graph to tell its static inputs (parameters): a compile id, a source
    per parameter and per placeholder (unique stand-ins: their names never reach the compiled code) and each
    placeholder's static-input mark as the parent had it."""
    from torch._dynamo.source import LocalSource

    gm.meta.setdefault("dynamo_compile_id", None)
    names = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in gm.named_buffers(remove_duplicate=False)]
    gm._param_name_to_source = {name: LocalSource(f"param {name}") for name in names}
    for i, (node, mark) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), static, strict=True)):
        node._dynamo_source = LocalSource(f"input {i}")
        if mark:
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": mark}


def fake_values(gm: Any, inputs: list[Any], mode: Any) -> None:
    """Every node's ``example_value`` again (the parent leaves Dynamo's fakes behind), as Dynamo's graphs carry them:
    AOTAutograd reads them (its cache tells a tensor's method call from another object's by them)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")


def make_input(spec: tuple[Any, ...]) -> Any:
    """An input in the parent's input's shape, stride, storage offset, dtype and device (made under a fake mode: no
    memory; values never reach the compiled code's choices)."""
    import torch

    if spec[0] != "tensor":
        return spec[1]
    _, shape, stride, offset, dtype, device, requires_grad = spec
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0
    storage = torch.zeros(offset + span, dtype=dtype, device=device)
    return storage.as_strided(shape, stride, offset).requires_grad_(requires_grad)


@contextlib.contextmanager
def parent_state(state: dict[str, Any]):
    import torch

    enabled, warn_only, fill = state["deterministic"]
    now = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if now != (enabled, warn_only):
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.set_default_dtype(state["default_dtype"])
    if torch.get_num_threads() != state["threads"]:
        torch.set_num_threads(state["threads"])
    for path, name, value in state["flags"]:  # in order, each set only where it differs: a setter moves others
        owner = operator.attrgetter(path)(torch)
        if getattr(owner, name) != value:
            setattr(owner, name, value)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        for device, dtype in state["autocast"].items():
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


if __name__ == "__main__":
    main(Path(sys.argv[1]))
