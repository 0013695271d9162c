"""benchmarks/bench_step_ab.py: option parsing, and the CPU smoke run of one trainer's step stock and patched in
alternating segments (the rows, the table, the profile and that the trainer is left unpatched)."""

from __future__ import annotations

import json
import math
import types

import bench_step_ab as ab  # noqa: E402
import pytest
import torch


def test_options_parse_as_python_literals_else_strings_and_bad_pairs_stop():
    opts = ab.parse_opts(["compile_layers=False", "compile_layers_mlp_chunks=2", "recompute=elementwise"])
    assert opts == {"compile_layers": False, "compile_layers_mlp_chunks": 2, "recompute": "elementwise"}
    for bad in ("compile_layers", "=True"):
        with pytest.raises(SystemExit, match="name=value"):
            ab.parse_opts([bad])


def test_inductor_settings_reach_sub_configs_and_unknown_names_stop(monkeypatch):
    from torch._inductor import config

    settings = ab.inductor_settings(["triton.autotune_pointwise=False", "compile_threads=3"])
    assert settings == {"triton.autotune_pointwise": False, "compile_threads": 3}
    monkeypatch.setattr(config.triton, "autotune_pointwise", True)
    monkeypatch.setattr(config, "compile_threads", config.compile_threads)
    ab.apply_inductor_settings(settings)
    assert config.triton.autotune_pointwise is False and config.compile_threads == 3
    for bad in ("triton.no_such_knob=1", "no_such.knob=1", "no_such_knob=1"):
        with pytest.raises(SystemExit, match="torch._inductor.config has no"):
            ab.inductor_settings([bad])


def test_bad_arguments_stop_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="at least 2"):
        ab.main(["--smoke", "--steps", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown case"):
        ab.main(["--smoke", "--case", "nope", "--out", str(tmp_path)])


@pytest.mark.slow
def test_smoke_alternates_variants_and_writes_rows_table_and_profiles(tmp_path, monkeypatch):
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    import leantrain

    unpatched = []
    real_unpatch = leantrain.unpatch_trainer
    monkeypatch.setattr(leantrain, "unpatch_trainer", lambda t: (real_unpatch(t), unpatched.append(t))[0])
    ab.main(["--smoke", "--pairs", "2", "--steps", "3", "--profile", "--trace", "--base-opt", "compile_layers=False",
             "--opt", "compile_layers=False", "--opt", "fused_ce=False", "--out", str(tmp_path)])  # fmt: skip
    rows = {r["provider"]: r for r in json.loads((tmp_path / "step_ab.json").read_text())}
    assert set(rows) == {"base", "leantrain"}
    for row in rows.values():
        assert len(row["config"]["segment_medians_ms"]) == 2 and row["p50"] > 0 and row["config"]["patched"]
        assert len(row["config"]["first_step_ms"]) == 2 and min(row["config"]["first_step_ms"]) > 0
        assert row["config"]["compiling_steps_dropped"] == 0 and row["config"]["pair_speedup"] > 0
        assert row["config"]["same_batch_steps"] == [2, 2] and row["config"]["same_batch_speedup"] > 0
    assert rows["base"]["config"]["pair_speedup"] == 1.0 and rows["base"]["config"]["same_batch_speedup"] == 1.0
    assert rows["leantrain"]["config"]["patch_trainer"] == {"compile_layers": "False", "fused_ce": "False"}
    # both variants patched, each of its 3 segments (2 timed, 1 profiled) unpatched after it
    assert len(unpatched) == 6 and "leantrain_report" not in unpatched[-1].__dict__
    text = (tmp_path / "step_ab.md").read_text()
    assert "patch_trainer(compile_layers=False, fused_ce=False)" in text and "speed-up vs base" in text
    assert "speed-up vs base, median of the pairs" in text
    for variant in ("stock", "leantrain"):  # the profile files are named by the segment's role
        profile = (tmp_path / f"step_ab_tiny-llama_{variant}_profile.txt").read_text()
        assert profile.startswith("steps after the first:") and "aten::mm" in profile
        trace = json.loads((tmp_path / f"step_ab_tiny-llama_{variant}_profile_trace.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])


@pytest.mark.slow
def test_a_run_stopped_after_a_pair_keeps_that_pair_marked_partial(tmp_path, monkeypatch):
    """A run its time limit stops (here: its third segment raises) has written the pairs it finished, marked partial;
    a run that finishes leaves no such mark."""
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    real_segment, calls = ab.segment, []

    def segment_then_stop(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("the call's time limit")
        return real_segment(*args, **kwargs)

    monkeypatch.setattr(ab, "segment", segment_then_stop)
    argv = ["--smoke", "--pairs", "3", "--steps", "2", "--base-opt", "compile_layers=False", "--opt",
            "compile_layers=False", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        ab.main(argv)
    rows = {r["provider"]: r for r in json.loads((tmp_path / "step_ab.json").read_text())}
    assert set(rows) == {"base", "leantrain"}
    for row in rows.values():
        assert row["config"]["partial"] == "1 of 3 pairs" and len(row["config"]["segment_medians_ms"]) == 1
    assert "**Partial: 1 of 3 pairs**" in (tmp_path / "step_ab.md").read_text()
    monkeypatch.setattr(ab, "segment", real_segment)
    ab.main(argv)
    rows = json.loads((tmp_path / "step_ab.json").read_text())
    assert all("partial" not in r["config"] and len(r["config"]["segment_medians_ms"]) == 3 for r in rows)
    assert "Partial" not in (tmp_path / "step_ab.md").read_text()


@pytest.mark.slow
def test_padding_free_benchmark_alternates_padded_and_padding_free_batches(tmp_path):
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    import bench_padding_free

    bench_padding_free.main(["--smoke", "--pairs", "1", "--steps", "2", "--out", str(tmp_path)])
    rows = {r["provider"]: r for r in json.loads((tmp_path / "padding_free.json").read_text())}
    assert rows["base"]["config"]["patch_trainer"] == {"padding_free": "False"}
    assert rows["leantrain"]["config"]["patch_trainer"] == {"padding_free": "True"}
    assert rows["leantrain"]["x_value"] == "tiny-llama-varlen" and rows["leantrain"]["p50"] > 0
    # padded against packed batches: no step has the same input shapes in both, so no same-batch ratio
    assert rows["leantrain"]["config"]["same_batch_steps"] == [0]
    assert math.isnan(rows["leantrain"]["config"]["same_batch_speedup"])
    text = (tmp_path / "padding_free.md").read_text()
    assert "peak alloc GiB" in text and "no step matched" in text


def test_each_segment_replays_the_same_varying_length_batches(tmp_path, monkeypatch):
    """The same-batch ratio rests on every segment training the run's batches in the same order (the trainer's
    seeded sampler restarts at each train()): on varying lengths each step's input shapes differ from the next
    step's, and a pair's two segments see the same shapes step by step."""
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    segments = []
    real_steps = ab.StepTimes.steps
    monkeypatch.setattr(ab.StepTimes, "steps", lambda self: segments.append(real_steps(self)) or segments[-1])
    ab.main(["--smoke", "--case", "tiny-llama-varlen", "--pairs", "1", "--steps", "4", "--base-opt",
             "compile_layers=False", "--opt", "compile_layers=False", "--out", str(tmp_path)])  # fmt: skip
    first, second = ([step.batch for step in segment] for segment in segments)
    assert first == second and len(first) == 4 and len(set(first)) > 1 and all(len(b) == 1 for b in first)
    rows = {r["provider"]: r for r in json.loads((tmp_path / "step_ab.json").read_text())}
    assert rows["leantrain"]["config"]["same_batch_steps"] == [3]


def test_device_intervals_keep_kernels_and_copies_not_annotations():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device_type, start, end, annotation=False):
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, device_type=device_type, time_range=span, is_user_annotation=annotation)

    d2h = "Memcpy DtoH (Device -> Pinned)"
    events = [event("aten::mm", DeviceType.CPU, 0, 500), event("nvjet_gemm", DeviceType.CUDA, 10, 510),
              event(d2h, DeviceType.CUDA, 100, 350), event("ProfilerStep#2", DeviceType.CUDA, 0, 2000),
              event("layer", DeviceType.CUDA, 0, 900, annotation=True)]  # fmt: skip
    assert ab.device_intervals(events) == [("nvjet_gemm", 10, 510), (d2h, 100, 350)]


def test_timeline_counts_overlap_once_and_the_copies_no_kernel_hides():
    """Two overlapping kernels (0-4 ms, 3-6 ms: 6 ms of kernels), a D2H copy half under them (5-7 ms: 1 ms exposed),
    an H2D copy fully under them (1-2 ms), an H2D copy alone (8-9 ms); 12 ms of steps."""
    ms, d2h, h2d = 1e3, "Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (Pinned -> Device)"
    intervals = [("gemm", 0, 4 * ms), ("softmax", 3 * ms, 6 * ms), (d2h, 5 * ms, 7 * ms), (h2d, 1 * ms, 2 * ms),
                 (h2d, 8 * ms, 9 * ms)]  # fmt: skip
    t = ab.timeline(intervals, wall_ms=12.0)
    assert t == {"kernels": 6.0, "busy": 8.0, "d2h": 2.0, "d2h_exposed": 1.0, "h2d": 2.0, "h2d_exposed": 1.0,
                 "idle": 4.0}  # fmt: skip
    text = ab.timeline_text(t, 12.0)
    assert "idle 4.0 ms (33%" in text and "device->host 2.0 ms (1.0 ms with no kernel" in text


def test_trace_needs_profile(tmp_path):
    with pytest.raises(SystemExit, match="--trace needs --profile"):
        ab.main(["--smoke", "--trace", "--out", str(tmp_path)])


class ToyDecoderLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.linear(x),)


class ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([ToyDecoderLayer(), ToyDecoderLayer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return x.square().sum()


def test_peak_phases_name_each_phase_of_a_step_and_its_peak(monkeypatch):
    """Each phase's peak is the counter's high mark since the previous phase began (a fake counter: the allocator's
    are CUDA's); the phases come in the step's order, and the peak is marked."""
    marks = iter([1.0, 2.0, 3.0, 2.5, 4.0, 3.5])  # one read a phase: a seventh would raise StopIteration
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(marks) * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    model = ToyModel()
    phases = ab.PeakPhases(model)
    phases.on_step_begin(None, None, None)
    model(torch.ones(2, 4)).backward()
    phases.on_step_end(None, None, None)
    phases.remove()
    names = [name for name, _ in phases.phases]
    assert names == [
        "step start (before layer 0)", "forward layer 0", "forward layer 1", "after the last layer (norm, head, loss)",
        "backward layer 1", "backward layer 0",
    ]  # fmt: skip
    text = phases.text()
    assert "peak allocated of the highest step (step 1 of 1, 2 tokens): 4.000 GiB" in text
    assert "after the last layer" in text
    assert [line for line in text.splitlines() if line.endswith("<- peak")] == [
        "   4.000 GiB  backward layer 1  <- peak"
    ]
    assert not model.layers[0]._forward_hooks and not model.layers[0]._forward_pre_hooks


def test_peak_phases_keep_the_highest_step_after_the_first(monkeypatch):
    """Of several steps, the phases kept are the highest step's after the first (the first's compile and first
    allocations are not the run's), with its tokens: a longer batch that peaks higher replaces a shorter one."""
    reads = iter([9.0] * 6 + [1.0] * 6 + [1.0, 1.0, 1.0, 1.0, 3.0, 1.0] + [2.0] * 6)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(reads) * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    model = ToyModel()
    phases = ab.PeakPhases(model)
    for rows in (2, 3, 5, 7):  # peaks 9 (the first step), 1, 3, 2
        phases.on_step_begin(None, None, None)
        model(torch.ones(rows, 4)).backward()
        phases.on_step_end(None, None, None)
    phases.remove()
    text = phases.text()
    assert text.startswith("peak allocated of the highest step (step 3 of 4, 5 tokens): 3.000 GiB"), text
    assert [line for line in text.splitlines() if line.endswith("<- peak")] == [
        "   3.000 GiB  backward layer 1  <- peak"
    ]


def test_memory_needs_cuda_and_a_moe_case_needs_a_base(tmp_path):
    with pytest.raises(SystemExit, match="CUDA allocator"):
        ab.main(["--smoke", "--memory", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--memory-steps"):
        ab.main(["--case", "llama-3.2-1b", "--memory", "--memory-steps", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--base-opt"):
        ab.main(["--smoke", "--case", "tiny-moe-qlora", "--out", str(tmp_path)])


def test_compile_times_name_the_phases_of_a_compile(tmp_path):
    """--compile-times writes torch.compile's time per phase, summed over the run's graphs."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.sin(x) * 2, backend="aot_eager")
    compiled(torch.randn(4))
    path = ab.write_compile_times(tmp_path, "step_ab", "tiny-llama")
    text = path.read_text()
    torch._dynamo.reset()
    assert path.name == "step_ab_tiny-llama_compile_times.txt"
    assert "TorchDynamo compilation metrics" in text and "compile_inner" in text, text


def test_steps_that_compiled_a_graph_are_dropped_and_counted(monkeypatch):
    """A step during which Dynamo compiled a graph (a new shape mid-segment) times the compiler: it leaves the
    segment's times and is counted, as the segment's first step always is."""
    graphs = iter([0, 0, 0, 0, 0, 1, 1, 1])  # step 3 of 4 compiles (read at each step's begin and end)
    monkeypatch.setattr(ab, "graphs_compiled", lambda: next(graphs))
    clock = ab.StepTimes(cuda=False)

    class Trainer:
        args = types.SimpleNamespace(max_steps=0)

        def train(self):
            for _ in range(self.args.max_steps):
                clock.on_step_begin(None, None, None)
                clock.on_step_end(None, None, None)

    kept, compiling = ab.segment(Trainer(), clock, 4)
    assert compiling == 1 and len(kept) == 2 and clock.compiled == [False, False, True, False]


def test_the_median_of_the_pairs_cancels_a_drift_the_pooled_median_keeps():
    """The host slows down by half over the run; the second variant is 2% slower than the first in every pair.
    The pooled medians read the drift; the median of the pairs reads the 2%. A pair whose segment kept no step has
    no ratio."""
    base = [[100.0 * (1 + k / 2)] * 3 for k in range(4)]
    other = [[102.0 * (1 + k / 2)] * 3 for k in range(3)] + [[]]
    rows = ab.rows_of("case", {"x": 1}, {}, {"stock": base, "leantrain": other}, {"stock": [1.0], "leantrain": [1.0]})
    assert rows[1].config["pair_speedup"] == pytest.approx(100 / 102, rel=1e-12)
    assert rows[0].config["pair_speedup"] == 1.0
    assert math.isnan(rows[1].config["segment_medians_ms"][3])
    assert "0.980x" in ab.table(rows)


def test_the_same_batch_ratio_compares_what_the_pair_medians_confound():
    """Varying lengths: a short and two long batches after the first step; the second variant is 2% slower on every
    batch and compiled during its first long one (dropped). Its segment median then comes from other batches than
    the first variant's and reads a 47% difference; the same-batch ratio drops that batch from both and reads 2%. A
    step whose input shapes differ (another batch) is not compared."""
    short, long_ = ((2, 100),), ((2, 900),)
    step = ab.Step
    base = [
        [step(900.0, True, long_), step(100.0, False, short), step(300.0, False, long_), step(300.0, False, long_)]
    ]
    other = [
        [step(950.0, True, long_), step(102.0, False, short), step(306.0, True, long_), step(306.0, False, long_)]
    ]
    times = {"stock": [[s.ms for s in base[0][1:]]], "leantrain": [[102.0, 306.0]]}
    rows = ab.rows_of(
        "case", {}, {}, times, {"stock": [1.0], "leantrain": [1.0]}, steps={"stock": base, "leantrain": other}
    )
    assert rows[1].config["pair_speedup"] == pytest.approx(300 / 204, rel=1e-12)  # the confounded reading
    assert rows[1].config["same_batch_speedup"] == pytest.approx(400 / 408, rel=1e-12)
    assert rows[1].config["same_batch_steps"] == [2] and rows[0].config["same_batch_speedup"] == 1.0
    assert "0.980x (2)" in ab.table(rows)
    assert rows[1].config["same_batch_pair_speedups"] == [pytest.approx(400 / 408, abs=1e-4)]
    # every step of the segment kept for the JSON, its first and the compiling ones included, with its tokens
    assert rows[1].config["steps"] == [
        {"ms": [950.0, 102.0, 306.0, 306.0], "compiled": [True, False, True, False], "tokens": [1800, 200, 1800, 1800]}
    ]
    moved = [[*other[0][:3], step(306.0, False, ((2, 800),))]]  # the last step trained another batch
    ratios, matched = ab.same_batch_speedups(base, moved)
    assert matched == [1] and ratios == [pytest.approx(100 / 102, rel=1e-12)]


def test_opt_inductor_holds_in_the_second_variants_segments_only(tmp_path, monkeypatch):
    """--opt-inductor: the setting is on from each leantrain segment's patch (which compiles anew) to its unpatch,
    off in the base's segments and after the run; the rows and the table say which variant had it."""
    from torch._inductor import config

    import leantrain

    seen: list[tuple[str, bool]] = []
    trainer = types.SimpleNamespace(add_callback=lambda cb: None, model=torch.nn.Linear(1, 1))
    monkeypatch.setattr(ab.vs, "prepare", lambda *a: None)
    monkeypatch.setattr(ab.vs, "hf_trainer", lambda *a: (trainer, {}))
    monkeypatch.setattr(leantrain, "patch_trainer", lambda t, **o: seen.append(("patch", config.triton.cudagraphs)))
    monkeypatch.setattr(leantrain, "unpatch_trainer", lambda t: seen.append(("unpatch", config.triton.cudagraphs)))
    monkeypatch.setattr(ab, "segment", lambda *a: (seen.append(("segment", config.triton.cudagraphs)), ([1.0], 0))[1])
    before = config.triton.cudagraphs
    assert before is False
    ab.main(["--smoke", "--pairs", "2", "--base-opt", "compile_layers=True", "--opt", "compile_layers=True",
             "--opt-inductor", "triton.cudagraphs=True", "--out", str(tmp_path)])  # fmt: skip
    assert config.triton.cudagraphs is before
    per_segment = [seen[k : k + 3] for k in range(0, len(seen), 3)]
    assert [[on for _, on in s] for s in per_segment] == [[False] * 3, [True] * 3] * 2, seen
    rows = {r["provider"]: r for r in json.loads((tmp_path / "step_ab.json").read_text())}
    assert rows["leantrain"]["config"]["own_inductor"] == {"triton.cudagraphs": "True"}
    assert rows["base"]["config"]["own_inductor"] == {}
    table = (tmp_path / "step_ab.md").read_text()
    both = "patch_trainer(compile_layers=True, compile_layers_background=False)"  # compiled in the process
    assert f"| {both}, inductor triton.cudagraphs=True |" in table
    assert "second variant's segments: triton.cudagraphs=True" in table and "skipped CUDA graphs" not in table
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 2)
    ab.main(["--smoke", "--pairs", "1", "--base-opt", "compile_layers=True", "--opt", "compile_layers=True",
             "--opt-inductor", "triton.cudagraphs=True", "--out", str(tmp_path)])  # fmt: skip
    assert "Inductor skipped CUDA graphs on 2 compiled graphs" in (tmp_path / "step_ab.md").read_text()
    with pytest.raises(SystemExit, match="torch._inductor.config has no"):
        ab.main(["--smoke", "--opt-inductor", "triton.no_such_knob=1", "--out", str(tmp_path)])
