"""benchmarks/shapes.py: every shape builds its transformers config, and its parameter count is the released model's
(counted on the meta device: nothing is allocated)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]

import shapes  # noqa: E402


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# Published parameter counts (model cards / safetensors totals), billions. The tolerance is the rounding of the
# published figure (3 significant digits) plus what the counts leave out: gpt-oss's attention sinks and router biases
# are included in its card's 20.9B, DeepSeek-V2-Lite's MLA is replaced (hence no count for the -like shape).
PUBLISHED = {
    "smollm2-135m": (0.1345, 0.001),
    "qwen2.5-0.5b": (0.494, 0.001),
    "qwen2.5-1.5b": (1.54, 0.005),
    "qwen2.5-3b": (3.09, 0.005),
    "qwen2.5-7b": (7.62, 0.005),
    "llama-3.1-8b": (8.03, 0.005),
    "llama-3.2-1b": (1.24, 0.005),
    "gemma-2-2b": (2.61, 0.005),
    "gpt-oss-20b": (20.9, 0.05),
    "qwen3-30b-a3b": (30.5, 0.05),
}


def _count(name: str) -> int:
    s = shapes.shape(name)
    config = getattr(transformers, s.cls)(**s.config())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_released_models(name):
    billions, tol = PUBLISHED[name]
    assert _count(name) / 1e9 == pytest.approx(billions, abs=tol)


def test_every_shape_builds_and_overrides_copy():
    for name, s in shapes.SHAPES.items():
        config = getattr(transformers, s.cls)(**s.config(num_hidden_layers=1))
        assert config.num_hidden_layers == 1 and s.layers > 1, name
        assert config.hidden_size == s.fields["hidden_size"]
    assert shapes.config("qwen2.5-7b", num_hidden_layers=4)["num_hidden_layers"] == 4
    assert shapes.SHAPES["qwen2.5-7b"].fields["num_hidden_layers"] == 28  # the table itself is never changed
    with pytest.raises(KeyError, match="unknown shape 'nope'"):
        shapes.shape("nope")


def test_examples_build_the_tables_sizes(monkeypatch):
    """examples/_common.py's named shapes come from the table (its own choices: untied head, sdpa)."""
    spec = importlib.util.spec_from_file_location("_common", ROOT / "examples" / "_common.py")
    _common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_common)

    built = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_config", lambda c, **kw: built.append(c) or torch.nn.Linear(1, 1)
    )
    for example, (_, name) in _common.SHAPES.items():
        _common.build_model(example, vocab_size=0)
        config, fields = built[-1], shapes.config(name)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            assert getattr(config, key) == fields[key], (example, key)
        assert config.num_key_value_heads == fields["num_key_value_heads"] and not config.tie_word_embeddings
