"""``leantrain run``: a script file, ``-m module`` and a console script run with their trainers patched; option
parsing and precedence (keyword > command line > environment > default); ``--strict``; bad input; nothing patched
without ``run``; the report kept in ``leantrain.json`` and out of ``log_history``; unpatch restores everything.

The target is ``tests/unit/_run_target.py``, a plain Trainer script that knows nothing of leantrain. Runs in this
process where they can (seconds each); the console-script form runs in a real subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import Trainer
from transformers.trainer_utils import SaveStrategy

import leantrain
from leantrain._record import RECORD_NAME, TrackerConfigCallback
from leantrain.cli import launch
from leantrain.entry import NotReadyError
from tests.unit._fakes import tiny_trainer


REPO = Path(__file__).resolve().parents[2]
TARGET = str(Path(__file__).with_name("_run_target.py"))
MODULE = "tests.unit._run_target"
STOCK_TRAIN = Trainer.__dict__["train"]
STOCK_INIT = Trainer.__dict__["__init__"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # `-m tests.unit._run_target` resolves from the working directory, as with python -m


def result(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"result_rank{rank}.json").read_text())


def outcome(report: dict, name: str) -> dict:
    return next(o for o in report["outcomes"] if o["name"] == name)


def leantrain_entries(log_history: list[dict]) -> list[dict]:
    """Entries that name leantrain: none, ever (the report stays out of the metric stream)."""
    return [h for h in log_history if any(k.startswith("leantrain") for k in h)]


# --- parsing -------------------------------------------------------------------------------------------------------


def test_parse_splits_leantrain_options_from_the_targets_own():
    request = launch.parse(
        ["--cggr", "--no-osft", "--strict", "--opt", "cggr-scoring=margin", TARGET, "--cggr", "--opt", "x", "--"],
        environ={},
    )
    assert request.options == {"cggr": True, "osft": False, "strict": True, "cggr_scoring": "margin"}
    assert request.target == launch.Target("file", TARGET, ("--cggr", "--opt", "x", "--"))
    assert request.prefix == ("--cggr", "--no-osft", "--strict", "--opt", "cggr-scoring=margin")


@pytest.mark.parametrize(
    ("argv", "kind", "name", "args"),
    [
        (["-m", MODULE, "--out", "o"], "module", MODULE, ("--out", "o")),
        (["--no-cggr", f"-m{MODULE}", "-m", "x"], "module", MODULE, ("-m", "x")),
        (["--", TARGET, "-h"], "file", TARGET, ("-h",)),
        (["trl", "sft", "--config", "r.yaml"], "script", "trl", ("sft", "--config", "r.yaml")),
    ],
)
def test_parse_target_forms(argv, kind, name, args):
    target = launch.parse(argv, environ={}).target
    assert (target.kind, target.name, target.args) == (kind, name, args)
    if kind == "script":
        assert target.entry_point is not None and target.entry_point.value == "trl.cli:main"


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {}, "missing TARGET"),
        (["--cggr"], {}, "missing TARGET"),
        (["--bogus", TARGET], {}, "unrecognized arguments: --bogus"),
        (["--cggr=1", TARGET], {}, "ignored explicit argument"),
        (["--opt", "cggr_ratio=0.3", TARGET], {}, "unknown option 'cggr_ratio' (did you mean"),
        (["--opt", "cggr_min_tokens_ratio=2", TARGET], {}, "cggr_min_tokens_ratio must be in (0, 1]"),
        (["--opt", "osft=maybe", TARGET], {}, "osft='maybe': expected one of"),
        (["--opt", "novalue", TARGET], {}, "expected NAME=VALUE"),
        (["--cggr", "--opt", "cggr=0", TARGET], {}, "'cggr' given twice"),
        (["--opt"], {}, "expected one argument"),
        ([TARGET], {"LEANTRAIN_CGGR": "maybe"}, "LEANTRAIN_CGGR='maybe'"),
        ([TARGET], {"LEANTRAIN_CGRR": "1"}, "unknown environment variable LEANTRAIN_CGRR"),
        (["no_such_file.py"], {}, "target 'no_such_file.py' not found: no such file"),
        (["no-such-console-script-xyz"], {}, "no such file or console script"),
        (["-m", "no_such_module_xyz"], {}, "no module named 'no_such_module_xyz'"),
        (["-m"], {}, "-m needs a module name"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, environ, message):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse(argv, environ=environ)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "leantrain run: error:" in err, err


def test_python_m_leantrain_run_reports_bad_input(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "leantrain", "run", "missing.py"], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 2 and "target 'missing.py' not found" in done.stderr


def test_child_processes_of_accelerate_launch_run_under_leantrain_run():
    request = launch.parse(["--cggr", "--opt", "cggr_scoring=margin", "trl", "sft"], environ={})
    script = argparse.Namespace(
        no_python=False, module=False, training_script="/x/sft.py", training_script_args=["-a"]
    )
    launch._child_args(request, script)
    assert (script.module, script.training_script) == (True, "leantrain")
    assert script.training_script_args == ["run", "--cggr", "--opt", "cggr_scoring=margin", "/x/sft.py", "-a"]
    module = argparse.Namespace(no_python=False, module=True, training_script="pkg.train", training_script_args=[])
    launch._child_args(request, module)
    assert module.training_script_args == ["run", "--cggr", "--opt", "cggr_scoring=margin", "-m", "pkg.train"]


# --- running -------------------------------------------------------------------------------------------------------


def test_importing_leantrain_patches_nothing():
    assert Trainer.__dict__["train"] is STOCK_TRAIN and STOCK_TRAIN.__module__ == "transformers.trainer"
    assert not hasattr(STOCK_TRAIN, "__leantrain_original__")
    done = subprocess.run(
        [sys.executable, "-c", "import leantrain, leantrain.cli.launch, transformers as t; "
         "print(t.Trainer.train.__module__, hasattr(t.Trainer.train, '__leantrain_original__'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["transformers.trainer", "False"]


def test_script_file(tmp_path, capsys):
    """The file runs as __main__ with its own argv (a --cggr of its own included); its Trainer is patched at
    train(), the report is printed once, kept out of log_history and written beside the saved weights."""
    code = launch.main(["--cggr", TARGET, "--out", str(tmp_path), "--save", "--cggr"])
    assert code == 0
    assert Trainer.__dict__["train"] is STOCK_TRAIN  # restored by identity
    got = result(tmp_path)
    assert got["argv"] == ["--out", str(tmp_path), "--save", "--cggr"] and got["own_cggr_flag"]
    cggr = outcome(got["report"], "cggr")
    assert (cggr["status"], cggr["source"]) == ("applied", "cli")
    err = capsys.readouterr().err
    assert err.count("leantrain patch report (Trainer)") == 1 and "nothing was patched" not in err

    assert leantrain_entries(got["log_history"]) == [] and "loss" in got["log_history"][0]
    assert got["global_step"] == 2

    record = json.loads((tmp_path / "model" / RECORD_NAME).read_text())
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert record["report"] == got["report"]
    assert record["versions"]["leantrain"] == leantrain.__version__
    assert set(record["versions"]) == {"leantrain", "torch", "transformers", "trl"}
    assert record["options"]["cggr"] == {"value": True, "source": "cli"}
    assert record["options"]["cggr_min_tokens_ratio"]["source"] == "default"


def test_module_precedence_cli_over_env_over_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEANTRAIN_OSFT", "1")  # overridden by --no-osft
    monkeypatch.setenv("LEANTRAIN_CGGR_MIN_TOKENS_RATIO", "0.5")  # overridden by --opt
    monkeypatch.setenv("LEANTRAIN_CGGR_SCORING", "margin")  # env only
    argv = ["--no-osft", "--opt", "cggr_min_tokens_ratio=0.3", "-m", MODULE, "--out", str(tmp_path), "--save"]
    assert launch.main(argv) == 0
    options = json.loads((tmp_path / "model" / RECORD_NAME).read_text())["options"]
    assert options["osft"] == {"value": False, "source": "cli"}
    assert options["cggr_min_tokens_ratio"] == {"value": 0.3, "source": "cli"}
    assert options["cggr_scoring"] == {"value": "margin", "source": "env"}
    assert options["cggr_router_layers"] == {"value": 2, "source": "default"}
    osft = outcome(result(tmp_path)["report"], "osft")
    assert (osft["status"], osft["source"], osft["reasons"]) == ("disabled", "cli", ["turned off"])
    assert capsys.readouterr().err.count("leantrain patch report") == 1


def test_a_flag_is_an_explicit_request_that_overrides_the_kill_switch(tmp_path, monkeypatch, capsys):
    """`LEANTRAIN_DISABLE=1 leantrain run --cggr`: the flag asks for CGGR explicitly (like cggr=True in code), so it
    applies, with source `cli` and a note that names the flag; every other optimization stays off."""
    monkeypatch.setenv("LEANTRAIN_DISABLE", "1")
    assert launch.main(["--cggr", TARGET, "--out", str(tmp_path), "--save"]) == 0
    report = result(tmp_path)["report"]
    assert (outcome(report, "cggr")["status"], outcome(report, "cggr")["source"]) == ("applied", "cli")
    assert report["notes"][0] == "the kill switch is on, but --cggr on the command line overrides it"
    assert all(o["status"] == "disabled" for o in report["outcomes"] if o["name"] != "cggr")
    assert "in code" not in capsys.readouterr().err
    options = json.loads((tmp_path / "model" / RECORD_NAME).read_text())["options"]
    assert options["cggr"]["source"] == "cli" and options["disable"] == {"value": True, "source": "env"}


def test_command_line_ranks_below_the_targets_own_keywords(tmp_path):
    """A trainer the target patches itself inside `leantrain run` gets the command line as its `cli` layer: below
    its own keywords, above the environment; `run` then leaves it alone."""
    own = tiny_trainer(tmp_path / "run", steps=1)
    environ = {"LEANTRAIN_CGGR_SCORING": "loss", "LEANTRAIN_CGGR_MIN_TOKENS_RATIO": "0.5"}
    with launch.trainers_patched({"osft": True, "cggr_scoring": "margin", "cggr_warmup_steps": "3"}) as trainers:
        report = leantrain.patch_trainer(own, osft=False, cggr_warmup_steps=5, environ=environ)
        own.train()
    assert trainers.patched == [] and own.leantrain_report is report
    assert trainers.trained == 1 and trainers.why_nothing_patched() is None  # the target reported it itself
    own.save_model(str(tmp_path / "saved"))
    options = json.loads((tmp_path / "saved" / RECORD_NAME).read_text())["options"]
    assert options["osft"] == {"value": False, "source": "kwarg"}
    assert options["cggr_warmup_steps"] == {"value": 5, "source": "kwarg"}
    assert options["cggr_scoring"] == {"value": "margin", "source": "cli"}
    assert options["cggr_min_tokens_ratio"] == {"value": 0.5, "source": "env"}
    assert options["cggr_ratio_schedule"]["source"] == "default"
    second = leantrain.patch_trainer(tiny_trainer(tmp_path / "after", steps=1), environ={})
    assert second["osft"].source == "default"  # the command line ends with the run


def test_strict_fails_the_run_before_training(tmp_path, capsys):
    """cggr in auto mode declines a one-layer model (its default router depth, after decoder layer 2, is not there):
    a skip without --strict, an error before the first step with it. (A path only measured or expected slower is
    skipped in auto mode, strict or not: that is a choice, not a failure.)"""
    argv = ["--opt", "cggr=auto", TARGET, "--out", str(tmp_path), "--layers", "1"]
    assert launch.main(argv) == 0
    cggr = outcome(result(tmp_path)["report"], "cggr")
    assert (cggr["status"], cggr["source"]) == ("skipped", "cli") and cggr["reasons"]

    strict_out = tmp_path / "strict"
    assert launch.main(["--strict", *argv[:2], TARGET, "--out", str(strict_out), "--layers", "1"]) == 1
    err = capsys.readouterr().err
    assert "leantrain run: error: cggr applies here but is not ready (strict mode)" in err
    assert "nothing was trained" in err
    assert not (strict_out / "result_rank0.json").exists() and not list(strict_out.glob("**/*.safetensors"))
    assert Trainer.__dict__["train"] is STOCK_TRAIN


def test_strict_raises_at_train_before_the_optimizer_exists(tmp_path):
    trainer = tiny_trainer(tmp_path, steps=2, layers=1)  # cggr in auto mode declines it, as above
    with launch.trainers_patched({"cggr": "auto", "strict": True}) as trainers:
        with pytest.raises(NotReadyError, match="cggr"):
            trainer.train()
    assert trainers.patched == [] and trainer.optimizer is None and trainer.state.global_step == 0
    assert leantrain.current_report(trainer) is None and "save_model" not in trainer.__dict__


def test_each_trainer_patched_once_and_a_self_patched_one_left_alone(tmp_path):
    first, second, own = (tiny_trainer(tmp_path / n, steps=1) for n in "abc")
    own_report = leantrain.patch_trainer(own, osft=False)
    printed: list[str] = []
    with launch.trainers_patched({"osft": False}, announce=printed.append) as trainers:
        fourth = tiny_trainer(tmp_path / "d", steps=1)  # built inside the block: counted
        for trainer in (first, second, own, first):
            trainer.train()
    assert trainers.patched == [first, second] and len(printed) == 2
    assert (trainers.built, trainers.trained) == (1, 3) and fourth.__dict__.get("leantrain_report") is None
    assert Trainer.__dict__["__init__"] is STOCK_INIT
    assert own.leantrain_report is own_report
    assert leantrain_entries(first.state.log_history) == []
    assert Trainer.__dict__["train"] is STOCK_TRAIN


NO_TRAINER = "import sys\nprint('no trainer here')\nsys.exit({code})\n"


@pytest.mark.parametrize("code", [0, 3])
def test_a_target_that_builds_no_trainer_says_so_and_keeps_its_exit_status(tmp_path, capsys, code):
    script = tmp_path / "plain.py"
    script.write_text(NO_TRAINER.format(code=code))
    assert launch.main([str(script)]) == code
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "leantrain run: nothing was patched: the target built no transformers Trainer (TRL trainers included)"
    ]
    assert Trainer.__dict__["__init__"] is STOCK_INIT and Trainer.__dict__["train"] is STOCK_TRAIN


def test_a_trainer_built_but_never_trained_says_so(tmp_path, capsys):
    assert launch.main([TARGET, "--out", str(tmp_path), "--no-train"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "leantrain run: nothing was patched: 1 trainer was built, but train() never ran (leantrain patches a trainer "
        "at the start of its train())"
    ]


def test_only_rank_0_says_nothing_was_patched_and_a_launcher_leaves_it_to_its_children(tmp_path, capsys, monkeypatch):
    script = tmp_path / "plain.py"
    script.write_text(NO_TRAINER.format(code=0))
    monkeypatch.setenv("RANK", "1")
    assert launch.main([str(script)]) == 0
    assert "nothing was patched" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    launch._say_if_nothing_patched(launch.Trainers(), launched=["simple_launcher"])
    assert capsys.readouterr().err == ""
    launch._say_if_nothing_patched(launch.Trainers(), launched=[])
    assert "nothing was patched" in capsys.readouterr().err


def test_console_script_in_a_subprocess(tmp_path):
    """A console script found through its entry point (a dist-info faked on PYTHONPATH) runs in the same process
    as ``leantrain run``, gets its argv, and its return value is the exit status."""
    site = tmp_path / "site"
    info = site / "fake_train-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-train\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[console_scripts]\nfake-train = {MODULE}:main\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "leantrain", "run", "--cggr", "fake-train", "--out", str(out), "--exit-code", "3"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.count("leantrain patch report (Trainer)") == 1
    got = result(out)
    assert got["argv"] == ["--out", str(out), "--exit-code", "3"]
    assert outcome(got["report"], "cggr")["status"] == "applied"


# Third-party notices the commands drop (cli/commands.py QUIET_LOGS, QUIET_WARNINGS), as they print
NOTICES = (
    "Setting accelerator to CPU",  # DeepSpeed
    "gemm_4bit_forward from kernels-community",  # bitsandbytes
    "FutureWarning: `gradient_checkpointing",  # transformers, for TRL's config default and calls
    "FutureWarning: `is_gradient_checkpointing",
)


def test_a_trl_script_under_run_prints_no_third_party_notice(tmp_path):
    """The same TRL SFT script under plain python shows which notices this environment produces; under
    `leantrain run` none of them reaches the output."""
    args = [str(REPO / "examples" / "train_sft.py"), "--steps", "1", "--seq", "32"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1"}

    def output(*command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    plain = output(sys.executable, *args, "--out", str(tmp_path / "plain"))
    seen = [notice for notice in NOTICES if notice in plain]
    if not seen:
        pytest.skip("this environment's packages print none of the notices the commands drop")
    ran = output(sys.executable, "-m", "leantrain", "run", *args, "--out", str(tmp_path / "run"))
    assert "leantrain patch report (sft trainer)" in ran
    assert [notice for notice in NOTICES if notice in ran] == [], (seen, ran[-3000:])


# --- what patch_trainer keeps with the run (with or without `run`) -------------------------------------------------


def test_record_composes_with_osft_and_unpatch_restores(tmp_path):
    """OSFT wraps save_model for its dense export; the record wraps it again. Checkpoints and the export both get
    leantrain.json, the export stays dense, and unpatch restores methods and callbacks by identity."""
    trainer = tiny_trainer(tmp_path / "run", steps=2)
    trainer.args.save_strategy, trainer.args.save_steps = SaveStrategy.STEPS, 2  # a checkpoint after step 2
    callbacks = list(trainer.callback_handler.callbacks)
    stock_save = trainer.save_model
    report = leantrain.patch_trainer(trainer, osft=True, cggr=False)
    assert report["osft"].status is leantrain.Status.APPLIED
    osft_save = trainer.save_model.__leantrain_original__
    assert osft_save.__leantrain_original__ == stock_save  # record wraps OSFT's wrapper, which wraps the stock one
    assert sum(isinstance(c, TrackerConfigCallback) for c in trainer.callback_handler.callbacks) == 1
    trainer.train()
    assert leantrain_entries(trainer.state.log_history) == []
    checkpoint = json.loads((tmp_path / "run" / "checkpoint-2" / RECORD_NAME).read_text())
    assert checkpoint["report"] == report.to_dict() and checkpoint["options"]["osft"]["source"] == "kwarg"

    export = tmp_path / "export"
    trainer.save_model(str(export))
    assert json.loads((export / RECORD_NAME).read_text())["report"] == report.to_dict()
    from safetensors.torch import load_file

    keys = load_file(str(export / "model.safetensors")).keys()
    assert "model.layers.0.self_attn.q_proj.weight" in keys and not any("U_low" in k for k in keys)  # dense

    leantrain.unpatch_trainer(trainer)
    assert "save_model" not in trainer.__dict__ and "_save" not in trainer.__dict__
    assert trainer.save_model == stock_save and trainer.callback_handler.callbacks == callbacks


def test_record_only_where_the_weights_are_written(tmp_path, monkeypatch):
    trainer = tiny_trainer(tmp_path, steps=1)
    with leantrain.patched(trainer, osft=False):
        trainer.train()
        monkeypatch.setattr(type(trainer.args), "should_save", property(lambda self: False))
        trainer.save_model(str(tmp_path / "not_main"))
        assert not (tmp_path / "not_main" / RECORD_NAME).exists()


# --- the trl CLI ---------------------------------------------------------------------------------------------------

RECIPE = """\
model_name_or_path: tiny-llama
dataset_name: data            # a local folder with train.jsonl ({"text": ...} rows)
output_dir: out
max_steps: 4
per_device_train_batch_size: 4
max_length: 128
learning_rate: 1.0e-3
logging_steps: 2
save_strategy: "no"
report_to: none
use_cpu: true
bf16: false
"""


def write_trl_recipe(root: Path) -> Path:
    """The README's `trl sft` example: a tiny local model and dataset, and the recipe above."""
    from leantrain.cli.tiny import corpus_texts, tiny_model, train_tokenizer

    tiny_model("llama", vocab_size=2048, hidden=64, layers=4).save_pretrained(root / "tiny-llama")
    train_tokenizer(2048).save_pretrained(root / "tiny-llama")
    (root / "data").mkdir()
    rows = [json.dumps({"text": text}) for text in corpus_texts()[:64]]
    (root / "data" / "train.jsonl").write_text("\n".join(rows) + "\n")
    (root / "recipe.yaml").write_text(RECIPE)
    return root / "recipe.yaml"


@pytest.mark.slow
def test_trl_sft_cli_with_a_yaml_recipe(tmp_path):
    """`leantrain run --cggr trl sft --config recipe.yaml`: the trl CLI starts its script through accelerate launch;
    the child runs under `leantrain run` with the same options, so the SFTTrainer it builds is patched."""
    pytest.importorskip("datasets")
    write_trl_recipe(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "leantrain", "run", "--cggr", "trl", "sft", "--config", "recipe.yaml"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert log.count("leantrain patch report (sft trainer)") == 1, log[-4000:]
    assert "nothing was patched" not in log  # the trl CLI's own process leaves that to the child it launched
    record = json.loads((tmp_path / "out" / RECORD_NAME).read_text())
    assert record["report"]["trainer_kind"] == "sft" and record["options"]["cggr"] == {
        "value": True,
        "source": "cli",
    }
    assert outcome(record["report"], "cggr")["status"] == "applied"
    assert (tmp_path / "out" / "model.safetensors").is_file()
