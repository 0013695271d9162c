import re
from pathlib import Path

import pytest

from leantrain.config import LeantrainConfig, env_table_markdown, resolve_config


def test_defaults_and_sources():
    cfg = resolve_config({}, environ={})
    # Opt-in: the optimizations that change what trains (CGGR, OSFT) are off unless asked for
    assert cfg.cggr is False and cfg.osft is False and cfg.cggr_min_tokens_ratio == 0.25
    assert cfg.grpo_logps is None and cfg.moe4bit is None
    assert resolve_config({}, environ={"LEANTRAIN_CGGR": "auto"}).cggr is None
    assert set(cfg.sources.values()) == {"default"}


def test_precedence_keyword_over_env_over_default():
    env = {"LEANTRAIN_CGGR_MIN_TOKENS_RATIO": "0.3", "LEANTRAIN_CGGR": "0", "LEANTRAIN_OSFT_TARGETS": "q_proj, v_proj"}
    cfg = resolve_config({"cggr_min_tokens_ratio": 0.5}, environ=env)
    assert cfg.cggr_min_tokens_ratio == 0.5 and cfg.sources["cggr_min_tokens_ratio"] == "kwarg"
    assert cfg.cggr is False and cfg.sources["cggr"] == "env"
    assert cfg.osft_targets == ("q_proj", "v_proj")
    assert resolve_config({}, environ=env).cggr_min_tokens_ratio == 0.3


@pytest.mark.parametrize(("raw", "value"), [("auto", None), ("", None), ("1", True), ("YES", True), ("off", False)])
def test_tristate_parsing(raw, value):
    assert resolve_config({}, environ={"LEANTRAIN_MOE4BIT": raw}).moe4bit is value


def test_unknown_keyword_names_close_match():
    with pytest.raises(TypeError, match="did you mean cggr_min_tokens_ratio"):
        resolve_config({"cggr_min_token_ratio": 0.3}, environ={})


def test_unknown_env_var_is_an_error():
    with pytest.raises(ValueError, match="LEANTRAIN_CGGR_SCORNG.*did you mean LEANTRAIN_CGGR_SCORING"):
        resolve_config({}, environ={"LEANTRAIN_CGGR_SCORNG": "entropy"})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LEANTRAIN_STRICT": "maybe"}, "LEANTRAIN_STRICT='maybe': expected one of"),
        ({"LEANTRAIN_CGGR": "sometimes"}, "expected one of .*auto"),
        ({"LEANTRAIN_CGGR_ROUTER_LAYERS": "two"}, "expected a int"),
        ({"LEANTRAIN_CGGR_MIN_TOKENS_RATIO": "1.5"}, r"LEANTRAIN_CGGR_MIN_TOKENS_RATIO must be in \(0, 1\]"),
        ({"LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB": "-1"}, "LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB must be >= 0, got -1"),
        ({"LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB": "4GiB"}, "expected a int"),
    ],
)
def test_unparsable_or_invalid_env_values(env, message):
    with pytest.raises(ValueError, match=message):
        resolve_config({}, environ=env)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"cggr_min_tokens_ratio": 0.0}, ValueError, r"must be in \(0, 1\]"),
        ({"osft_unfrozen_rank_ratio": 1.01}, ValueError, r"must be in \(0, 1\]"),
        ({"cggr_scoring": "perplexity"}, ValueError, "must be one of"),
        ({"cggr_router_layers": 0}, ValueError, "must be a layer"),
        ({"cggr_router_layers": 1.5}, TypeError, "expected int"),
        ({"grpo_logps_keep_logits_mib": -1}, ValueError, "grpo_logps_keep_logits_mib must be >= 0"),
        ({"strict": "definitely"}, ValueError, "expected one of"),
    ],
)
def test_bad_keyword_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        resolve_config(kwargs, environ={})


def test_keep_logits_budget_is_off_by_default_and_read_from_env():
    assert resolve_config({}, environ={}).grpo_logps_keep_logits_mib == 0  # the memory-lean recompute
    cfg = resolve_config({}, environ={"LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB": " 4096 "})
    assert cfg.grpo_logps_keep_logits_mib == 4096 and cfg.sources["grpo_logps_keep_logits_mib"] == "env"


def test_every_option_has_doc_and_env_name():
    names = [f.name for f in LeantrainConfig.options()]
    assert len(names) == len(set(names))
    for f in LeantrainConfig.options():
        assert f.metadata["doc"] and f.metadata["kind"] in {"tristate", "bool", "int", "float", "str", "names"}


@pytest.mark.parametrize("layers", [1, 2, 24, -1, -3])
def test_router_layers_any_nonzero_index(layers):
    # The range depends on the model: checked at patch_trainer time against its layer count
    assert resolve_config({"cggr_router_layers": layers}, environ={}).cggr_router_layers == layers
    assert resolve_config({}, environ={"LEANTRAIN_CGGR_ROUTER_LAYERS": str(layers)}).cggr_router_layers == layers


def test_env_table_rows_for_the_opt_in_toggles():
    rows = {line.split("|")[1].strip(): line for line in env_table_markdown().splitlines()[2:]}
    assert "| 0 |" in rows["`LEANTRAIN_CGGR`"] and "changes which tokens train" in rows["`LEANTRAIN_CGGR`"]
    assert "| 0 |" in rows["`LEANTRAIN_OSFT`"]
    assert "| auto |" in rows["`LEANTRAIN_GRPO_LOGPS`"] and "| auto |" in rows["`LEANTRAIN_MOE4BIT`"]
    assert "-1 = final hidden state" in rows["`LEANTRAIN_CGGR_ROUTER_LAYERS`"]


def test_readme_states_the_default_rule():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "CGGR and OSFT are opt-in" in readme


def test_option_choices_match_what_the_math_serves():
    """The option table offers exactly the choices the math modules implement (they take plain values, so each
    keeps its own tuple; this keeps the two equal)."""
    from leantrain.cggr.ops import SCORINGS
    from leantrain.config import CGGR_SCORINGS, OSFT_PRECISIONS
    from leantrain.osft.ops import PRECISIONS

    assert SCORINGS == CGGR_SCORINGS and PRECISIONS == OSFT_PRECISIONS


def test_precedence_keyword_over_command_line_over_env_over_default():
    env = {"LEANTRAIN_CGGR_SCORING": "loss", "LEANTRAIN_CGGR_WARMUP_STEPS": "7", "LEANTRAIN_OSFT": "1"}
    cli = {"cggr_scoring": "margin", "cggr_warmup_steps": "3", "osft": False, "cggr": "auto"}
    cfg = resolve_config({"cggr_warmup_steps": 5}, environ=env, cli=cli)
    assert (cfg.cggr_warmup_steps, cfg.sources["cggr_warmup_steps"]) == (5, "kwarg")
    assert (cfg.cggr_scoring, cfg.sources["cggr_scoring"]) == ("margin", "cli")
    assert (cfg.osft, cfg.sources["osft"]) == (False, "cli")
    assert (cfg.cggr, cfg.sources["cggr"]) == (None, "cli")  # auto asked for explicitly
    assert cfg.sources["cggr_min_tokens_ratio"] == "default"


@pytest.mark.parametrize(
    ("kwargs", "cli", "env", "error", "message"),
    [
        ({}, {"cggr_ratio": "0.3"}, {}, TypeError, "unknown option 'cggr_ratio' (did you mean"),
        ({}, {"cggr_min_tokens_ratio": "2"}, {}, ValueError, r"cggr_min_tokens_ratio must be in (0, 1]"),
        ({}, {"osft": "maybe"}, {}, ValueError, "osft='maybe': expected one of"),
        # every value given is checked, even one a higher layer overrides
        ({"cggr": True}, {}, {"LEANTRAIN_CGGR": "maybe"}, ValueError, "LEANTRAIN_CGGR='maybe'"),
        ({"cggr_min_tokens_ratio": 0.3}, {"cggr_min_tokens_ratio": "1.5"}, {}, ValueError, "must be in (0, 1]"),
        ({}, {}, {"LEANTRAIN_CGGR_MIN_TOKENS_RATIO": "0"}, ValueError, "LEANTRAIN_CGGR_MIN_TOKENS_RATIO must be"),
        ({"disable": True, "cggr": True}, {}, {}, ValueError, "patch_trainer(disable=True, cggr=True): the kill"),
        ({}, {"disable": "1", "osft": True}, {}, ValueError, "--opt disable=1 and --osft: the kill switch and a"),
    ],
)
def test_bad_command_line_values_and_contradictions(kwargs, cli, env, error, message):
    with pytest.raises(error, match=re.escape(message)):
        resolve_config(kwargs, environ=env, cli=cli)


def test_settings_named_as_the_user_wrote_them():
    from leantrain.config import as_typed

    assert as_typed("cggr", True, "kwarg") == "cggr=True" and as_typed("disable", True, "env") == "LEANTRAIN_DISABLE=1"
    assert as_typed("grpo_logps", True, "cli") == "--grpo-logps" and as_typed("osft", False, "cli") == "--no-osft"
    assert (
        as_typed("cggr", None, "cli") == "--opt cggr=auto" and as_typed("cggr", None, "env") == "LEANTRAIN_CGGR=auto"
    )
    assert as_typed("strict", True, "cli") == "--strict" and as_typed("disable", True, "cli") == "--opt disable=1"
    assert as_typed("osft_targets", ("q", "v"), "cli") == "--opt osft_targets=q,v"


@pytest.mark.parametrize(("given", "value"), [(1, True), (0, False), ("1", True), ("0", False), (True, True)])
@pytest.mark.parametrize("name", ["cggr", "moe4bit", "strict"])  # tristate, tristate, bool
def test_the_ints_1_and_0_read_as_the_strings_do(name, given, value):
    cfg = resolve_config({name: given}, environ={})
    assert getattr(cfg, name) is value and cfg.sources[name] == "kwarg"
    assert resolve_config({}, environ={}, cli={name: given}).sources[name] == "cli"


@pytest.mark.parametrize(
    ("name", "given", "error"),
    [
        ("cggr", 2, ValueError),
        ("cggr", -1, ValueError),
        ("cggr", 1.0, TypeError),
        ("cggr", 0.5, TypeError),
        ("cggr", [True], TypeError),
        ("strict", 2, ValueError),
        ("strict", 0.0, TypeError),
        ("strict", None, TypeError),
    ],
)
def test_other_numbers_for_a_switch_name_what_is_accepted(name, given, error):
    with pytest.raises(error) as raised:
        resolve_config({name: given}, environ={})
    message = str(raised.value)
    assert message.startswith(f"{name}={given!r}: expected True")
    assert "1 or 0" in message and "1/0/on/off/yes/no/true/false" in message
    assert ("None (auto)" in message and message.endswith("/auto")) == (name == "cggr")
