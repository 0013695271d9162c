"""benchmarks/bench_moe4bit.py: the --shape table and the LoRA-on-experts providers (same math, CPU smoke size)."""

from __future__ import annotations

import pytest
import torch


pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
import bench_moe4bit as bench  # noqa: E402


def test_shapes_match_the_models():
    assert bench.SHAPES["qwen3-30b-a3b"][:4] == (128, 8, 2048, 768)
    assert bench.SHAPES["deepseek-v2-lite"][:4] == (64, 6, 2048, 1408)
    full = bench.with_shape(bench.FULL, "qwen3-30b-a3b")
    assert (full.experts, full.top_k, full.hidden, full.inter, full.family) == (128, 8, 2048, 768, "qwen3_moe")
    smoke = bench.with_shape(bench.SMOKE, "deepseek-v2-lite")
    assert (smoke.experts, smoke.hidden, smoke.family) == (bench.SMOKE.experts, bench.SMOKE.hidden, "qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_lora_providers_agree(shape):
    """The timed LoRA providers compute the same layer (fp32 smoke: within fp32 rounding of the output's scale),
    so the benchmark compares like with like; the adapters contribute (random B)."""
    s = bench.with_shape(bench.SMOKE, shape)
    fns = bench.providers(s, lora_only=True)
    x, idx, weights, _ = bench.layer_inputs(s, 16, dense=True)
    with torch.no_grad():
        loop = fns[bench.LORA_LOOP](x, idx, weights)
        grouped = fns[bench.LORA_GROUPED](x, idx, weights)
        base = fns[bench.GROUPED](x, idx, weights)
    scale = loop.abs().max().item()
    assert (grouped - loop).abs().max().item() <= 1024 * torch.finfo(torch.float32).eps * scale
    assert (base - loop).abs().max().item() > 1e-3 * scale  # LoRA changes the output


def _rows(path) -> list[dict]:
    import json

    return json.loads(path.read_text())


@pytest.mark.slow
def test_step_bench_smoke(tmp_path, monkeypatch):
    """bench_moe4bit_step.py --smoke (transformers 5: 3-D stacks) runs every provider on CPU and writes its rows
    (--transformers4 runs in the 4.57 set: tests/parity/test_moe4bit_lora4x.py)."""
    import bench_moe4bit_step as step

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    out = step.main(["--smoke"])
    rows = _rows(out / "moe4bit_step.json")
    assert {r["provider"] for r in rows} == {"stock", "leantrain", "leantrain_attn_only"}
    with pytest.raises(SystemExit, match="needs transformers 4.x"):
        step.main(["--smoke", "--transformers4"])
