"""``liver bench stream``'s report as text: the figures a reader compares first, then the breakdowns.

Kept apart from :mod:`.report` so that the report's schema and the judgement of its numbers read
without the layout of a terminal table.
"""

from __future__ import annotations

from liver.bench.report import check_line, size
from liver.bench.stream.report import StreamBenchReport, rate


def print_report(r: StreamBenchReport) -> None:
    """The report as tables on stdout."""
    c, s = r.config, r.stream
    out = []
    out.append(f"liver bench stream{' (quick)' if c.quick else ''}: {r.date}, {r.machine}")
    out.append(f"load average (1 min) before / after: {r.load_average[0]:.2f} / {r.load_average[1]:.2f}")
    out.append(
        f"state {size(c.state_bytes, 2)} ({c.model.name}: {c.model.parameter_count():,} parameters, "
        f"{c.model.num_layers} layers, vocab {c.model.vocab_size}; parameters + fp32 master + Adam, "
        f"{'distributed optimizer' if c.model.distributed else 'plain optimizer'}), "
        f"{c.old_layout} -> {c.new_layout} on {c.procs} processes ({c.backend})"
    )
    out.append(
        f"B {size(c.budget_bytes, 2)}: one buffer for staged pieces and send copies (at most "
        f"{size(c.send_copy_budget_bytes, 2)} of copies, messages {size(c.message_bytes, 2)}); "
        f"{c.rounds} streaming rounds"
    )
    out.append("")
    out.append(
        f"moved over the network   {size(s.bytes_moved, 2)}   (copied locally {size(s.bytes_local, 2)})"
    )

    def runs(seconds: list[float]) -> str:
        return ", ".join(f"{x:.3f}" for x in seconds)

    out.append(
        f"raw send/recv ceiling    {rate(s.raw_ceiling_bytes_per_s):>10}   runs {runs(s.raw_seconds)} s"
    )
    out.append(
        f"raw + local copies       {rate(s.floor_bytes_per_s):>10}   runs {runs(s.floor_seconds)} s "
        f"({s.floor_ratio:.1%} of the ceiling: the floor of any executor here)"
    )
    out.append(
        f"stream, preallocated     {rate(s.throughput_bytes_per_s):>10}   runs {runs(s.into_seconds)} s "
        f"({s.ratio_to_floor:.1%} of the floor best/best, {s.median_ratio_to_floor:.1%} median/median; "
        f"{s.ratio:.1%} of the ceiling)"
    )
    out.append(
        f"stream, allocated before {rate(s.alloc_throughput_bytes_per_s):>10}   "
        f"runs {runs(s.alloc_seconds)} s "
        f"({s.alloc_ratio_to_floor:.1%} of the floor best/best, {s.alloc_median_ratio_to_floor:.1%} "
        f"median/median; {s.alloc_ratio:.1%} of the ceiling; allocating took "
        f"{runs(s.alloc_prepare_seconds)} s beforehand)"
    )
    out.append(
        f"  of which the executor  preallocated {runs(s.into_executor_seconds)} s, "
        f"allocated before {runs(s.alloc_executor_seconds)} s (the rest: its input checks)"
    )
    out.append(
        f"bit-exact                {'yes' if s.bit_exact else 'NO'} "
        f"({s.tensors_checked} shards per repeat and mode)"
    )
    out.append("")
    out.append(
        "extra memory per process: peak (buffer + layer under assembly) <= B + largest new layer shard"
    )
    out.append(
        f"{'process':>7}  {'old':>3}  {'new':>3}  {'buffer':>10}  ({'staged':>9} {'copies':>9})  "
        f"{'largest layer':>13}  {'peak extra':>10}  {'B + layer':>9}  {'RSS extra':>10}"
    )
    for m in r.memory:
        rss = size(m.rss_extra_bytes, 2) if m.rss_extra_bytes is not None else "n/a"
        out.append(
            f"{m.process:>7}  {_rank(m.old_rank):>3}  {_rank(m.new_rank):>3}  {size(m.buffer_bytes, 2):>10}  "
            f"({size(m.staging_bytes, 2):>9} {size(m.peak_send_copy_bytes, 2):>9})  "
            f"{size(m.largest_new_layer_bytes, 2):>13}  {size(m.peak_extra_bytes, 2):>10}  "
            f"{size(m.bound_bytes, 2):>9}  {rss:>10}"
        )
    out.append("")
    out.append("                      preallocated   allocated before")
    out.append("layer  rounds   seconds  waiting   seconds  waiting       moved       local  throughput")
    for row in r.layers:
        throughput = rate(row.bytes_moved / row.seconds) if row.seconds > 0 and row.bytes_moved else "-"
        out.append(
            f"{row.layer:>5}  {row.rounds:>6}  {row.seconds:>8.4f}  {row.wait_seconds:>7.4f}  "
            f"{row.seconds_allocating:>8.4f}  {row.wait_seconds_allocating:>7.4f}  "
            f"{size(row.bytes_moved, 2):>10}  {size(row.bytes_local, 2):>10}  {throughput:>10}"
        )
    if r.loop is not None:
        lp = r.loop
        out.append("")
        after = "n/a" if lp.after_ratio is None else f"{lp.after_ratio:.4f}"
        out.append(
            f"loop cost of one preparation {lp.extra_seconds * 1000:+.1f} ms (median), CPU time it takes "
            f"{lp.prepare_cpu_seconds * 1000:+.1f} ms per process; steps during it "
            f"{lp.during_ratio:.4f}x, after it (shadow world idle) {after}x"
        )
        out.append(
            f"training-like loop: {lp.steps} steps x {lp.repeats} pairs, "
            f"{lp.step_seconds_alone * 1000:.2f} ms/step alone; "
            f"with/alone {', '.join(f'{x:.4f}' for x in lp.ratios)} (median {lp.median_ratio:.4f}, "
            f"quartiles {lp.ratio_quartiles[0]:.4f}-{lp.ratio_quartiles[1]:.4f})"
        )
        out.append(
            f"shadow preparation (world, then stream group) done after "
            f"{', '.join(f'{x * 1000:.0f}' for x in lp.prepare_seconds)} ms; "
            f"{'all' if lp.prepared_within_loop else 'NOT all'} within their loop segment"
        )
    out.append("")
    out.extend(check_line(ch) for ch in r.checks)
    print("\n".join(out))


def _rank(r: int | None) -> str:
    return "-" if r is None else str(r)
