import warnings

import pytest
import torch
from transformers import Trainer

import leantrain
from leantrain import NotReadyError, Status, patch_trainer, unpatch_trainer
from leantrain.config import OPTIMIZATIONS
from leantrain.entry import command_line
from leantrain.optimization import NotAvailable, registry

from ._fakes import FakeLossOpt, tiny_trainer


# The fake sits in the cggr slot, whose default is off (opt-in): these tests ask for auto through the environment.
AUTO = {"LEANTRAIN_CGGR": "auto"}


@pytest.fixture
def fake(monkeypatch):
    """Replace the registry with one fake optimization (cggr slot) plus placeholders for the rest."""
    opt = FakeLossOpt()
    fakes = {name: opt if name == "cggr" else NotAvailable(name) for name in OPTIMIZATIONS}
    monkeypatch.setattr("leantrain.entry.registry", lambda: fakes)
    return opt


def test_real_registry_lists_every_optimization():
    """Every name of the option table is a shipped optimization, registered under its name, in the table's order."""
    real = registry()
    assert list(real) == list(OPTIMIZATIONS)
    assert all(opt.implemented and opt.name == name for name, opt in real.items())


def test_patch_then_unpatch_restores_by_identity(tmp_path, fake):
    trainer = tiny_trainer(tmp_path)
    assert "compute_loss" not in trainer.__dict__
    report = patch_trainer(trainer, environ=AUTO)
    assert report["cggr"].status is Status.APPLIED and report["cggr"].targets == ("trainer.compute_loss",)
    assert trainer.compute_loss.__leantrain_original__.__func__ is Trainer.compute_loss
    assert trainer.leantrain_report is report
    unpatch_trainer(trainer)
    assert "compute_loss" not in trainer.__dict__ and trainer.compute_loss.__func__ is Trainer.compute_loss
    assert not hasattr(trainer, "leantrain_report") and leantrain.current_report(trainer) is None


def test_patching_twice_is_a_recorded_no_op(tmp_path, fake):
    trainer = tiny_trainer(tmp_path)
    patch_trainer(trainer, environ=AUTO)
    wrapped = trainer.compute_loss
    again = patch_trainer(trainer, environ=AUTO)
    assert trainer.compute_loss is wrapped and "already patched" in again.notes[-1]
    unpatch_trainer(trainer)
    assert trainer.compute_loss.__func__ is Trainer.compute_loss


def test_auto_skips_with_reasons_required_raises(tmp_path, fake):
    fake.reasons = ("needs a GPU with sm90",)
    trainer = tiny_trainer(tmp_path)
    report = patch_trainer(trainer, environ=AUTO)
    assert report["cggr"].status is Status.SKIPPED and report["cggr"].reasons == ("needs a GPU with sm90",)
    assert "compute_loss" not in trainer.__dict__
    unpatch_trainer(trainer)
    with pytest.raises(NotReadyError, match="cggr is required but not ready: needs a GPU with sm90"):
        patch_trainer(trainer, cggr=True, environ=AUTO)
    with pytest.raises(NotReadyError, match="strict mode"):
        patch_trainer(trainer, environ={**AUTO, "LEANTRAIN_STRICT": "1"})
    assert "compute_loss" not in trainer.__dict__ and leantrain.current_report(trainer) is None


def test_measured_slower_skips_in_auto_and_applies_on_request(tmp_path, fake):
    """The auto rule lives in the entry point, in one wording: a probe that measured its path slower is skipped in
    auto mode (strict mode does not raise on the choice) and applied when asked for, the evidence in the report."""
    fake.slower = "measured slower on the fake shape (H100, 2026-01-01, 10 -> 11 ms)"
    for environ in (AUTO, {**AUTO, "LEANTRAIN_STRICT": "1"}):
        trainer = tiny_trainer(tmp_path)
        outcome = patch_trainer(trainer, environ=environ)["cggr"]
        assert outcome.status is Status.SKIPPED and "compute_loss" not in trainer.__dict__
        assert outcome.reasons == (f"{fake.slower}; pass cggr=True to apply anyway",)
    trainer = tiny_trainer(tmp_path)
    outcome = patch_trainer(trainer, cggr=True, environ=AUTO)["cggr"]
    assert outcome.status is Status.APPLIED and outcome.targets == ("trainer.compute_loss",)
    assert outcome.detail == f"fake path; applied on request (cggr=True); {fake.slower}"
    unpatch_trainer(trainer)


def test_auto_rule_beside_blockers_strict_raises_only_where_auto_would_apply(tmp_path, fake):
    """A probe that finds blockers still gives its auto rule. Where auto mode would not apply the optimization
    anyway, the skip names the rule and what would stop ``<name>=True`` too, and strict mode does not raise; asked
    for, the blockers raise. Where auto mode would apply it, strict mode raises with the blockers."""
    fake.reasons = ("needs a GPU with sm90",)
    fake.slower = "not measured on the fake device"
    for environ in (AUTO, {**AUTO, "LEANTRAIN_STRICT": "1"}):
        outcome = patch_trainer(tiny_trainer(tmp_path), environ=environ)["cggr"]
        assert outcome.status is Status.SKIPPED
        assert outcome.reasons == ("not measured on the fake device; cggr=True would not apply either: needs a GPU "
                                   "with sm90",)  # fmt: skip
    with pytest.raises(NotReadyError, match="^cggr is required but not ready: needs a GPU with sm90$"):
        patch_trainer(tiny_trainer(tmp_path), cggr=True, environ={**AUTO, "LEANTRAIN_STRICT": "1"})
    fake.slower = ""  # due here: strict mode raises with the blockers
    with pytest.raises(
        NotReadyError, match="^cggr applies here but is not ready .strict mode.: needs a GPU with sm90$"
    ):
        patch_trainer(tiny_trainer(tmp_path), environ={**AUTO, "LEANTRAIN_STRICT": "1"})


def test_readiness_carries_blockers_and_the_auto_rule():
    from leantrain.optimization import Readiness

    ready = Readiness(detail="d", plan="p")
    assert ready.ready and ready.due and not ready.blocked
    slower = Readiness.slower("measured slower", "d", "p")
    assert not slower.ready and not slower.due and not slower.blocked and slower.plan == "p"
    blocked = Readiness.no("a blocker")
    assert not blocked.ready and blocked.due and blocked.blocked
    both = blocked.with_auto_rule("not measured")
    assert not both.due and both.blocked and both.reasons == ("a blocker",) and both.slower_evidence == "not measured"
    assert blocked.with_auto_rule(None) == blocked
    nothing = Readiness.not_applicable("no LM head")
    assert not nothing.due and nothing.blocked


def test_signature_names_every_optimization():
    """Every optimization's toggle is a keyword of patch_trainer (so help() shows it), in apply order."""
    import inspect

    params = inspect.signature(patch_trainer).parameters
    toggles = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in ("strict", "environ")]
    assert toggles == list(OPTIMIZATIONS)


def test_strict_does_not_raise_when_nothing_applies(tmp_path, fake):
    fake.applicable = False
    report = patch_trainer(tiny_trainer(tmp_path), strict=True, environ=AUTO)
    assert report["cggr"].status is Status.SKIPPED and report["cggr"].reasons == ("nothing to optimize here",)


def test_disable_and_off(tmp_path, fake):
    report = patch_trainer(tiny_trainer(tmp_path), environ={**AUTO, "LEANTRAIN_DISABLE": "1"})
    assert all(o.status is Status.DISABLED for o in report.outcomes)
    report = patch_trainer(tiny_trainer(tmp_path), cggr=False, environ=AUTO)
    assert report["cggr"].status is Status.DISABLED and report["cggr"].source == "kwarg"
    report = patch_trainer(tiny_trainer(tmp_path), environ={"LEANTRAIN_CGGR": "0"})
    assert report["cggr"].source == "env"


KILL = {"LEANTRAIN_DISABLE": "1"}


@pytest.mark.parametrize(
    "environ, kwargs, status, why",
    [
        # the kill switch beats every environment toggle, auto or required
        (
            {**KILL, "LEANTRAIN_CGGR": "1"},
            {},
            Status.DISABLED,
            "LEANTRAIN_DISABLE=1 (the kill switch) overrides LEANTRAIN_CGGR=1",
        ),
        ({**KILL, "LEANTRAIN_CGGR": "auto"}, {}, Status.DISABLED, "overrides LEANTRAIN_CGGR=auto"),
        ({**KILL, "LEANTRAIN_CGGR": "1", "LEANTRAIN_STRICT": "1"}, {}, Status.DISABLED, "the kill switch"),
        (KILL, {}, Status.DISABLED, "LEANTRAIN_DISABLE=1 (the kill switch)"),
        (KILL, {"cggr": False}, Status.DISABLED, "the kill switch"),
        ({"LEANTRAIN_CGGR": "1"}, {"disable": True}, Status.DISABLED, "disable=True (the kill switch) overrides"),
        # only a keyword in code that asks for the optimization overrides it
        (KILL, {"cggr": True}, Status.APPLIED, ""),
        ({**KILL, "LEANTRAIN_CGGR": "0"}, {"cggr": True}, Status.APPLIED, ""),
        # switch off: the toggles decide as usual
        ({"LEANTRAIN_DISABLE": "0", "LEANTRAIN_CGGR": "1"}, {}, Status.APPLIED, ""),
    ],
)
def test_kill_switch_precedence(tmp_path, fake, environ, kwargs, status, why):
    report = patch_trainer(tiny_trainer(tmp_path), environ=environ, **kwargs)
    outcome = report["cggr"]
    assert outcome.status is status, outcome
    if status is Status.DISABLED:
        assert why in outcome.reasons[0] and outcome.source == ("kwarg" if "disable" in kwargs else "env")
        assert all(o.status is Status.DISABLED for o in report.outcomes)
    elif "LEANTRAIN_DISABLE" in environ and environ["LEANTRAIN_DISABLE"] == "1":
        assert report.notes == ("the kill switch is on, but cggr=True in code overrides it",)
    else:
        assert report.notes == ()


CLI_ONLY = "; only cggr=True in code or --cggr on the command line overrides the switch"


@pytest.mark.parametrize(
    "environ, cli, kwargs, status, source, why",
    [
        # a flag is an explicit request, like a keyword: it overrides the switch from the environment
        (KILL, {"cggr": True}, {}, Status.APPLIED, "cli", "the kill switch is on, but --cggr on the command line"),
        (
            KILL,
            {"cggr": "auto"},
            {},
            Status.DISABLED,
            "env",
            "LEANTRAIN_DISABLE=1 (the kill switch) overrides --opt cggr=auto" + CLI_ONLY,
        ),
        ({**KILL, "LEANTRAIN_CGGR": "1"}, {}, {}, Status.DISABLED, "env", "overrides LEANTRAIN_CGGR=1" + CLI_ONLY),
        # the switch on the command line: the environment's toggles lose, a keyword in code wins
        (
            {"LEANTRAIN_CGGR": "1"},
            {"disable": "1"},
            {},
            Status.DISABLED,
            "cli",
            "--opt disable=1 (the kill switch) overrides LEANTRAIN_CGGR=1; only cggr=True in code overrides "
            "the switch",
        ),
        (
            {},
            {"disable": "1"},
            {"cggr": True},
            Status.APPLIED,
            "kwarg",
            "the kill switch is on, but cggr=True in code",
        ),
        # the switch in code: a flag ranks below it
        (
            {},
            {"cggr": True},
            {"disable": True},
            Status.DISABLED,
            "kwarg",
            "disable=True (the kill switch) overrides --cggr",
        ),
        # no switch: keyword > command line > environment
        ({"LEANTRAIN_CGGR": "0"}, {"cggr": True}, {}, Status.APPLIED, "cli", ""),
        ({"LEANTRAIN_CGGR": "1"}, {"cggr": True}, {"cggr": False}, Status.DISABLED, "kwarg", "turned off"),
    ],
)
def test_kill_switch_meets_the_command_line(tmp_path, fake, environ, cli, kwargs, status, source, why):
    with command_line(cli):
        report = patch_trainer(tiny_trainer(tmp_path), environ=environ, **kwargs)
    outcome = report["cggr"]
    assert (outcome.status, outcome.source) == (status, source), outcome
    said = outcome.reasons[0] if status is Status.DISABLED else " ".join(report.notes)
    assert why in said if why else said == "", said


def test_kill_switch_and_a_flag_on_the_same_command_line_contradict(tmp_path, fake):
    with command_line({"disable": "1", "cggr": True}), pytest.raises(ValueError, match=r"--opt disable=1 and --cggr"):
        patch_trainer(tiny_trainer(tmp_path), environ={})


def test_kill_switch_and_required_keyword_contradict(tmp_path, fake):
    with pytest.raises(ValueError, match=r"disable=True, cggr=True.*contradict"):
        patch_trainer(tiny_trainer(tmp_path), disable=True, cggr=True, environ={})


def test_not_built_optimizations_are_skipped_not_crashing(tmp_path, fake):
    report = patch_trainer(tiny_trainer(tmp_path), environ=AUTO)
    assert report["grpo_logps"].status is Status.SKIPPED
    assert report["grpo_logps"].reasons == ("not available in this version",)


@pytest.mark.expect_fallback
def test_runtime_failure_falls_back_once_and_training_goes_on(tmp_path, fake):
    fake.fail_at_call = 2
    trainer = tiny_trainer(tmp_path, steps=4)
    patch_trainer(trainer, environ=AUTO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours = [w for w in caught if "leantrain: cggr failed at run time" in str(w.message)]
    assert len(ours) == 1 and "injected failure" in str(ours[0].message)
    assert trainer.state.global_step == 4 and fake.calls == 2  # fast path not tried again after the failure
    outcome = leantrain.current_report(trainer)["cggr"]
    assert outcome.status is Status.FAILED and "injected failure" in outcome.reasons[0]
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_runtime_failure_reraises_in_strict_mode(tmp_path, fake):
    fake.fail_at_call = 1
    trainer = tiny_trainer(tmp_path)
    patch_trainer(trainer, strict=True, environ=AUTO)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train()


def test_patched_context_manager(tmp_path, fake):
    trainer = tiny_trainer(tmp_path)
    with leantrain.patched(trainer, environ=AUTO) as report:
        assert "compute_loss" in trainer.__dict__ and report.applied == ("cggr",)
    assert "compute_loss" not in trainer.__dict__


def test_unsupported_trainers_raise():
    import trl

    with pytest.raises(TypeError, match="needs a transformers.Trainer"):
        patch_trainer(object(), environ=AUTO)
    dpo = object.__new__(trl.DPOTrainer)
    with pytest.raises(TypeError, match="unsupported trainer DPOTrainer"):
        leantrain.trainer_kind(dpo)


def test_report_table_and_dict(tmp_path, fake):
    fake.reasons = ("a reason",)
    report = patch_trainer(tiny_trainer(tmp_path), environ=AUTO)
    text = str(report)
    assert "optimization" in text and "a reason" in text and "not available in this version" in text
    rows = [line for line in text.splitlines()[1:] if line.strip()]
    assert len({line.index(line.split()[1]) for line in rows[2:]}) == 1  # status column aligned
    as_dict = report.to_dict()
    assert next(o for o in as_dict["outcomes"] if o["name"] == "cggr") == {
        "name": "cggr",
        "status": "skipped",
        "source": "env",
        "reasons": ["a reason"],
        "targets": [],
        "detail": "",
    }
    with pytest.raises(Exception):
        report.trainer_kind = "x"  # frozen


def test_fallback_lets_control_flow_through():
    """Checkpoint's early-stop exception and user errors propagate; neither counts as a run-time failure."""
    from torch.utils.checkpoint import _StopRecomputationError

    from leantrain.fallback import RuntimeFallback, UserInputError

    fallback = RuntimeFallback("x", strict=False)
    for error in (_StopRecomputationError(), UserInputError("bad ratio")):

        def fast(error=error):
            raise error

        with pytest.raises(type(error)):
            fallback.call(fast, lambda: "stock")
    assert fallback.failed is None
    assert fallback.call(lambda: "fast", lambda: "stock") == "fast"


def test_apply_failing_half_way_leaves_nothing_patched(tmp_path, fake, monkeypatch):
    """Patches recorded on ctx.undo before apply() raises are undone by patch_trainer."""

    def apply(trainer, plan, ctx):
        ctx.undo.set_attr(trainer, "compute_loss", lambda *a, **k: None)
        raise RuntimeError("apply broke")

    monkeypatch.setattr(fake, "apply", apply)
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(RuntimeError, match="apply broke"):
        patch_trainer(trainer, environ=AUTO)
    assert "compute_loss" not in trainer.__dict__ and leantrain.current_report(trainer) is None


def test_a_failing_import_in_a_probe_declines_instead_of_escaping(tmp_path, fake, monkeypatch):
    """TRL's and transformers' lazy modules re-raise a missing dependency as a RuntimeError: the probe's import
    failure becomes its reason (auto: skipped; required: NotReadyError naming it), never a crash."""

    def probe(trainer, ctx):
        try:
            raise ImportError("No module named 'requests'")
        except ImportError as missing:
            raise RuntimeError("Failed to import trl.trainer.grpo_trainer") from missing

    monkeypatch.setattr(fake, "probe", probe)
    report = patch_trainer(tiny_trainer(tmp_path), environ=AUTO)
    assert report["cggr"].status is Status.SKIPPED
    assert report["cggr"].reasons == ("an import it needs failed (ImportError: No module named 'requests')",)
    with pytest.raises(NotReadyError, match="cggr is required but not ready: an import it needs failed"):
        patch_trainer(tiny_trainer(tmp_path), cggr=True, environ={})
    monkeypatch.setattr(fake, "probe", lambda trainer, ctx: 1 / 0)  # any other error is a bug: it is raised
    with pytest.raises(ZeroDivisionError):
        patch_trainer(tiny_trainer(tmp_path), environ=AUTO)
