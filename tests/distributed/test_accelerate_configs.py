"""The accelerate recipes in examples/accelerate/ load with accelerate's own config loader and launch validation,
and the DeepSpeed ones build the DeepSpeed plugin the Trainer would get (CPU, nothing launched); then
examples/train_sft.py runs under each ZeRO recipe with 2 CPU processes (gloo; ~25 s a stage on 2 cores)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
from _launch import launch


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_train_sft_under_zero_recipe(stage, tmp_path):
    """``accelerate launch --config_file examples/accelerate/deepspeed_zero<stage>.yaml examples/train_sft.py`` on
    2 CPU processes (DS_ACCELERATOR=cpu; fp32: --mixed_precision no, bf16 is the GPU setting): a real DeepSpeed
    engine of that stage on both ranks, the patch report printed, and both ranks logging the same losses."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    root = CONFIGS.parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(root / "src"), str(root / "examples")]))
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / f"deepspeed_zero{stage}.yaml"),
    ]
    command += [
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(root / "examples" / "train_sft.py"),
    ]
    command += ["--shape", "tiny-llama", "--steps", "2", "--batch", "2", "--seq", "64", "--out", str(tmp_path)]
    files = [tmp_path / f"sft_rank{r}.json" for r in (0, 1)]
    result = launch(command, files, cwd=tmp_path, env=env, timeout=300)
    assert "leantrain patch report" in result.stdout
    ranks = [json.loads(path.read_text()) for path in files]
    for row in ranks:
        assert row["world_size"] == 2 and row["distributed"] == "DistributedType.DEEPSPEED"
        assert row["zero_stage"] == stage and len(row["losses"]) == 2
    assert ranks[0]["losses"] == ranks[1]["losses"]  # gathered and logged the same on every rank
