"""The accelerate recipes in examples/accelerate/ load with accelerate's own config loader and launch validation,
and the DeepSpeed ones build the DeepSpeed plugin the Trainer would get (CPU only, nothing launched)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


accelerate = pytest.importorskip("accelerate")

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "accelerate"
EXPECTED = {
    "ddp.yaml": ("MULTI_GPU", None),
    "fsdp2.yaml": ("FSDP", None),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 2),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 3),
}


def _validated(name: str):
    """accelerate launch's own parsing and validation of ``--config_file <name> train.py``."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as launch_command does before the DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args


def test_every_recipe_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_and_validates(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS / name))
    kind, stage = EXPECTED[name]
    assert str(config.distributed_type).endswith(kind)
    assert config.num_processes == 2 and str(config.mixed_precision).endswith("bf16")
    if stage is not None:
        assert config.deepspeed_config["zero_stage"] == stage
        assert config.deepspeed_config["offload_optimizer_device"] == "none"
        assert config.deepspeed_config["offload_param_device"] == "none"
        assert config.deepspeed_config["zero3_init_flag"] is (stage == 3)
    args = _validated(name)
    assert args.num_processes == 2 and args.use_deepspeed == (stage is not None)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_plugin_from_the_launch_environment(stage, monkeypatch):
    """The environment ``accelerate launch`` gives each rank builds a DeepSpeedPlugin of this stage, offload off,
    bf16, with gradient accumulation and clipping left "auto" for the Trainer's arguments to fill."""
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = _validated(f"deepspeed_zero{stage}.yaml")
    args.main_process_port = 29531  # prepare_deepspeed_cmd_env would otherwise look for a free port
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_") and os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    assert plugin.zero_stage == stage and config["zero_optimization"]["stage"] == stage
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert config["zero_optimization"]["offload_param"]["device"] == "none"
    assert config["gradient_accumulation_steps"] == "auto" and config["gradient_clipping"] == "auto"
    assert plugin.zero3_init_flag is (stage == 3)
    if stage == 3:
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
