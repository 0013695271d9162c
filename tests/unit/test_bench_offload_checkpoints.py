"""benchmarks/bench_offload_checkpoints.py without a GPU: the bisection of --longest (against fake predicates), the
command line (defaults per mode, bad input exits 2), how a worker's exit becomes a record, the rows, tables and
verdicts built from fake records, --merge, and that --help works and a CUDA-less run stops with one line. Nothing is
timed and nothing trains here."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import _harness
import bench_offload_checkpoints as bench  # noqa: E402
import offload_checkpoints_tables as rows_of  # noqa: E402
import pytest
import torch


SCRIPT = Path(bench.__file__)


# -- the bisection ---------------------------------------------------------------------------------------------------


class Probe:
    """A fake ``fits``: lengths up to ``limit`` fit; records every length asked."""

    def __init__(self, limit: int) -> None:
        self.limit, self.asked = limit, []

    def __call__(self, n: int) -> bool:
        self.asked.append(n)
        return n <= self.limit


def bound(low: int, high: int, step: int) -> int:
    """Calls a bisection may make: ``low``, then one per halving of the grid."""
    return 1 + math.ceil(math.log2((high - low) // step + 1))


def test_nothing_fits_asks_only_the_shortest():
    probe = Probe(limit=512)
    assert bench.longest_fitting(probe, 1024, 131072, 256) is None
    assert probe.asked == [1024]


def test_everything_fits_reaches_the_ceiling_within_the_log_bound():
    probe = Probe(limit=10**9)
    assert bench.longest_fitting(probe, 1024, 131072, 256) == 131072
    assert len(probe.asked) <= bound(1024, 131072, 256)


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(1024, 1024), (1279, 1024), (1280, 1280), (5000, 4864), (4864, 4864), (65537, 65536), (131071, 130816)],
)
def test_a_monotone_boundary_gives_the_longest_grid_length_below_it(limit, expected):
    probe = Probe(limit)
    assert bench.longest_fitting(probe, 1024, 131072, 256) == expected
    assert len(probe.asked) <= bound(1024, 131072, 256)  # ~10 probes, not 509
    assert all(n % 256 == 0 and 1024 <= n <= 131072 for n in probe.asked)  # only grid lengths are run
    assert len(set(probe.asked)) == len(probe.asked)  # no length is probed twice


def test_the_answer_is_a_length_that_was_seen_to_fit_even_when_probes_are_noisy():
    seen = {}

    def flaky(n: int) -> bool:  # not monotone: 2048 fails once (a noisy probe), longer ones fit
        seen[n] = n != 2048 and n <= 9000
        return seen[n]

    found = bench.longest_fitting(flaky, 1024, 16384, 256)
    assert seen[found] is True


def test_one_point_range_and_bad_ranges():
    assert bench.longest_fitting(Probe(2048), 2048, 2048, 256) == 2048
    assert bench.longest_fitting(Probe(1000), 2048, 2048, 256) is None
    for low, high, step in ((4096, 2048, 256), (1024, 2048, 0), (0, 2048, 256)):
        with pytest.raises(ValueError):
            bench.longest_fitting(Probe(10**9), low, high, step)


def test_the_ceiling_follows_the_models_position_range_on_the_grid():
    assert bench.grid_high(131072, 32768, 1024, 256) == 32768  # Qwen2.5's 32k positions
    assert bench.grid_high(131072, 131072, 1024, 256) == 131072
    assert bench.grid_high(131072, 40000, 1024, 256) == 39936  # floored onto the grid
    assert bench.grid_high(8192, None, 1024, 256) == 8192


# -- the command line ------------------------------------------------------------------------------------------------


def test_defaults_per_mode():
    steps = bench.parse_args([])
    assert steps.cases == list(bench.STEP_CASES) and steps.variants == list(bench.VARIANTS)
    assert (steps.warmup, steps.timed, steps.rounds) == (3, 8, 2)
    longest = bench.parse_args(["--longest"])
    assert longest.cases == ["llama-3.2-1b", "llama-3.2-1b-qlora"]
    assert longest.variants == ["stock", "leantrain", "leantrain_offload", "unsloth"]
    assert (longest.low, longest.high, longest.step, longest.cap_gib) == (1024, 131072, 256, 24.0)
    smoke = bench.parse_args(["--smoke", "--longest", "--cap-gib", "8"])
    assert smoke.cases == ["tiny-llama", "tiny-llama-qlora"] and (smoke.low, smoke.high) == bench.SMOKE_GRID[:2]
    assert smoke.cap_gib == 8.0 and (smoke.warmup, smoke.timed, smoke.rounds) == (1, 2, 1)


def test_names_are_kept_in_the_benchmarks_order_without_repeats():
    args = bench.parse_args(["--variants", " unsloth,stock,stock", "--cases", "qwen2.5-1.5b,llama-3.2-1b"])
    assert args.variants == ["stock", "unsloth"] and args.cases == ["llama-3.2-1b", "qwen2.5-1.5b"]
    # gpu_run.sh splits NAME=a,b,c on commas: the names arrive as separate arguments
    spaced = bench.parse_args(["--longest", "--variants", "unsloth", "leantrain_offload", "--cap-gib", "16"])
    assert spaced.variants == ["leantrain_offload", "unsloth"] and spaced.cap_gib == 16.0


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--variants", "stock,bogus"], "unknown variant(s) bogus"),
        (["--cases", "llama-9b"], "unknown case(s) llama-9b"),
        (["--smoke", "--cases", "llama-3.2-1b"], "unknown case(s) llama-3.2-1b"),  # smoke has its own tiny cases
        (["--longest", "--low", "1000"], "multiples of --step"),
        (["--longest", "--low", "4096", "--high", "2048"], "--low <= --high"),
        (["--step", "0"], "--step > 0"),
        (["--cap-gib", "0"], "--cap-gib must be positive"),
        (["--rounds", "0"], "at least 1"),
        (["--cap-gib", "lots"], "invalid float value"),
    ],
)
def test_bad_input_exits_2_saying_what_is_wrong(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(argv)
    assert stop.value.code == 2
    assert said in capsys.readouterr().err


def test_help_works_without_cuda_and_shows_the_commands():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--longest" in proc.stdout and "--cap-gib" in proc.stdout
    assert "python benchmarks/bench_offload_checkpoints.py --longest --cap-gib 24" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the run would start")
def test_without_cuda_a_run_stops_with_one_line_and_code_2(capsys):
    assert bench.main(["--variants", "stock"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


def test_the_docstring_says_what_it_measures_and_how_to_run_it():
    doc = bench.__doc__
    assert doc.startswith("Offloaded activation checkpoints (``offload_checkpoints``)")
    for command in (
        "python benchmarks/bench_offload_checkpoints.py\n",
        "python benchmarks/bench_offload_checkpoints.py --longest --cap-gib 24",
        "bash benchmarks/install_wheels.sh",
        "bash benchmarks/gpu_run.sh offload_checkpoints",
    ):
        assert command in doc, command


# -- a worker's exit as a record -------------------------------------------------------------------------------------


def test_a_workers_exit_becomes_a_record(tmp_path):
    path = tmp_path / "record.json"
    assert bench.read_record(path, None, "step 1\nkilled", 300)["status"] == "timeout"
    crashed = bench.read_record(path, -9, "Traceback\nSegmentation fault", 300)
    assert crashed["status"] == "crashed" and "exit -9" in crashed["reason"]
    path.write_text(json.dumps({"status": "oom", "reason": "OutOfMemoryError: CUDA out of memory"}))
    assert bench.read_record(path, 0, "", 300)["status"] == "oom"  # the worker's own verdict
    path.write_text(json.dumps({"status": "ok", "reason": ""}))
    assert bench.read_record(path, 0, "", 300)["status"] == "ok"
    assert bench.read_record(path, 1, "teardown failed", 300)["status"] == "crashed"  # a non-zero exit never fits


def test_out_of_memory_is_told_apart_from_other_failures():
    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name, without CUDA
        pass

    assert bench.failure_kind(OutOfMemoryError("tried to allocate 2 GiB")) == "oom"
    assert bench.failure_kind(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED: out of memory")) == "oom"
    assert bench.failure_kind(ValueError("offload_checkpoints cannot apply")) == "failed"


# -- rows, tables and verdicts from fake records ---------------------------------------------------------------------


def _run(ms: float, peak: float, losses: list[float], stats: dict | None = None, status: str = "ok", **extra) -> dict:
    """A worker record of one round: 1 warm-up step (slow) and 4 timed ones at ``ms``."""
    if status != "ok":
        return {"status": status, "reason": extra.get("reason", ""), "date": "2026-11-28T10:00:00+00:00"}
    steps = [{"total_ms": 5000.0, "warmup": True}] + [{"total_ms": ms, "warmup": False} for _ in range(4)]
    return {
        "status": "ok", "reason": "", "steps": steps, "losses": losses, "peak_gib": peak, "reserved_gib": peak + 1,
        "first_step_s": 5.0, "summary": {"p50": ms, "tokens_per_s": 8192 / ms * 1e3}, "stats": stats,
        "device": "NVIDIA H200", "versions": {"torch": "2.9"}, "date": "2026-11-28T10:00:00+00:00", **extra,
    }  # fmt: skip


STATS = {"packed": 75, "packed_bytes": 75 * 2**25, "kept": 0, "live_bytes": 0, "peak_bytes": 15 * 2**25,
         "fetched_ahead": 70, "waited": 0, "failures": []}  # fmt: skip


def _step_rows(monkeypatch, offload_ms: float = 102.0) -> list:
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    case = "llama-3.2-1b"
    runs = {
        (case, "stock"): [_run(200.0, 10.0, [11.0, 10.5, 10.0]), _run(210.0, 10.0, [11.0, 10.5, 10.0])],
        (case, "hf_offload"): [_run(0, 0, [], status="skipped", reason="transformers 4.57 has no | offload")],
        (case, "leantrain"): [_run(100.0, 8.0, [11.0, 10.5, 10.1]), _run(100.0, 8.0, [11.0, 10.5, 10.1])],
        (case, "leantrain_offload"): [
            _run(offload_ms, 7.5, [11.0, 10.5, 10.1], STATS),
            _run(0, 0, [], status="oom", reason="OutOfMemoryError: x"),  # a failed round is noted, not lost
        ],
        (case, "unsloth"): [_run(120.0, 10.0, [11.0, 10.6, 10.2]), _run(120.0, 10.0, [11.0, 10.6, 10.2])],
    }
    return rows_of.step_rows(runs, bench.cases(smoke=False))


def test_runs_pool_their_timed_steps_and_note_a_failed_round():
    pooled = rows_of.combine([_run(100.0, 8.0, [1.0]), _run(110.0, 9.0, [1.0]), _run(0, 0, [], status="oom")])
    assert pooled["p50"] == pytest.approx(105.0) and pooled["run_ms"] == [100.0, 110.0, None]
    assert pooled["peak_gib"] == 9.0 and pooled["failed_runs"] == ["run 3: oom: "]
    assert rows_of.combine([_run(0, 0, [], status="timeout", reason="timed out")])["status"] == "timeout"


def test_step_rows_carry_the_metrics_the_loss_gaps_and_the_commit(monkeypatch):
    rows = _step_rows(monkeypatch)
    by = rows_of.index(rows)
    speed = by[("llama-3.2-1b", "leantrain_offload", "speed")]
    assert speed.p50 == 102.0 and speed.unit == "ms" and speed.commit == "abc1234" and speed.device == "NVIDIA H200"
    assert speed.config["loss_diff_vs_stock"] == pytest.approx(0.1) and speed.config["loss_diff_vs_leantrain"] == 0
    assert speed.config["stats"]["packed"] == 75 and speed.config["run_ms"] == [102.0, None]
    assert by[("llama-3.2-1b", "stock", "speed")].p50 == pytest.approx(205.0)  # median over both rounds
    assert by[("llama-3.2-1b", "leantrain_offload", "reserved")].p50 == 8.5
    assert math.isnan(by[("llama-3.2-1b", "hf_offload", "status")].p50)
    assert {r.metric for r in rows if r.provider == "unsloth"} == {"speed", "memory", "reserved", "first step"}


def test_step_table_and_verdicts(monkeypatch):
    rows = _step_rows(monkeypatch)
    table = rows_of.step_table(rows)
    offload = next(line for line in table.splitlines() if "| leantrain_offload |" in line)
    assert "| 102.0 (102.0–102.0) | 102.0 / – | +2.0% |" in offload and "| 7.50 | 8.50 |" in offload
    assert "75 inputs moved a step" not in offload  # counters are per step: 75 over the run's 5 steps
    assert "15 inputs moved a step (0.47 GiB), host peak 0.47 GiB" in offload and "losses equal leantrain's" in offload
    assert "run 2: oom: OutOfMemoryError: x" in offload
    assert "skipped: transformers 4.57 has no / offload" in table  # a "|" would split the markdown row
    (verdict,) = rows_of.verdicts(rows)
    assert "offload step cost vs leantrain +2.0% (within the 3% target)" in verdict
    assert "0.50 GiB (6%) less allocated" in verdict
    assert "leantrain_offload vs Unsloth: step 0.85x, peak allocated 0.75x Unsloth's" in verdict


def test_a_slow_offload_is_said_to_miss_the_target(monkeypatch):
    (verdict,) = rows_of.verdicts(_step_rows(monkeypatch, offload_ms=110.0))
    assert "+10.0% (over the 3% target)" in verdict


def _search(variant: str, longest: int | None, status: str = "ok", probes: list | None = None) -> dict:
    ns = argparse.Namespace(cap_gib=24.0, low=1024, step=256)
    rec = bench.search_record("llama-3.2-1b", variant, ns, 131072)
    rec.update(status=status, longest=longest, device="NVIDIA H200", versions={"torch": "2.9"})
    rec["probes"] = probes if probes is not None else [
        {"seq": longest, "status": "ok", "reason": "", "step_ms": 900.0, "peak_gib": 23.1, "reserved_gib": 23.8}
    ]  # fmt: skip
    return rec


def test_longest_rows_and_table(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    oom = [{"seq": 1024, "status": "oom", "reason": "OutOfMemoryError: | 2 GiB", "step_ms": None}]
    results = {
        ("llama-3.2-1b", "stock"): _search("stock", 8192),
        ("llama-3.2-1b", "leantrain"): _search("leantrain", None, probes=oom),
        ("llama-3.2-1b", "leantrain_offload"): _search("leantrain_offload", 131072),
        ("llama-3.2-1b", "unsloth"): _search("unsloth", None, status="not installed"),
        ("llama-3.2-1b", "hf_offload"): _search("hf_offload", 16384, status="searching"),
    }
    rows = rows_of.longest_rows(results)
    found = rows_of.index(rows)[("longest:llama-3.2-1b", "stock", "longest")]
    assert (found.p50, found.unit, found.x_name, found.x_value) == (8192.0, "tokens", "cap_gib", 24.0)
    table = rows_of.longest_table(rows)
    lines = {line.split(" | ")[1]: line for line in table.splitlines()[2:]}
    assert lines["stock"].startswith("| llama-3.2-1b (cap 24 GiB) | stock | 8192 | 1.00x | 900 | 23.10 / 23.80 | 1 |")
    assert "| 131072 | 16.00x |" in lines["leantrain_offload"]
    assert "the search's ceiling (131072: --high or the model's position range) fits" in lines["leantrain_offload"]
    assert "timed during the search" not in table  # one probe each: nothing ran beside it
    assert "| none |" in lines["leantrain"] and "1024 does not fit (oom: OutOfMemoryError: / 2 GiB)" in table
    assert "not installed" in lines["unsloth"]
    assert "| 16384 | 2.00x |" in lines["hf_offload"] and "search cut off" in lines["hf_offload"]
    assert "## Longest sequence under the memory cap" in rows_of.tables(rows)


def test_a_step_not_timed_alone_is_said_so(monkeypatch):
    """With --parallel the longest length trains once more alone for its step time; where that run did not finish,
    the table says the figure comes from the search, where another variant shared the GPU."""
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    rec = {**_search("unsloth", 131072), "parallel": 2}
    said = "step timed during the search (its run alone did not finish)"
    table = rows_of.longest_table(rows_of.longest_rows({("llama-3.2-1b", "unsloth"): rec}))
    assert said in table  # one probe (the search's ceiling) beside another variant's: still not alone
    assert said not in rows_of.longest_table(
        rows_of.longest_rows({("llama-3.2-1b", "unsloth"): {**rec, "parallel": 1}})
    )
    rec["probes"].insert(0, {"seq": 32768, "status": "ok", "reason": "", "step_ms": 300.0, "peak_gib": 5.0,
                             "reserved_gib": 5.2})  # fmt: skip
    old = {k: v for k, v in rec.items() if k != "parallel"}  # rows written before --parallel was recorded
    assert said in rows_of.longest_table(rows_of.longest_rows({("llama-3.2-1b", "unsloth"): old}))
    rec["alone"] = {"status": "ok", "step_ms": 800.0, "peak_gib": 20.0, "reserved_gib": 21.0}
    table = rows_of.longest_table(rows_of.longest_rows({("llama-3.2-1b", "unsloth"): rec}))
    assert "timed during the search" not in table and "| 800 | 20.00 / 21.00 |" in table


def test_merge_joins_runs_and_keeps_each_cases_latest(tmp_path, monkeypatch):
    monkeypatch.setattr(_harness, "RESULTS", tmp_path / "committed")  # no committed results join the test's rows
    rows = _step_rows(monkeypatch)
    old = [r for r in rows if r.provider == "stock"]
    new = [_harness.Row(**{**r.__dict__, "date": "2026-11-29T00:00:00+00:00", "p50": 1.0}) for r in old]
    first, second = tmp_path / "call1", tmp_path / "call2"
    bench.write(rows, argparse.Namespace(smoke=False, out=str(first)))
    bench.write(new, argparse.Namespace(smoke=False, out=str(second)))
    joined = tmp_path / "joined"
    argv = ["--merge", str(first / "offload_checkpoints.json"), str(second / "offload_checkpoints.json")]
    assert bench.main([*argv, "--out", str(joined)]) == 0
    merged = _harness.read_rows(joined / "offload_checkpoints.json")
    assert len(merged) == len(rows)
    assert rows_of.index(merged)[("llama-3.2-1b", "stock", "speed")].p50 == 1.0  # the later run of stock
    assert rows_of.index(merged)[("llama-3.2-1b", "leantrain", "speed")].p50 == 100.0
    assert (joined / "offload_checkpoints.md").read_text().count("| llama-3.2-1b |") == 5
    # a run found in several files (a device call's output holds the committed rows it started from) is kept once
    again = tmp_path / "again"
    assert bench.main([*argv, str(joined / "offload_checkpoints.json"), "--out", str(again)]) == 0
    assert len(_harness.read_rows(again / "offload_checkpoints.json")) == len(rows)


def test_the_committed_results_give_the_runs_in_measured_py():
    """offload_checkpoints/measured.py holds, per case and micro-batch size, the worst committed run of the offload a
    step apart (``offload_toggle_<case>[_b<rows>]_run*.json``): its step cost (paused over offloaded, the pairs'
    median ratio) and the peak memory it saved. A run's size is its micro-batch's tokens (with varying lengths the
    median of its batches' sums, which the seed moves a little: a row takes the runs within 5% of its size).
    Varying-length runs whose pairs trained different batches (before ``paired_batches``) are left out: a pair's
    ratio there mixes the batches' lengths with the offload's cost."""
    import dataclasses

    import bench_offload_toggle as toggle
    import bench_vs_unsloth as vs

    from leantrain.offload_checkpoints.measured import MEASURED

    results = Path(bench.__file__).resolve().parent / "results"
    cases = vs.cases(False)
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for path in sorted(results.glob("offload_toggle_*_run*.json")):
        paused, offload = _harness.read_rows(path)
        assert (paused.provider, offload.provider, paused.x_value) == ("paused", "offload", offload.x_value)
        # every layer offloaded: runs of some of the layers are named ``_half*`` and measure another trade
        assert not int(offload.config["patch_trainer"].get("offload_checkpoints_layers", 0)), path.name
        if "varlen" in offload.x_value and not offload.config.get("paired_batches"):
            continue
        case = dataclasses.replace(cases[offload.x_value], batch=offload.config.get("batch", 4))
        tokens = offload.config.get("tokens") or toggle.micro_batch_tokens(case, offload.config["seed"])
        row = [r for r in MEASURED if r.case == offload.x_value and abs(r.tokens - tokens) <= 0.05 * r.tokens]
        assert len(row) == 1, f"{path.name}: {tokens} tokens a micro-batch, no row of measured.py at that size"
        ratio = offload.config["pair_median"]
        saved = paused.config["peak_gib"] - offload.config["peak_gib"]
        runs.setdefault((row[0].case, row[0].tokens), []).append((1 / ratio - 1, saved))
    assert sorted(runs) == sorted((r.case, r.tokens) for r in MEASURED)
    for r in MEASURED:
        cost, saved = max(runs[r.case, r.tokens])
        assert r.cost == pytest.approx(cost, abs=5e-4), r
        assert r.saved_gib == pytest.approx(saved, abs=5e-3), r


def test_options_are_read_as_python_literals_and_checked():
    assert bench.patch_options(["layer_kernels=True,fused_ce_tile_mib=128", "compile_layers=None"]) == {
        "layer_kernels": True, "fused_ce_tile_mib": 128, "compile_layers": None,
    }  # fmt: skip
    assert bench.patch_options(["name=plain words"]) == {"name": "plain words"}
    with pytest.raises(SystemExit):
        bench.parse_args(["--options", "layer_kernels"])  # no value: a parser error, before any process starts


def test_parallel_searches_then_times_each_longest_length_alone(tmp_path, monkeypatch):
    """--parallel 2: the variants' searches overlap (both first probes wait for each other), then each longest
    length is trained once more alone, and the rows take their step time from that lone run."""
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    limits = {"stock": 2048, "leantrain_offload": 4096}
    both_first = threading.Barrier(2, timeout=30)  # broken (an error) unless the two searches run at once
    alone = {"now": False}

    def spawn(case, variant, model_dir, args, **extra):
        if variant == "prepare":
            return {"status": "ok", "reason": "", "wall_s": 0.0}
        if extra["seq"] == args.low and not alone["now"]:
            both_first.wait()
        ok = extra["seq"] <= limits[variant]
        return {"status": "ok" if ok else "oom", "reason": "" if ok else "OutOfMemoryError", "date": "2026-11-29",
                "summary": {"p50": 400.0 if alone["now"] else 500.0}, "peak_gib": 20.0, "reserved_gib": 21.0,
                "wall_s": 1.0}  # fmt: skip

    real_retime = bench.retime

    def retime(*a, **k):
        alone["now"] = True
        return real_retime(*a, **k)

    monkeypatch.setattr(bench, "spawn", spawn)
    monkeypatch.setattr(bench, "retime", retime)
    args = bench.parse_args(["--longest", "--cases", "llama-3.2-1b", "--variants", "stock,leantrain_offload",
                             "--parallel", "2", "--low", "1024", "--high", "8192", "--step", "1024",
                             "--out", str(tmp_path)])  # fmt: skip
    assert bench.run_longest(args) == 0
    rows = rows_of.index(_harness.read_rows(tmp_path / "offload_checkpoints.json"))
    for variant, limit in limits.items():
        assert rows[("longest:llama-3.2-1b", variant, "longest")].p50 == limit
        assert rows[("longest:llama-3.2-1b", variant, "speed at longest")].p50 == 400.0  # the lone run's step


def test_parallel_searches_must_fit_the_gpu():
    assert bench.parallel_problem(1, 24.0, 139.8) is None and bench.parallel_problem(5, 24.0, 139.8) is None
    assert "lower --parallel" in bench.parallel_problem(6, 24.0, 139.8)
    assert "at least 1" in bench.parallel_problem(0, 24.0, 139.8)
