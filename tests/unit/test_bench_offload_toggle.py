"""benchmarks/bench_offload_toggle.py: the plan of paused and offloaded steps, the pairs' ratios, the partial writes,
bad arguments, and the CPU smoke run (the hooks really paused on the paused steps and moving inputs on the others;
the profiled windows and the partial results)."""

from __future__ import annotations

import json

import bench_offload_toggle as toggle
import pytest


def test_the_plan_warms_both_up_then_puts_one_of_each_in_every_pair_in_a_seeded_order():
    plan = toggle.plan_steps(warmup=4, pairs=40, seed=3)
    assert plan[:4] == [False, True, False, True] and len(plan) == 4 + 80
    pairs = [tuple(plan[k : k + 2]) for k in range(4, len(plan), 2)]
    assert set(pairs) == {(True, False), (False, True)}  # both orders occur, never two of a kind
    assert plan == toggle.plan_steps(4, 40, 3) and plan != toggle.plan_steps(4, 40, 4)


def test_paired_batches_train_each_batch_twice_in_a_row_in_a_seeded_order():
    datasets = pytest.importorskip("datasets")
    from torch.utils.data import DataLoader

    class Args:
        per_device_train_batch_size, gradient_accumulation_steps = 2, 2

    class Trainer:
        args, train_dataset = Args(), datasets.Dataset.from_dict({"row": list(range(10))})

    trainer = Trainer()
    toggle.paired_batches(trainer, seed=1)
    sampler = trainer._get_train_sampler()
    rows = [
        int(r) for r in DataLoader(trainer.train_dataset, batch_size=4, sampler=sampler).__iter__().__next__()["row"]
    ]
    steps = [
        [trainer.train_dataset[i]["row"] for i in range(k, k + 4)] for k in range(0, len(trainer.train_dataset), 4)
    ]
    assert rows == steps[0] and len(steps) == 4  # two batches of 4 rows (the 2 left over dropped), each twice
    assert steps[0] == steps[1] and steps[2] == steps[3] and steps[0] != steps[2]
    assert sorted(steps[0] + steps[2]) == sorted(set(steps[0] + steps[2]))  # no row twice within the epoch's batches
    again = Trainer()
    again.train_dataset = datasets.Dataset.from_dict({"row": list(range(10))})
    toggle.paired_batches(again, seed=1)
    assert again.train_dataset["row"] == trainer.train_dataset["row"]  # seeded
    few = Trainer()
    few.train_dataset = datasets.Dataset.from_dict({"row": [0, 1, 2]})
    with pytest.raises(SystemExit, match="fewer than a step's 4"):
        toggle.paired_batches(few, seed=0)


def test_the_profiled_windows_follow_the_pairs_paused_first():
    plan = toggle.plan_steps(warmup=2, pairs=3, seed=0, profile=2)
    assert plan[:8] == toggle.plan_steps(2, 3, 0) and plan[8:] == [True, True, False, False]


def test_the_pairs_done_are_written_every_so_many_pairs_but_not_after_the_last(monkeypatch):
    monkeypatch.setattr(toggle, "PARTIAL_EVERY", 2)
    written = []
    partial = toggle.Partial(written.append, warmup=4, pairs=5)
    for step in range(1, 4 + 2 * 5 + 3):  # the trainer's global_step after each step, profiled steps after the pairs
        partial.on_step_end(None, type("State", (), {"global_step": step})(), None)
    assert written == [2, 4]  # after pair 2 (step 8) and pair 4 (step 12); pair 5 is the finished run's


def test_a_pairs_ratio_is_the_paused_step_over_the_offloaded_one_and_compiling_pairs_are_dropped():
    plan = [False, True, True, False, False, True, True, False]
    ms = [9.0, 9.0, 110.0, 100.0, 100.0, 120.0, 50.0, 50.0]
    compiled = [True, False, False, False, False, False, False, True]
    # warm-up (2 steps) dropped; pair 1 paused first: 110 / 100; pair 2 offloaded first: 120 / 100; pair 3 compiled
    assert toggle.pair_ratios(plan, ms, compiled, warmup=2) == [1.1, 1.2]


def test_the_hook_clock_times_every_pack_and_unpack_and_the_hooks_still_move_the_inputs():
    import torch
    from torch.utils.checkpoint import checkpoint

    from leantrain.offload_checkpoints.ops import HostOffload

    offload = HostOffload(budget_bytes=1 << 30)
    clock = toggle.HookClock(offload)
    x = torch.randn(8, 4, requires_grad=True)
    h = x * 2.0  # not a leaf: the hooks move it
    for _ in range(3):
        with offload.context():
            h = checkpoint(torch.sin, h, use_reentrant=False)
    h.sum().backward()
    pack_ms, unpack_ms, packs, unpacks = clock.totals()
    assert offload.stats.packed == 3 and packs >= 3 and unpacks >= 3  # each moved input went through the clock
    assert pack_ms > 0 and unpack_ms > 0
    assert toggle.hook_medians([(1.0, 2.0, 3, 3), (3.0, 1.0, 3, 3), (2.0, 2.0, 3, 3)]) == {
        "pack": 2.0,
        "unpack": 2.0,
        "pack_calls": 3,
        "unpack_calls": 3,
        "both": 4.0,
    }
    assert toggle.hook_medians([]) == {}


@pytest.mark.parametrize(("nbytes", "moved"), [(16, 16), (0, 8 * 64 * 4)])
def test_kept_on_device_the_hooks_copy_each_input_or_its_head_and_hand_back_the_input_itself(nbytes, moved):
    import torch
    from torch.utils.checkpoint import checkpoint

    from leantrain.offload_checkpoints.ops import HostOffload

    def chain(offload=None):
        torch.manual_seed(0)
        x = torch.randn(8, 64, requires_grad=True)
        h = x * 2.0
        for _ in range(3):
            if offload is None:
                h = checkpoint(torch.sin, h, use_reentrant=False)
                continue
            with offload.context():
                h = checkpoint(torch.sin, h, use_reentrant=False)
        h.sum().backward()
        return x.grad

    offload = HostOffload(budget_bytes=1 << 30)
    toggle.KeptOnDevice(offload, nbytes)
    clock = toggle.HookClock(offload)  # made after: it times the diagnostic's hooks
    grad = chain(offload)
    assert offload.stats.packed == 3 and offload.stats.packed_bytes == 3 * moved  # each copy moved that much
    assert clock.totals()[2] >= 3 and clock.totals()[3] >= 3
    assert torch.equal(grad, chain())  # the inputs themselves came back


def test_the_gc_clock_counts_and_times_each_generations_collections_until_closed():
    import gc

    clock = toggle.GcClock()
    try:
        before = clock.totals()
        gc.collect(0)
        gc.collect(2)
        after = clock.totals()
    finally:
        clock.close()
    assert after[3] - before[3] >= 1 and after[5] - before[5] >= 1  # one of generation 0, one of generation 2
    assert after[0] >= before[0] and after[2] > before[2]
    gc.collect(0)
    assert clock.totals() == after  # closed: no longer observing
    summary = toggle.gc_summary([(1.0, 0.0, 0.0, 2, 0, 0), (0.5, 0.5, 3.0, 1, 1, 1)])
    assert summary == {"median_ms": 2.5, "max_ms": 4.0, "ms_by_generation": [1.5, 0.5, 3.0],
                       "count_by_generation": [3, 1, 1]}  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--smoke", "--case", "nope"], "unknown case"),
        (["--smoke", "--case", "tiny-moe-qlora"], "dense case"),
        (["--smoke", "--warmup", "1"], "--warmup even"),
        (["--smoke", "--pairs", "0"], "--pairs must be positive"),
        (["--smoke", "--profile", "-1"], "--profile, --logging-steps, --copy-bytes and --batch not negative"),
        (["--smoke", "--logging-steps", "-1"], "--logging-steps, --copy-bytes and --batch not negative"),
        (["--smoke", "--copy-bytes", "-1"], "--logging-steps, --copy-bytes and --batch not negative"),
        (["--smoke", "--batch", "-1"], "--copy-bytes and --batch not negative"),
    ],
)
def test_bad_arguments_stop_before_any_work(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        toggle.main([*argv, "--out", str(tmp_path)])


@pytest.mark.slow
def test_smoke_pauses_the_hooks_on_the_paused_steps_only(tmp_path):
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    toggle.main(["--smoke", "--pairs", "3", "--batch", "3", "--out", str(tmp_path)])
    rows = {r["provider"]: r for r in json.loads((tmp_path / "offload_toggle.json").read_text())}
    assert all(r["config"]["batch"] == 3 and r["config"]["seq"] == 64 for r in rows.values())  # --batch: 3 rows a step
    assert rows["paused"]["config"]["packed_per_step"] == 0 and rows["offload"]["config"]["packed_per_step"] > 0
    offload = rows["offload"]["config"]
    assert offload["pairs_kept"] == 3 and len(offload["pair_ratios"]) == 3 and offload["pair_median"] > 0
    low, high = offload["pair_interval"]
    assert low <= offload["pair_median"] <= high
    assert rows["paused"]["config"]["steps_kept"] == rows["offload"]["config"]["steps_kept"] == 3
    text = (tmp_path / "offload_toggle.md").read_text()
    assert "median of the pairs' ratios" in text and "tiny-llama (3 x 64)" in text
    assert (tmp_path / "offload_toggle.png").stat().st_size > 0


@pytest.mark.slow
def test_smoke_profiles_both_variants_and_keeps_partial_results_on_the_way(tmp_path, monkeypatch):
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    monkeypatch.setattr(toggle, "PARTIAL_EVERY", 1)
    partial = []
    write = toggle.write

    def spy(rows, out, note=""):
        where = write(rows, out, note)
        if note:
            partial.append((note, json.loads((where / "offload_toggle.json").read_text())[1]["config"]))
        return where

    monkeypatch.setattr(toggle, "write", spy)
    toggle.main(
        [
            "--smoke",
            "--pairs",
            "3",
            "--profile",
            "1",
            "--logging-steps",
            "4",
            "--time-hooks",
            "--time-gc",
            "--gc-freeze",
            "--out",
            str(tmp_path),
        ]
    )
    assert [note for note, _ in partial] == ["1 of 3 pairs", "2 of 3 pairs"]
    assert partial[0][1]["partial"] == "1 of 3 pairs" and partial[0][1]["pairs_kept"] == 1
    final = json.loads((tmp_path / "offload_toggle.json").read_text())
    assert "partial" not in final[1]["config"] and final[1]["config"]["pairs_kept"] == 3  # profiled steps apart
    assert final[0]["config"]["steps_kept"] == 3 and final[0]["config"]["logging_steps"] == 4
    assert "the trainer logging every 4 step(s)" in (tmp_path / "offload_toggle.md").read_text()
    timed = final[1]["config"]["hooks_host_ms"]  # the hooks timed on the offloaded steps only
    assert timed["pack_calls"] > 0 and timed["both"] > 0 and "hooks_host_ms" not in final[0]["config"]
    assert "The host inside the offload's hooks" in (tmp_path / "offload_toggle.md").read_text()
    assert all(row["config"]["gc"]["count_by_generation"] and row["config"]["gc_freeze"] for row in final)
    assert "frozen out of the scans" in (tmp_path / "offload_toggle.md").read_text()
    profiled = json.loads((tmp_path / "offload_toggle_profile.json").read_text())
    assert profiled["steps"] == 1 and len(profiled["paused"]["step_ms"]) == len(profiled["offload"]["step_ms"]) == 1
    assert profiled["paused"]["host_ops"] and profiled["offload"]["host_ops"]  # the CPU's ops (no GPU on CPU)
    assert "host's ops (inclusive time) that differ most" in (tmp_path / "offload_toggle_profile.md").read_text()


def test_summary_plots_the_runs_given_and_refuses_a_file_without_pair_ratios(tmp_path):
    def run_file(name, ratios):
        config = {"pair_ratios": ratios, "summed_ratio": 0.98}
        rows = [{"provider": "paused", "config": {}}, {"provider": "offload", "config": config}]
        path = tmp_path / f"offload_toggle_{name}.json"
        path.write_text(json.dumps(rows))
        return str(path)

    runs = [run_file("llama_run1", [0.96, 0.99, 1.01]), run_file("qlora_run1", [0.97, 1.0])]
    assert toggle.main(["--summary", *runs, "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "offload_toggle_summary.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no offload row with pair ratios"):
        toggle.main(["--summary", run_file("empty", []), "--out", str(tmp_path)])


def test_tradeoff_plots_peak_against_cost_per_case_with_unsloths_peak(tmp_path):
    def run_file(name, case, ratio, peaks, layers=None):
        trainer = {"offload_checkpoints": "True"} | ({"offload_checkpoints_layers": str(layers)} if layers else {})
        offload = {"pair_median": ratio, "peak_gib": peaks[1], "patch_trainer": trainer}
        rows = [
            {"provider": "paused", "x_value": case, "config": {"peak_gib": peaks[0]}},
            {"provider": "offload", "x_value": case, "config": offload},
        ]
        path = tmp_path / f"offload_toggle_{name}.json"
        path.write_text(json.dumps(rows))
        return path

    rounds = tmp_path / "vs_unsloth_rounds.json"
    rounds.write_text(json.dumps([
        {"provider": "unsloth", "metric": "memory", "x_value": "llama", "p50": 3.30},
        {"provider": "unsloth", "metric": "memory", "x_value": "llama", "p50": 3.31},
        {"provider": "unsloth", "metric": "step_time", "x_value": "llama", "p50": 180.0},
        {"provider": "leantrain_offload", "metric": "memory", "x_value": "llama", "p50": 3.29},
    ]))  # fmt: skip
    files = [
        run_file("llama_run1", "llama", 0.98, (3.70, 3.30)),
        run_file("llama_half1", "llama", 0.99, (3.70, 3.51), layers=8),
        run_file("qlora_run1", "qlora", 0.96, (2.33, 1.90)),
        rounds,
    ]
    points, unsloth = toggle.trade_points(files)
    assert unsloth == {"llama": 3.31}  # the highest of Unsloth's rounds; other providers and metrics ignored
    assert [(m, round(c, 4), p) for m, c, p in points["llama"]] == [
        ("stock", 0.0, 3.70),
        ("every layer", round(1 / 0.98 - 1, 4), 3.30),
        ("8 layers", round(1 / 0.99 - 1, 4), 3.51),
    ]
    assert toggle.main(["--tradeoff", *map(str, files), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "offload_toggle_tradeoff.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no offload_toggle run"):
        toggle.main(["--tradeoff", str(rounds), "--out", str(tmp_path)])


def test_by_size_plots_each_every_layer_run_cost_against_its_tokens(tmp_path):
    def run_file(name, case, ratio, tokens, **trainer):
        config = {"pair_median": ratio, "tokens": tokens, "seed": 0, "paired_batches": True}
        config["patch_trainer"] = {"offload_checkpoints": "True", **trainer}
        rows = [{"provider": "paused", "x_value": case, "config": {}}, {"provider": "offload", "x_value": case,
                "config": config}]  # fmt: skip
        path = tmp_path / f"offload_toggle_{name}.json"
        path.write_text(json.dumps(rows))
        return path

    files = [
        run_file("llama_run1", "llama", 0.97, 8192),
        run_file("llama_b8_run1", "llama", 0.995, 16384),
        run_file("llama_half1", "llama", 0.99, 8192, offload_checkpoints_layers="8"),  # another trade: left out
        run_file("llama_auto1", "llama", 1.0, 16000, offload_checkpoints="None"),  # auto mode: left out
        run_file("qlora_run1", "qlora", 0.95, 8192),
    ]
    points = toggle.size_points(files)
    assert {case: [(t, round(c, 4)) for t, c in marks] for case, marks in points.items()} == {
        "llama": [(8192, round(1 / 0.97 - 1, 4)), (16384, round(1 / 0.995 - 1, 4))],
        "qlora": [(8192, round(1 / 0.95 - 1, 4))],
    }
    assert toggle.main(["--by-size", *map(str, files), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "offload_toggle_by_size.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="moved every layer"):
        toggle.size_plot(files[2:4], tmp_path / "none.png", 16384)
    (tmp_path / "other.json").write_text(json.dumps([{"provider": "stock", "x_value": "llama", "config": {}}]))
    with pytest.raises(SystemExit, match="no offload row with a pairs' median"):
        toggle.size_points([tmp_path / "other.json"])
