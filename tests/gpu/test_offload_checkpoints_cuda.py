"""Offloaded activation checkpoints on CUDA against stock checkpointing on CUDA.

The CUDA path copies each checkpointed input to pinned host memory on a side stream and back one layer ahead of the
backward; the recompute gets a bitwise copy of the input and runs the same kernels as stock, so losses, gradients
and weights must equal stock checkpointing's exactly (``torch.equal``) in bf16 too: any missing stream wait (a copy
read before it was written, a block reused while a copy still reads it) shows up as a difference here. The memory
test checks that the inputs actually leave the device: after the forward, the allocated memory is lower than stock's
by the inputs moved (all but the newest)."""

from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import Status
from leantrain.cli.tiny import tiny_model
from leantrain.offload_checkpoints import ops as offload_ops
from leantrain.offload_checkpoints import probe as offload_probe
from leantrain.offload_checkpoints import stats
from leantrain.offload_checkpoints.ops import GIB, HostOffload
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only
from tests._offload_blocks import through_checkpoints


pytestmark = pytest.mark.gpu
VOCAB, HIDDEN, LAYERS = 512, 128, 3
WIDTH, ROWS = 1024, 2048  # block inputs of 2048 x 1024 bf16: 4 MiB each


def blocks(device: torch.device) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH))
        for _ in range(6)
    ).to(device, torch.bfloat16)


def forward(stack, offload: HostOffload | None, reentrant: bool):
    torch.manual_seed(1)
    h = torch.randn(ROWS, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return h, through_checkpoints(stack, h * 1.0, offload, reentrant).float().pow(2).mean()


def allocated_now() -> int:
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator process the side stream's finished uses
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("reentrant", [False, True])
def test_copies_on_the_side_stream_give_stock_gradients_and_free_the_inputs(reentrant):
    device = torch.device("cuda")
    stack = blocks(device)
    base = allocated_now()
    h, loss = forward(stack, None, reentrant)
    stock_held = allocated_now() - base
    loss.backward()
    stock = (loss.detach(), h.grad, [p.grad.clone() for p in stack.parameters()])
    stack.zero_grad(set_to_none=True)
    del h, loss

    offload = HostOffload(budget_bytes=GIB)
    base = allocated_now()
    h, loss = forward(stack, offload, reentrant)
    ours_held = allocated_now() - base
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(loss.detach(), stock[0]) and torch.equal(h.grad, stock[1])
    assert all(torch.equal(p.grad, g) for p, g in zip(stack.parameters(), stock[2], strict=True))
    one = ROWS * WIDTH * 2
    assert offload.stats.packed == 6 and offload.stats.live_bytes == 0
    assert (offload.stats.fetched_ahead, offload.stats.waited) == (5, 0)  # the newest stayed; each other ahead
    assert stock_held - ours_held >= 4.9 * one, (stock_held, ours_held)  # all but the newest input left the device


def test_a_leaf_input_stays_on_the_device_and_is_not_fetched_twice():
    """A first input that is a leaf requiring grad (PEFT's embedding output) stays on the device: the backward's
    peak holds it once, as stock's does, not beside a copy fetched back; gradients equal stock's."""
    stack = blocks(torch.device("cuda"))

    def run(offload: HostOffload | None):
        torch.manual_seed(1)
        h = torch.randn(ROWS, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        through_checkpoints(stack, h, offload, reentrant=False).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        grads = (h.grad.clone(), [p.grad.clone() for p in stack.parameters()])
        stack.zero_grad(set_to_none=True)
        return grads

    stock = run(None)
    offload = HostOffload(budget_bytes=GIB)
    ours = run(offload)
    assert torch.equal(ours[0], stock[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], stock[1], strict=True))
    assert (offload.stats.leaves, offload.stats.packed, offload.stats.waited) == (1, 5, 0)
    assert offload.stats.fetched_ahead == 4  # blocks 4..1 (5 newest, kept on the device); block 0 was never moved


def test_a_second_backward_copies_again():
    """retain_graph: every input is unpacked twice; the second time comes from the host copy again."""
    stack = blocks(torch.device("cuda"))
    h, loss = forward(stack, None, False)
    loss.backward(retain_graph=True)
    loss.backward()
    stock = h.grad.clone()
    offload = HostOffload(budget_bytes=GIB)
    h, loss = forward(stack, offload, False)
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.equal(h.grad, stock)


def test_a_copy_back_dropped_before_its_unpack_keeps_its_block_until_the_copy_ends():
    """The graph dropped after a copy back started (an unpack fetches the input before it) and before that input's
    own unpack: the copy may still be writing, so the next allocation of that size must get another block, and its
    values must be its own. (A copy back that was waited for needs no such care, and gets none.)"""
    offload = HostOffload(budget_bytes=GIB)
    shape = (ROWS + 1, WIDTH)  # a size nothing else here frees: the allocator's best fit is the dropped block
    inputs = [torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(2)]  # kept alive
    older, newest = offload.pack(inputs[0]), offload.pack(inputs[1])
    torch.full((1,), 7.0, device="cuda", dtype=torch.bfloat16)  # loads the fill kernel now: a first load waits for
    # the GPU to go idle, which would end the sleep below before the allocation it is there for
    torch.cuda._sleep(2_000_000_000)  # about a second: the copy back queued next waits behind it
    offload.unpack(newest)  # the newest is served from the device; the older one's copy back starts
    assert older.fetched is not None and offload.stats.fetched_ahead == 1
    fetched_block = older.fetched.data_ptr()
    del older  # dropped unwaited (no cycle holds it): the block goes back to the allocator behind the copy
    fresh = torch.full(shape, 7.0, device="cuda", dtype=torch.bfloat16)  # queued behind the sleep, like the copy
    assert not torch.cuda.current_stream().query(), "the sleep ended before the allocation: nothing was tested"
    assert fresh.data_ptr() != fetched_block
    torch.cuda.synchronize()
    assert bool((fresh == 7).all())
    del newest
    assert offload.stats.live_bytes == 0


def test_varying_lengths_reuse_a_longer_steps_pinned_buffers_and_train_as_stock():
    """Steps of varying rows (padding-free batches): each step's gradients equal stock's; once a longest step has
    pinned its buffers, shorter ones pin nothing new (the pool's best fit), and the pinned bytes held stay those of
    one step's inputs (powers of two)."""
    stack = blocks(torch.device("cuda"))
    offload = HostOffload(budget_bytes=GIB)
    allocated = []
    allocate = offload.pool.allocate
    offload.pool.allocate = lambda nbytes: allocated.append(nbytes) or allocate(nbytes)

    def step(rows: int, hooks: HostOffload | None) -> list[torch.Tensor]:
        torch.manual_seed(rows)
        h = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        through_checkpoints(stack, h * 1.0, hooks, reentrant=False).float().pow(2).mean().backward()
        grads = [h.grad, *(p.grad.clone() for p in stack.parameters())]
        stack.zero_grad(set_to_none=True)
        return grads

    for rows in (ROWS, ROWS - 300, ROWS // 2 + 7, ROWS - 1, ROWS // 3):
        stock, ours = step(rows, None), step(rows, offload)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(stock, ours, strict=True)), rows
    one = ROWS * WIDTH * 2  # 4 MiB, a power of two: the longest step's input
    assert allocated == [one] * 6  # the first (longest) step's six inputs (the newest copied out too, kept on the
    # device for the backward); every later step reused them
    assert offload.pool.held_bytes == offload.stats.pinned_bytes == 6 * one and offload.stats.live_bytes == 0


def test_a_reused_buffer_is_written_only_after_its_copy_back_has_read_it():
    """An input's copy back held on the side stream (a sleep queued there first), the input dropped, a new input of
    the same size packed into the same pinned buffer: stream order puts the new copy out after the old copy back, so
    the fetched values are the old input's."""
    offload = HostOffload(budget_bytes=GIB)
    shape = (ROWS, WIDTH)
    first, newest = (torch.full(shape, v, device="cuda", dtype=torch.bfloat16) for v in (1.0, 2.0))
    older, top = offload.pack(first), offload.pack(newest)
    lane = offload._lane(first.device)
    torch.cuda.synchronize()
    with torch.cuda.stream(lane.stream):
        torch.cuda._sleep(1_000_000_000)  # about half a second: the copy back queued next waits behind it
    offload.unpack(top)  # served from the device; the older input's copy back starts (behind the sleep)
    fetched = older.fetched
    buffer = older.buffer
    older.fetched = None  # the test keeps the fetched tensor: the item's end must not record it
    del older
    third = offload.pack(torch.full(shape, 3.0, device="cuda", dtype=torch.bfloat16))
    assert third.buffer is buffer  # the same pinned buffer, its copy back not run yet
    assert not lane.stream.query(), "the sleep ended before the new copy was queued: nothing was tested"
    torch.cuda.synchronize()
    assert bool((fetched == 1).all()) and bool((third.host == 3).all())


def lora_model(quantized: bool = False) -> torch.nn.Module:
    import peft

    model = tiny_model("llama", vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS)
    if quantized:
        from testkit.moe4bit_models import load_in_4bit_like

        load_in_4bit_like(model, skip=("lm_head",))
    model = model.to("cuda").train()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    return peft.get_peft_model(model, config)


def train(make, tmp_path, patch: dict | None, reentrant: bool = False, **extra):
    config = dict(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", learning_rate=1e-3, bf16=True,
        per_device_train_batch_size=2, max_steps=3, logging_steps=1, disable_tqdm=True, seed=0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )  # fmt: skip
    config.update(extra)
    data = random_rows(8, (48,), VOCAB)
    trainer = Trainer(model=make(), args=TrainingArguments(**config), train_dataset=data, data_collator=pad_right)
    if patch is not None:
        leantrain.patch_trainer(trainer, **{**only("offload_checkpoints"), **patch})
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return losses, weights, trainer


def assert_same_run(stock, ours) -> None:
    assert ours[0] == stock[0], f"losses {ours[0]} vs stock {stock[0]}"
    for name, w in stock[1].items():
        assert torch.equal(ours[1][name], w), f"{name} differs from the stock run"


@pytest.fixture
def every_input(monkeypatch):
    """The tiny model's layer inputs are far below the size worth a copy on a real run: offload them all."""
    monkeypatch.setattr(offload_probe, "MIN_BYTES", 0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_trains_exactly_as_stock_checkpointing(reentrant, tmp_path, every_input):
    stock = train(lora_model, tmp_path, None, reentrant)
    ours = train(lora_model, tmp_path, {"offload_checkpoints": True}, reentrant)
    assert_same_run(stock, ours)
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert outcome.status is Status.APPLIED and "pinned host memory on a side stream" in outcome.detail
    live = stats(ours[2])  # the embedding output, a leaf PEFT's hook made, went on without its gradient and moved
    assert live.packed == LAYERS * 3 and live.leaves == 0 and live.waited == 0


@pytest.mark.parametrize("shortest_moved", [96, 97])
def test_auto_mode_moves_micro_batches_from_the_measured_size_and_trains_exactly_as_stock(
    shortest_moved, tmp_path, every_input, monkeypatch
):
    """Auto mode on CUDA: a micro-batch of at least ``AUTO_MIN_TOKENS`` tokens (here 2 rows x 48) moves its inputs,
    a shorter one keeps stock checkpointing (counted in ``short``); either way training is stock's, bit for bit."""
    from leantrain.offload_checkpoints import measured

    monkeypatch.setattr(measured, "AUTO_MIN_TOKENS", shortest_moved)  # every case measured there, within 3%
    monkeypatch.setattr(measured, "MEASURED", tuple(measured.Run(c, shortest_moved, 0.0, 0.0) for c in measured.CASES))
    assert offload_probe.auto_reason("cuda", None) is None
    stock = train(lora_model, tmp_path, None)
    ours = train(lora_model, tmp_path, {"offload_checkpoints": None})
    assert_same_run(stock, ours)
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert outcome.status is Status.APPLIED and f"at least {shortest_moved} tokens" in outcome.detail, outcome
    live = stats(ours[2])
    moved = shortest_moved <= 2 * 48
    assert (live.packed, live.short) == ((LAYERS * 3, 0) if moved else (0, LAYERS * 3))


@pytest.mark.parametrize("reentrant", [False, True])
def test_some_layers_move_and_train_exactly_as_stock(reentrant, tmp_path, every_input):
    """offload_checkpoints_layers=2 of 3: layers 0 and 2 (the first's input copied back when the backward takes the
    third's, two layers ahead of its need; the middle layer's input held on the device as stock checkpointing holds
    it); training is stock's, bit for bit."""
    count = LAYERS - 1
    stock = train(lora_model, tmp_path, None, reentrant)
    ours = train(lora_model, tmp_path, {"offload_checkpoints": True, "offload_checkpoints_layers": count}, reentrant)
    assert_same_run(stock, ours)
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert len(outcome.targets) == count and f"{count} of {LAYERS} decoder layers" in outcome.detail, outcome
    live = stats(ours[2])
    assert live.packed == count * 3 and live.waited == 0 and live.fetched_ahead == (count - 1) * 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_embedding_output_is_freed_after_the_forward(reentrant, tmp_path, every_input):
    """PEFT's input-gradient hook makes the embedding output a leaf that requires grad, which autograd would hold on
    the GPU until the backward ends: handed to layer 0 without that gradient, it is freed after the forward (the
    device holds the newest layer input only, as for the other layers) and training is stock's, bit for bit."""

    def make():
        model = lora_model()
        model.enable_input_require_grads()
        return model

    stock = train(make, tmp_path, None, reentrant)
    ours = train(make, tmp_path, {"offload_checkpoints": True}, reentrant)
    assert_same_run(stock, ours)
    assert (stats(ours[2]).sunk, stats(ours[2]).leaves) == (3, 0)
    model = ours[2].model
    outputs = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    ids = torch.randint(0, VOCAB, (2, 48), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    hook.remove()
    gc.collect()
    assert outputs[0]() is None
    loss.backward()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_qlora_trains_exactly_as_stock_checkpointing(tmp_path, every_input):
    stock = train(lambda: lora_model(quantized=True), tmp_path, None)
    ours = train(lambda: lora_model(quantized=True), tmp_path, {"offload_checkpoints": True})
    assert_same_run(stock, ours)


def test_compiled_layers_with_offload_train_as_compiled_layers_alone(tmp_path, every_input):
    """The offload itself is exact: the same compiled layers with and without it (their gated MLPs on autograd's
    backward in both, the default). With the MLPs' backward in 2 row chunks as well (another rounding order) the
    losses stay within bf16 rounding of the layers alone."""
    same = {"compile_layers": True}
    torch._dynamo.reset()
    compiled = train(lora_model, tmp_path, {"offload_checkpoints": False, **same})
    torch._dynamo.reset()
    both = train(lora_model, tmp_path, {"offload_checkpoints": True, **same})
    torch._dynamo.reset()
    assert_same_run(compiled, both)
    assert both[2].leantrain_report["compile_layers"].status is Status.APPLIED
    chunked = train(
        lora_model, tmp_path, {"offload_checkpoints": True, "compile_layers": True, "compile_layers_mlp_chunks": 2}
    )
    torch._dynamo.reset()
    detail = chunked[2].leantrain_report["compile_layers"].detail
    assert "gated LoRA MLPs run their backward in 2 row chunks" in detail
    assert "gated LoRA MLPs" not in both[2].leantrain_report["compile_layers"].detail
    for ours, theirs in zip(chunked[0], compiled[0], strict=True):
        assert abs(ours - theirs) <= 8 * 2.0**-8 * abs(theirs)  # bf16's rounding of a few steps' updates


def test_gradient_accumulation_trains_as_stock(tmp_path, every_input):
    stock = train(lora_model, tmp_path, None, gradient_accumulation_steps=2, max_steps=2)
    ours = train(lora_model, tmp_path, {"offload_checkpoints": True}, gradient_accumulation_steps=2, max_steps=2)
    assert_same_run(stock, ours)


@pytest.mark.expect_fallback
def test_no_pinned_memory_falls_back_to_stock_checkpointing(tmp_path, every_input, monkeypatch):
    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(offload_ops, "pinned_buffer", refuse)  # the pool's first pinned buffer is refused
    stock = train(lora_model, tmp_path, None)
    with pytest.warns(RuntimeWarning, match="offload_checkpoints failed at run time"):
        ours = train(lora_model, tmp_path, {"offload_checkpoints": True})
    assert_same_run(stock, ours)
    assert ours[2].leantrain_report["offload_checkpoints"].status is Status.FAILED
