"""The comparison's PNG: loss curves and step-time distributions of the four runs."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from ._measure import Measurement
from .verdict import ORDER


def plot(runs: Sequence[Measurement], result: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = {"stock": "tab:blue", "leantrain": "tab:orange"}
    for index, (run, mode) in enumerate(zip(runs, ORDER)):
        points = [(s, v) for s, v in zip(run.steps, run.losses) if v is not None]
        if points:
            xs, ys = zip(*points)
            style = {"linewidth": 3, "alpha": 0.45} if mode == "stock" else {"linestyle": "--", "linewidth": 1.5}
            left.plot(xs, ys, color=colors[mode], label=f"{index + 1}: {run.label or mode}", **style)
    left.set_xlabel("optimizer step")
    left.set_ylabel("training loss")
    left.set_title(f"losses: {result['losses']['rule']}", fontsize=8)
    left.legend(fontsize=8)
    cuts = [run["cut"] for run in result["steady"]["runs"]]
    data = [run.step_ms[cut:] for run, cut in zip(runs, cuts)]
    box = right.boxplot(data, whis=(0, 100), widths=0.5, patch_artist=True)
    for patch, mode in zip(box["boxes"], ORDER):
        patch.set_facecolor(colors[mode])
        patch.set_alpha(0.4)
    for index, (run, cut) in enumerate(zip(runs, cuts)):
        right.scatter([index + 1] * len(data[index]), data[index], s=10, color="black", zorder=3)
        if cut:
            right.scatter([index + 1] * cut, run.step_ms[:cut], s=14, marker="x", color="grey", zorder=3)
    right.set_xticks(range(1, len(runs) + 1), [f"{i + 1}: {r.label}" for i, r in enumerate(runs)], fontsize=8)
    right.set_ylabel("step time (ms)")
    caption = f"step times after each run's cut (x: left out; {result['steady']['rule']}); {result['text']}"
    right.set_title(textwrap.fill(caption, 90), fontsize=8)
    fig.suptitle(textwrap.shorten(title, 150, placeholder=" ..."), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
