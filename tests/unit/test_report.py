"""``str(PatchReport)``: the table stays within the line length, a long reason continuing under its column with
every word kept."""

from __future__ import annotations

from leantrain.report import PatchOutcome, PatchReport, Status


WIDTH = 119  # the line length the report keeps to


LONG = (
    "2 experts modules (linear4bit); slow path: grouped_mm on cpu with float32 runs one GEMM per group (bf16 on "
    "sm90/sm100 is the fast path); linear4bit recompute on (measured: H100, 2026-11-25, gpt-oss-20b layer, 4096 "
    "tokens: 10.08 ms / 1.41 GiB peak; saved stacks 9.57 ms / 2.45 GiB (moe_recompute=0 when the memory is there))"
)
PATH = "/a/" + "very-long-folder-name/" * 8 + "model.safetensors"  # one word wider than the reason column


def report() -> PatchReport:
    return PatchReport(
        "sft",
        (
            PatchOutcome("moe4bit", Status.APPLIED, "default", detail=LONG, targets=("a", "b")),
            PatchOutcome("compile_layers", Status.SKIPPED, "default", reasons=(LONG, "pass compile_layers=False")),
            PatchOutcome("osft", Status.DISABLED, "kwarg", reasons=("turned off",)),
            PatchOutcome("cggr", Status.SKIPPED, "env", reasons=(f"no weights at {PATH}",)),
        ),
        notes=("the kill switch is on, but " + LONG,),
    )


def test_every_line_fits_and_long_reasons_continue_under_the_reason_column():
    text = str(report())
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    column = lines[1].index("reason")
    assert column == lines[1].index("source") + len("default  ")
    starts = [i for i, line in enumerate(lines) if line.split()[0] in {"moe4bit", "compile_layers", "osft", "cggr"}]
    assert len(starts) == 4 and starts[1] - starts[0] > 2  # a 370-character reason takes several lines
    for start, end in zip(starts, [*starts[1:], lines.index(next(x for x in lines if x.startswith("note: ")))]):
        continuation = lines[start + 1 : end]
        assert all(line[:column].isspace() and line[column] != " " for line in continuation), continuation


def test_nothing_is_lost_in_the_wrapping():
    rep = report()
    lines = str(rep).splitlines()
    column = lines[1].index("reason")
    by_name: dict[str, list[str]] = {}
    current = None
    for line in lines[3:]:
        if line.startswith("note: "):
            break
        if not line[0].isspace():
            current = line.split()[0]
            by_name[current] = [line[column:]]
        else:
            by_name[current].append(line[column:])
    assert " ".join(by_name["moe4bit"]).split() == (LONG + " (2 targets)").split()
    assert " ".join(by_name["compile_layers"]).split() == (LONG + "; pass compile_layers=False").split()
    assert by_name["osft"] == ["turned off"]
    assert "".join(by_name["cggr"]).replace(" ", "") == f"noweightsat{PATH}"  # split inside, every character kept
    notes = [line[len("note: ") :] for line in lines[lines.index(next(x for x in lines if x.startswith("note: "))) :]]
    assert " ".join(notes).split() == ("the kill switch is on, but " + LONG).split()


def test_a_short_report_is_one_line_per_optimization():
    short = PatchReport("trainer", (PatchOutcome("osft", Status.DISABLED, "kwarg", reasons=("turned off",)),))
    assert str(short).splitlines() == [
        "leantrain patch report (Trainer)",
        "optimization  status    source  reason",
        "------------  --------  ------  ------",
        "osft          disabled  kwarg   turned off",
    ]
