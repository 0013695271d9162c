"""``leantrain.compiling.background``'s plain parts: which graphs a child can take (and why not), the modules that
define a graph's custom ops, the key that finds a graph again after Dynamo traces it anew, the process state a child
copies, and the deadline. The compile itself is tested in tests/parity/test_compile_layers_background.py."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses import FakeTensor

from leantrain.compiling import _child, background


def captured(fn, *args, dynamic: bool | None = False) -> tuple[torch.fx.GraphModule, list]:
    """The graph and inputs Dynamo hands a backend for ``fn(*args)``."""
    seen = []

    def capture(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=dynamic)(*args)
    torch._dynamo.reset()
    return seen[0]


def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w).sum(-1)


def test_a_static_graph_of_plain_tensors_can_be_handed_over():
    gm, inputs = captured(layer, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True))
    assert background.why_not_background(gm, inputs) is None


def test_what_stays_in_the_training_process():
    gm, inputs = captured(layer, torch.randn(4, 8), torch.randn(8, 8), dynamic=True)
    assert "symbolic shapes" in background.why_not_background(gm, inputs)
    gm, inputs = captured(layer, torch.randn(4, 8), torch.randn(8, 8))
    shared = torch.randn(8, 8)
    assert background.why_not_background(gm, [shared, shared]) == "inputs sharing storage"
    assert "an input of type object" in background.why_not_background(gm, [object(), shared])

    class Marked(torch.Tensor):
        pass

    assert "type Marked" in background.why_not_background(gm, [torch.randn(2).as_subclass(Marked)])

    class Quantized(torch.nn.Parameter):  # adds attributes only, as bitsandbytes' Params4bit does
        pass

    assert background.why_not_background(gm, [Quantized(torch.randn(2)), torch.randn(2)]) is None


def test_the_modules_defining_a_graphs_custom_ops():
    from leantrain.moe4bit import _custom_ops

    def grouped(a, b, offs):
        return _custom_ops.grouped_mm_op(a, b, offs)

    a, b = torch.randn(4, 8), torch.randn(2, 8, 8)
    gm, _ = captured(grouped, a, b, torch.tensor([2, 4], dtype=torch.int32))
    assert background.op_modules(gm) == ["leantrain.moe4bit._custom_ops"]
    gm, _ = captured(layer, torch.randn(4, 8), torch.randn(8, 8))
    assert background.op_modules(gm) == []  # aten only


def test_an_op_of_no_known_module_is_refused():
    library = torch.library.Library("leantrain_test_ns", "DEF")  # noqa: TOR901 - a namespace no module is named after
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: 2 * x, "CompositeExplicitAutograd")
    gm, _ = captured(lambda x: torch.ops.leantrain_test_ns.twice(x), torch.randn(3))
    with pytest.raises(LookupError, match="leantrain_test_ns::twice"):
        background.op_modules(gm)


def test_the_key_finds_a_graph_traced_again_and_tells_others_apart():
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    first = background.graph_key(*captured(layer, x, w))
    assert background.graph_key(*captured(layer, x, w)) == first
    assert background.graph_key(*captured(layer, torch.randn(5, 8), w)) != first  # another shape
    with torch.no_grad():
        assert background.graph_key(*captured(layer, x, w)) != first  # another grad mode
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert background.graph_key(*captured(layer, x, w)) != first


def test_the_child_takes_the_parents_state_and_flags():
    state = background.global_state()
    flags = {(path, name): value for path, name, value in state["flags"]}
    matmul = torch.backends.cuda.matmul
    assert flags[("backends.cuda.matmul", "fp32_precision")] == matmul.fp32_precision
    old = matmul.fp32_precision
    other = "tf32" if old != "tf32" else "ieee"
    threads = torch.get_num_threads()
    wanted = dict(state, grad=False, autocast={"cpu": torch.bfloat16}, threads=threads + 1)
    wanted["flags"] = [
        (p, n, other if (p, n) == ("backends.cuda.matmul", "fp32_precision") else v) for p, n, v in state["flags"]
    ]
    try:
        with _child.parent_state(wanted):
            assert not torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
            assert matmul.fp32_precision == other and torch.get_num_threads() == threads + 1
            assert torch.backends.fp32_precision == flags[("backends", "fp32_precision")]  # the others untouched
    finally:
        matmul.fp32_precision = old
        torch.set_num_threads(threads)


def test_a_child_past_the_deadline_is_stopped_and_reported():
    failures = []
    ready = []
    compiler = background.BackgroundBackend(
        lambda gm, inputs: gm.forward, lambda: ready.append(1), failures.append, 0.0
    )
    gm, inputs = captured(layer, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True))
    job = compiler.backend(gm, inputs)
    assert isinstance(job, background.Job) and torch.equal(job(*inputs)[0], gm.forward(*inputs)[0])
    assert compiler.promote() == 0 and not ready
    assert failures == ["the background compile failed: still compiling after 0 s, stopped"]
    assert job.process.wait(10) is not None
    compiler.close()
    assert not job.directory.exists()


def test_the_child_rebuilds_each_inputs_layout():
    """Shape, stride, storage offset, dtype, device and requires_grad (the cache key reads them all), for a plain
    tensor, a slice, a transpose and an empty one."""
    base = torch.randn(10, 8)
    empty = torch.empty(0, 4, dtype=torch.bfloat16)
    for x in (torch.randn(3, 4, requires_grad=True), base[2:5, 1:4], base.t(), empty):
        spec = background.input_spec(x)
        y = _child.make_input(spec)
        assert background.input_spec(y) == spec and y.storage_offset() == x.storage_offset()
        assert not y.any()
        with _child.fake_mode():  # as the child makes them: the same layout, no memory
            fake = _child.make_input(spec)
        assert isinstance(fake, FakeTensor) and background.input_spec(fake) == spec
    assert _child.make_input(background.input_spec(3)) == 3


def test_how_a_child_ended_names_its_exit_and_its_last_error(tmp_path):
    import subprocess
    import sys

    def job(code: str) -> background.Job:
        with open(tmp_path / "child.log", "wb") as log:
            process = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
        return background.Job(None, tmp_path, process)

    failed = job("print('compiling'); print('ValueError: boom'); print('done'); raise SystemExit(3)")
    failed.process.wait(30)
    assert failed.error_line() == "exit code 3: ValueError: boom"
    killed = job("import time; time.sleep(60)")
    killed.process.kill()
    killed.process.wait(30)
    assert killed.error_line() == "killed by signal 9"


class ScaledGate(torch.autograd.Function):
    """An autograd.Function as the compiled layers' are: one tensor through ``save_for_backward``, one stashed on
    ``ctx``, a non-differentiable second output."""

    @staticmethod
    def forward(ctx, x, w):
        h = x @ w
        gate = torch.sigmoid(h)
        ctx.save_for_backward(x, w)
        ctx.gate = gate
        mask = (h > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        return h * gate, mask

    @staticmethod
    def backward(ctx, grad, _grad_mask):
        x, w = ctx.saved_tensors
        gate = ctx.gate
        h = x @ w
        dh = grad * (gate + h * gate * (1 - gate))
        return dh @ w.T, x.T @ dh


def gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out, mask = ScaledGate.apply(torch.tanh(x), w)
    return (out * 2 + mask).sum()


def grads_of(fn, x, w):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w)
    out.backward()
    return out.detach(), x.grad, w.grad


def test_the_traced_graph_runs_its_autograd_functions_without_torchs_class_per_call(monkeypatch):
    """``eager_graph`` swaps the traced graph's ``autograd_function_apply`` calls for ``TracedFunction``: the same
    bits forward and backward as the function run eagerly, and what it saved goes with the autograd graph (torch's
    eager form keeps it in a class per call until the cycle collector runs: checked with the collector off)."""
    import gc
    import weakref

    from torch._functorch.autograd_function import AutogradFunctionApply, autograd_function_apply

    x, w = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 8)
    gm, _ = captured(gated, x.requires_grad_(), w.requires_grad_())
    assert gm.graph.find_nodes(op="call_function", target=autograd_function_apply)
    assert background.eager_graph(gm) == 1
    assert not gm.graph.find_nodes(op="call_function", target=autograd_function_apply)

    def refused(*args, **kwargs):
        raise AssertionError("torch's eager autograd_function_apply ran")

    monkeypatch.setattr(AutogradFunctionApply, "__call__", refused)
    got, want = grads_of(lambda a, b: gm(a, b)[0], x, w), grads_of(gated, x, w)
    for g, e in zip(got, want, strict=True):
        assert torch.equal(g, e)

    gc.disable()
    try:
        out = gm(x.detach().requires_grad_(), w.detach().requires_grad_())[0]
        ctx = out.grad_fn
        while type(ctx).__name__ != "TracedFunctionBackward":
            ctx = ctx.next_functions[0][0]
        stashed = [weakref.ref(v) for v in ctx.stashed if isinstance(v, torch.Tensor)]
        assert stashed  # the gate, stashed on ctx by the original function
        out.backward()
        del out, ctx
        assert all(ref() is None for ref in stashed)
    finally:
        gc.enable()


def test_an_autograd_function_call_of_another_form_stays_as_traced():
    from torch._functorch.autograd_function import autograd_function_apply

    gm, _ = captured(gated, torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    (node,) = gm.graph.find_nodes(op="call_function", target=autograd_function_apply)
    node.kwargs = {**node.kwargs, "args_tensor_mask": [True, True]}
    assert background.eager_graph(gm) == 0
    assert node.target is autograd_function_apply


class Aside(torch.autograd.Function):
    """Two differentiable outputs, the second unused by the caller (as the intermediates Dynamo may return as extra
    outputs of a traced function); its backward does not read the second's gradient."""

    @staticmethod
    def forward(ctx, x, w):
        h = x @ w
        ctx.save_for_backward(x, w)
        return torch.sin(h), h * 3

    @staticmethod
    def backward(ctx, grad, grad_aside):
        x, w = ctx.saved_tensors
        dh = grad * torch.cos(x @ w)
        return dh @ w.T, x.T @ dh


class AsideRead(Aside):
    """:class:`Aside` whose backward reads the second output's gradient."""

    @staticmethod
    def backward(ctx, grad, grad_aside):
        x, w = ctx.saved_tensors
        dh = grad * torch.cos(x @ w) + 3 * grad_aside
        return dh @ w.T, x.T @ dh


def aside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return Aside.apply(torch.tanh(x), w)[0].sum()


def aside_read(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return AsideRead.apply(torch.tanh(x), w)[0].sum()


@pytest.mark.parametrize("reads", [False, True], ids=["unread", "read"])
def test_an_output_no_gradient_reached_gets_zeros_only_where_the_backward_reads_them(reads):
    """Autograd makes zeros for an output no gradient reached; the traced graph's functions make them only where
    the backward graph reads that gradient (an unread one stays None: no intermediate-sized zeros), with the same
    bits as the function run eagerly either way."""
    fn = aside_read if reads else aside
    x, w = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    gm, _ = captured(fn, x.requires_grad_(), w.requires_grad_())
    assert background.eager_graph(gm) == 1
    (node,) = gm.graph.find_nodes(op="call_function", target=background.run_function)
    assert node.args[2][3] is not None and (1 in node.args[2][3]) == reads  # the aside's gradient: read or not
    seen = []
    bwd = getattr(gm, node.args[1].target)

    class Recorder(torch.nn.Module):
        def forward(self, *args):
            seen.append(args[1])
            return bwd(*args)

    setattr(gm, node.args[1].target, Recorder())
    got, want = grads_of(lambda a, b: gm(a, b)[0], x, w), grads_of(fn, x, w)
    for g, e in zip(got, want, strict=True):
        assert torch.equal(g, e)
    (aside_grad,) = seen
    assert (aside_grad is None) != reads
    if reads:
        assert torch.equal(aside_grad, torch.zeros(4, 8))


def test_a_child_starts_only_where_its_gpu_has_room_for_it(monkeypatch):
    """Twice a child's CUDA context free on each of the job's GPUs, read after a step; nothing to check on the host."""
    gib = background.GIB
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80 * gib))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert background.room_for_child((cpu,)) is None and background.room_for_child(()) is None
    free["bytes"] = 2 * background.CHILD_GPU_BYTES - 1
    reason = background.room_for_child((cpu, cuda))
    assert reason is not None and f"{free['bytes'] / gib:.2f} GiB free on cuda:0" in reason
    free["bytes"] = 2 * background.CHILD_GPU_BYTES
    assert background.room_for_child((cuda,)) is None
