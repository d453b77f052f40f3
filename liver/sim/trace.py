"""Capacity traces: what happens to the job's nodes, when, and with how much notice.

An event is announced at ``time`` (seconds from the start) and takes effect ``notice`` seconds later:
``remove`` takes the node away at ``time + notice`` (a spot reclaim with its warning; ``notice = 0`` is an
unannounced fail-stop), ``add`` gives the job a new node at ``time + notice``. A trace starts from named
initial nodes of ``devices_per_node`` devices each.

Traces are either generated (the paper's volatility regimes: an event every 60, 30 or 10 minutes on
average) or read from CSV with the header ``time,node,kind,notice`` (blank lines and lines starting with
``#`` are skipped). Reading is strict: every problem is reported with its line and field, including events
that could not happen (removing a node the job does not hold at that moment, adding one it holds).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from liver.shared.errors import InputError

Kind = Literal["add", "remove"]
KINDS: tuple[str, ...] = ("add", "remove")
HEADER = ("time", "node", "kind", "notice")

REGIMES: dict[str, float] = {"low": 3600.0, "medium": 1800.0, "high": 600.0}
"""Mean seconds between events of the paper's volatility regimes (section 6.4)."""

Arrivals = Literal["poisson", "uniform"]


class TraceError(InputError):
    """A trace that cannot be replayed; the message names the line and field when it came from a file."""


class CapacityEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    time: float
    node: str
    kind: Kind
    notice: float
    line: int = 0
    """Line of the CSV file it came from (0 for a generated event)."""

    @property
    def effect_time(self) -> float:
        return self.time + self.notice

    def where(self) -> str:
        return f"line {self.line}" if self.line else f"event at t={self.time:g}"


class Trace(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str
    initial_nodes: tuple[str, ...]
    devices_per_node: int
    duration_s: float
    events: tuple[CapacityEvent, ...]

    def __post_init__(self) -> None:
        check_trace(self)


def node_name(index: int) -> str:
    """The project's node naming (``liver.shared.layout.grid_devices``): ``node000``, ``node001``, ..."""
    return f"node{index:03d}"


def initial_nodes(count: int) -> tuple[str, ...]:
    return tuple(node_name(i) for i in range(count))


def check_trace(trace: Trace) -> None:
    """Raise :class:`TraceError` unless every event is well formed and possible in order of effect."""
    if trace.devices_per_node < 1:
        raise TraceError(f"devices_per_node must be at least 1, got {trace.devices_per_node}")
    if not (math.isfinite(trace.duration_s) and trace.duration_s > 0):
        raise TraceError(f"duration must be a positive number of seconds, got {trace.duration_s}")
    if len(set(trace.initial_nodes)) != len(trace.initial_nodes):
        raise TraceError("initial nodes name a node twice")
    previous = 0.0
    for ev in trace.events:
        _check_event_fields(ev, trace.duration_s)
        if ev.time < previous:
            raise TraceError(
                f"{ev.where()}, field 'time': {ev.time:g} is earlier than the previous event's {previous:g}"
            )
        previous = ev.time
    held = set(trace.initial_nodes)
    order = sorted(range(len(trace.events)), key=lambda i: (trace.events[i].effect_time, i))
    for i in order:
        ev = trace.events[i]
        if ev.kind == "add":
            if ev.node in held:
                raise TraceError(
                    f"{ev.where()}, field 'node': {ev.node} is added at t={ev.effect_time:g} "
                    "but the job already holds it"
                )
            held.add(ev.node)
        else:
            if ev.node not in held:
                raise TraceError(
                    f"{ev.where()}, field 'node': {ev.node} is removed at t={ev.effect_time:g} "
                    "but the job does not hold it then"
                )
            held.remove(ev.node)


def _check_event_fields(ev: CapacityEvent, duration: float) -> None:
    where = ev.where()
    if not math.isfinite(ev.time) or ev.time < 0:
        raise TraceError(f"{where}, field 'time': must be a non-negative number of seconds, got {ev.time}")
    if ev.time >= duration:
        raise TraceError(f"{where}, field 'time': {ev.time:g} is not before the trace's end ({duration:g} s)")
    if not math.isfinite(ev.notice) or ev.notice < 0:
        raise TraceError(
            f"{where}, field 'notice': must be a non-negative number of seconds, got {ev.notice}"
        )
    if ev.kind not in KINDS:
        raise TraceError(f"{where}, field 'kind': must be add or remove, got {ev.kind!r}")
    if not ev.node or any(c.isspace() or c == "," for c in ev.node):
        raise TraceError(f"{where}, field 'node': {ev.node!r} is not a node name")


def parse_csv(
    text: str, *, initial: Sequence[str], devices_per_node: int, duration_s: float, name: str = "trace.csv"
) -> Trace:
    """A trace from CSV text (see the module docstring); errors read ``NAME line N, field 'F': ...``."""
    events: list[CapacityEvent] = []
    header_seen = False
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if not header_seen:
            if tuple(f.lower() for f in fields) != HEADER:
                raise TraceError(
                    f"{name} line {lineno}: expected the header {','.join(HEADER)}, got {line!r}"
                )
            header_seen = True
            continue
        if len(fields) != len(HEADER):
            raise TraceError(
                f"{name} line {lineno}: expected {len(HEADER)} fields ({','.join(HEADER)}), got {len(fields)}"
            )
        time_text, node, kind, notice_text = fields
        events.append(
            CapacityEvent(
                time=_number(time_text, name, lineno, "time"),
                node=node,
                kind=_kind(kind, name, lineno),
                notice=_number(notice_text, name, lineno, "notice"),
                line=lineno,
            )
        )
    if not header_seen:
        raise TraceError(f"{name}: empty; expected the header {','.join(HEADER)}")
    try:
        return Trace(
            name=name,
            initial_nodes=tuple(initial),
            devices_per_node=devices_per_node,
            duration_s=duration_s,
            events=tuple(events),
        )
    except TraceError as exc:
        raise TraceError(f"{name} {exc}") from None


def read_csv(path: str | Path, *, initial: Sequence[str], devices_per_node: int, duration_s: float) -> Trace:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not UTF-8 text") from None
    return parse_csv(
        text, initial=initial, devices_per_node=devices_per_node, duration_s=duration_s, name=str(path)
    )


def to_csv(events: Iterable[CapacityEvent]) -> str:
    rows = [",".join(HEADER)]
    rows += [f"{ev.time!r},{ev.node},{ev.kind},{ev.notice!r}" for ev in events]
    return "\n".join(rows) + "\n"


def _number(text: str, name: str, lineno: int, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{name} line {lineno}, field '{field}': {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{name} line {lineno}, field '{field}': must be a non-negative number, got {text}")
    return value


def _kind(text: str, name: str, lineno: int) -> Kind:
    if text not in KINDS:
        raise TraceError(f"{name} line {lineno}, field 'kind': must be add or remove, got {text!r}")
    return text  # type: ignore[return-value]


def generate(
    *,
    mean_interval_s: float,
    duration_s: float,
    nodes: int,
    min_nodes: int,
    max_nodes: int,
    notice_s: float,
    seed: int,
    devices_per_node: int,
    arrivals: Arrivals = "poisson",
    name: str = "",
) -> Trace:
    """A volatility regime: events ``mean_interval_s`` apart on average (exponential gaps for
    ``poisson``, uniform in [0.5, 1.5] x mean for ``uniform``), each removing a node with ``notice_s``
    warning or adding a fresh one, keeping the nodes held within ``[min_nodes, max_nodes]`` at every
    moment (a node under a warning counts until it is gone; an event that could do neither is skipped).
    The same arguments give the same trace."""
    if mean_interval_s <= 0:
        raise TraceError(f"mean interval must be positive, got {mean_interval_s}")
    if not 1 <= min_nodes <= nodes <= max_nodes:
        raise TraceError(f"need 1 <= min nodes ({min_nodes}) <= nodes ({nodes}) <= max nodes ({max_nodes})")
    if min_nodes == max_nodes:
        raise TraceError(f"min and max nodes are both {min_nodes}: no event can change the capacity")
    if notice_s < 0:
        raise TraceError(f"notice must not be negative, got {notice_s}")
    if arrivals not in ("poisson", "uniform"):
        raise TraceError(f"arrivals must be poisson or uniform, got {arrivals!r}")
    rng = random.Random(seed)
    planned = list(initial_nodes(nodes))  # nodes held once every event so far has taken effect
    leaving: list[float] = []  # removal times of warned nodes
    next_index = nodes
    events: list[CapacityEvent] = []
    t = 0.0
    while True:
        gap = (
            rng.expovariate(1 / mean_interval_s)
            if arrivals == "poisson"
            else rng.uniform(0.5 * mean_interval_s, 1.5 * mean_interval_s)
        )
        t = round(t + gap, 3)
        if t >= duration_s:
            break
        leaving = [e for e in leaving if e > t]  # warned nodes still held until their removal
        can_add = len(planned) + len(leaving) < max_nodes
        can_remove = len(planned) > min_nodes
        if not (can_add or can_remove):
            continue  # every spare node is still on its way out: no change possible now
        kind = rng.choice(("add", "remove")) if can_add and can_remove else ("add" if can_add else "remove")
        if kind == "add":
            node = node_name(next_index)
            next_index += 1
            planned.append(node)
            events.append(CapacityEvent(t, node, "add", 0.0))
        else:
            node = planned.pop(rng.randrange(len(planned)))
            leaving.append(t + notice_s)
            events.append(CapacityEvent(t, node, "remove", float(notice_s)))
    return Trace(
        name=name or f"generated (mean {mean_interval_s:g} s, seed {seed})",
        initial_nodes=initial_nodes(nodes),
        devices_per_node=devices_per_node,
        duration_s=duration_s,
        events=tuple(events),
    )
