"""The demo's timeline picture: training went on through both reconfigurations, and what each cost.

Top: the loss of every step against the iteration, coloured by generation, with the cut of each
reconfiguration marked and labelled (trigger, new layout, pause, bytes). Bottom: the iteration against
wall-clock time; each handoff is a shaded band from the event's publication to the commit (the job kept
training meanwhile, so the line keeps rising through it) and its pause, the only time training stood
still, is a red band at the cut.
"""

from __future__ import annotations

from pathlib import Path

from liver.demo.summary import DemoResult


def write_timeline(
    result: DemoResult, path: Path, trigger_times: dict[int, float], switch_ends: dict[int, float]
) -> Path:
    """Write the PNG and return its path.

    ``trigger_times[g]`` is when the event behind generation ``g`` was published, ``switch_ends[g]`` when
    its last worker finished switching, both in seconds since the run started.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not result.steps:
        raise ValueError("`steps`: no training step was recorded, nothing to draw")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]})
    colours = plt.get_cmap("tab10")
    generations = sorted({p.generation for p in result.steps})
    layouts = {g.generation: g.layout_after for g in result.generations}
    first = result.generations[0].layout_before if result.generations else ""
    for i, gen in enumerate(generations):
        points = [p for p in result.steps if p.generation == gen]
        label = f"gen {gen}: {layouts.get(gen, first)}"
        top.plot(
            [p.iteration for p in points],
            [p.loss for p in points],
            marker="o",
            markersize=3,
            color=colours(i),
            label=label,
        )
        bottom.plot([p.t for p in points], [p.iteration for p in points], color=colours(i), label=label)
    for row in result.generations:
        if row.outcome != "committed" or row.cut_iteration is None:
            continue
        top.axvline(row.cut_iteration + 0.5, color="grey", linestyle="--", linewidth=1)
        note = (
            f"{row.trigger} -> {row.layout_after}\n"
            f"pause {row.downtime_s:.2f} s, {(row.bytes_moved or 0) / 2**20:.2f} MiB moved"
        )
        top.annotate(
            note,
            xy=(row.cut_iteration + 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -4),
            textcoords="offset points",
            va="top",
            fontsize=8,
        )
        start = trigger_times.get(row.generation)
        end = switch_ends.get(row.generation)
        if start is not None and end is not None:
            bottom.axvspan(start, end, color="gold", alpha=0.25, linewidth=0)
            bottom.text(start, 0.98, " handoff", transform=bottom.get_xaxis_transform(), va="top", fontsize=8)
        if end is not None and row.downtime_s:
            bottom.axvspan(end - row.downtime_s, end, color="red", alpha=0.5, linewidth=0)
    top.set_xlabel("iteration")
    top.set_ylabel("training loss")
    if "fail-stop" in result.scenario:
        source = "its peer copy" if "distributed-optimizer" in result.scenario else "its replica"
        title = f"LiveR: a lost worker recovered live from {source}, then a live scale-out"
    else:
        title = "LiveR: live scale-in and scale-out of a Megatron-core GPT, training throughout"
    top.set_title(title)
    top.legend(loc="lower left", fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_xlabel("seconds since start")
    bottom.set_ylabel("iteration")
    bottom.grid(alpha=0.3)
    bottom.set_title(
        "progress: handoff in flight (yellow, training continues), pause at the cut (red)", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
