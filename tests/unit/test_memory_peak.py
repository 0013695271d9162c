"""benchmarks/memory_peak.py: the replay of an allocator trace into what is alive at the peak (made-up traces)."""

from __future__ import annotations

import memory_peak as mp


def frames(*names: str) -> list[dict]:
    return [{"filename": name, "line": 1, "name": "f"} for name in names]


MLP = "/x/site-packages/transformers/models/llama/modeling_llama.py"
PLUMB = "/x/site-packages/torch/nn/modules/module.py"


def test_the_peak_counts_blocks_from_alloc_to_completed_free():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames(PLUMB, MLP)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames(MLP)},
        {"action": "free_requested", "addr": 1, "size": 100},  # a side stream still reads it
        {"action": "alloc", "addr": 3, "size": 30, "frames": []},  # peak: 100 + 50 + 30 (+ 10 before the trace)
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 3, "size": 30},
        {"action": "alloc", "addr": 4, "size": 60, "frames": []},  # 50 + 60 + 10: below the peak
    ]
    peak, live = mp.live_at_peak(trace, start_bytes=10)
    assert peak == 190 and sorted(b["addr"] for b in live) == [1, 2, 3]


def test_a_free_of_a_block_from_before_the_trace_lowers_the_total():
    trace = [
        {"action": "free_requested", "addr": 9, "size": 80},  # allocated before the trace began
        {"action": "alloc", "addr": 1, "size": 50, "frames": []},
    ]
    peak, live = mp.live_at_peak(trace, start_bytes=100)
    assert peak == 100 and live == []  # 100 - 80 + 50 = 70 never passes the start


def test_groups_are_labelled_by_the_first_frame_past_torch_plumbing():
    blocks = [
        {"size": mp.GIB, "frames": frames(PLUMB, MLP)},
        {"size": mp.GIB // 2, "frames": frames(MLP)},
        {"size": 3, "frames": []},
    ]
    rows = mp.group_blocks(blocks)
    assert rows[0] == {"where": "transformers/models/llama/modeling_llama.py:1 f", "gib": 1.5, "blocks": 2}
    assert rows[1]["where"] == "(no python frame)"
    assert mp.frame_label(frames(PLUMB)) == "torch/nn/modules/module.py (torch internals)"


def test_groups_past_the_top_are_one_row():
    blocks = [{"size": mp.GIB * (i + 1), "frames": frames(f"/s/{i}.py")} for i in range(5)]
    rows = mp.group_blocks(blocks, top=2)
    assert [r["where"] for r in rows] == ["4.py:1 f", "3.py:1 f", "(others)"]
    assert rows[-1] == {"where": "(others)", "gib": 6.0, "blocks": 3}


def test_a_peak_before_the_traced_step_does_not_count():
    trace = [
        {"action": "alloc", "addr": 1, "size": 500, "frames": []},  # an earlier step's peak
        {"action": "free_completed", "addr": 1, "size": 500},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},  # the traced step starts here
        {"action": "alloc", "addr": 3, "size": 20, "frames": []},
    ]
    peak, live = mp.live_at_peak(trace, start_bytes=10, from_event=2)
    assert peak == 80 and sorted(b["addr"] for b in live) == [2, 3]
    assert mp.live_at_peak(trace, start_bytes=10)[0] == 510


def test_generated_code_frames_carry_their_source_line(tmp_path):
    code = tmp_path / "torchinductor_root" / "ab" / "cab.py"
    code.parent.mkdir(parents=True)
    code.write_text("def call(args):\n    buf0 = empty_strided_cuda((4, 2048, 8192), (1, 1, 1), torch.bfloat16)\n")
    label = mp.frame_label([{"filename": str(code), "line": 2, "name": "call"}])
    assert label == "root/ab/cab.py:2 call | buf0 = empty_strided_cuda((4, 2048, 8192), (1, 1, 1), torch.bfloat16)"


def test_the_context_is_the_innermost_frame_in_model_code():
    generated = "/tmp/torchinductor_root/ab/cab.py"
    assert mp.context_label(frames(generated, PLUMB, MLP)) == "transformers/models/llama/modeling_llama.py:1 f"
    assert mp.context_label(frames(generated, PLUMB)) == "(outside model code)"
    rows = mp.group_blocks([{"size": mp.GIB, "frames": frames(PLUMB, MLP)}], label=mp.context_label)
    assert rows == [{"where": "transformers/models/llama/modeling_llama.py:1 f", "gib": 1.0, "blocks": 1}]


def test_phase_marks_follow_the_layers_forward_then_backward(monkeypatch, tmp_path):
    """The marks of one step: step begins, each layer's forward end in order, each layer's backward start in reverse
    (a checkpoint's recompute adds no forward marks), the step's end; the other steps add none. The memory figures
    come from torch.cuda (a counter stands in for it on CPU: each read one more byte)."""
    import torch
    from transformers import Trainer, TrainingArguments

    from leantrain.cli.tiny import tiny_model
    from testkit.batches import pad_right, random_rows

    reads = iter(range(10_000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: next(reads))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2 * mp.GIB)
    rec: dict = {}
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_steps=3,
                             per_device_train_batch_size=2, gradient_checkpointing=True, disable_tqdm=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    model = tiny_model("llama", vocab_size=128, hidden=32, layers=3).train()
    trainer = Trainer(model=model, args=args, train_dataset=random_rows(8, (12,), 128), data_collator=pad_right)
    trainer.add_callback(mp.phase_marks_callback(rec, 2))
    trainer.train()
    events = [m["at"] for m in rec["phase_marks"]["marks"]]
    assert rec["phase_marks"]["step"] == 2
    forward = [f"layer {i} forward ends" for i in range(3)]
    backward = [f"layer {i} backward starts" for i in (2, 1, 0)]
    assert events == ["step begins", *forward, *backward, "step ends (after the optimizer step)"]
    assert all(m["peak_so_far_gib"] == 2.0 for m in rec["phase_marks"]["marks"])
