"""The seeded plan of a chaos run: which step kills what, when, and for how long.

The events themselves are chosen while the run goes (a warning needs a node in the world, a scale
request a node out of it), from a number drawn here, so one seed always gives the same run for the
same outcomes. Kills are spread over the steps at random; the server's kills come first in the list of
targets and every service is killed at least once when there are kills enough for all of them.
"""

from __future__ import annotations

import random
from enum import StrEnum
from typing import Final

import msgspec

from liver.shared.errors import InputError


class Target(StrEnum):
    """What a kill hits: one of the four services, the nats-server itself, or (with real training
    processes) one worker of the world that stays, alone or while the coordinator is down
    (``WORKER_IN_RESTART``: the coordinator is killed at the stage, and the worker before it is back, so
    that the restarted coordinator learns of the loss only from what the survivors say)."""

    INGESTER = "ingester"
    TOPOLOGY = "topology"
    TRANSFER = "transfer"
    COORDINATOR = "coordinator"
    SERVER = "nats-server"
    WORKER = "worker"
    WORKER_IN_RESTART = "worker-in-restart"


class Loss(StrEnum):
    """A step whose event is a loss without notice (real training processes only): kill -9 of one
    training process of the world, or of every process of one of its nodes."""

    WORKER = "worker"
    NODE = "node"


SERVICES: Final = (Target.INGESTER, Target.TOPOLOGY, Target.TRANSFER, Target.COORDINATOR)


class Stage(StrEnum):
    """Where in a handoff a kill lands: right after the message of that stage is seen on the bus."""

    PUBLISHED = "published"
    RESIZE_REQUESTED = "resize_requested"
    TOPOLOGY_REQUEST = "topology_request"
    TOPOLOGY_PLANNED = "topology_planned"
    TRANSFER_PLANNED = "transfer_planned"
    PREPARE = "prepare"
    SWITCH = "switch"


STAGES_OF: Final = {
    Target.INGESTER: (Stage.PUBLISHED,),
    Target.TOPOLOGY: (Stage.RESIZE_REQUESTED, Stage.TOPOLOGY_REQUEST),
    Target.TRANSFER: (Stage.TOPOLOGY_REQUEST, Stage.TOPOLOGY_PLANNED),
    Target.COORDINATOR: (
        Stage.RESIZE_REQUESTED,
        Stage.TOPOLOGY_PLANNED,
        Stage.TRANSFER_PLANNED,
        Stage.PREPARE,
        Stage.SWITCH,
    ),
    Target.SERVER: tuple(Stage),
    Target.WORKER: (Stage.PREPARE, Stage.SWITCH),
    Target.WORKER_IN_RESTART: (Stage.PREPARE, Stage.SWITCH),
}
"""The stages at which each target holds (or is about to take) the handoff's message: a kill there
is a kill in the middle of its work, not between two of its messages."""
DOWN_S: Final = (0.5, 3.0)
"""How long the killed process stays dead before it is started again (as a supervisor would)."""
BURST_SHARE: Final = 0.2
"""Steps whose warning comes with a second one at once, so that the coordinator merges them."""


class ScheduleError(InputError):
    """A schedule that cannot be made from the numbers given; the message names the field."""


class Kill(msgspec.Struct, frozen=True, kw_only=True):
    target: Target
    stage: Stage
    down_s: float


class Step(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    draw: float
    """In [0, 1): picks the event kind where both are possible, and the node."""
    burst: bool
    """A spot warning is joined at once by a second one, where the world has room to lose two nodes."""
    kill: Kill | None = None
    loss: Loss | None = None
    """This step's event is a loss, not a published event (real training processes only)."""


class Schedule(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    steps: tuple[Step, ...]

    @property
    def kills(self) -> tuple[Kill, ...]:
        return tuple(step.kill for step in self.steps if step.kill is not None)


def make_schedule(
    seed: int,
    *,
    steps: int,
    kills: int,
    server_kills: int,
    worker_kills: int = 0,
    losses: int = 0,
    restart_losses: int = 0,
) -> Schedule:
    """``steps`` events with ``kills`` of them carrying a kill, ``server_kills`` of those of the server,
    ``worker_kills`` of a training process and ``restart_losses`` of a training process while the
    coordinator, killed with it, is down; ``losses`` other steps are losses without notice (alternately
    one worker and a whole node). The last three need real training processes."""
    if steps < 1:
        raise ScheduleError(f"`steps`: at least one, got {steps}")
    if not 0 <= kills <= steps:
        raise ScheduleError(f"`kills`: between 0 and the {steps} steps, got {kills}")
    if min(server_kills, worker_kills, restart_losses) < 0:
        raise ScheduleError("`server_kills`, `worker_kills` and `restart_losses`: none may be negative")
    special = server_kills + worker_kills + restart_losses
    if special > kills:
        raise ScheduleError(
            f"`server_kills` + `worker_kills` + `restart_losses`: at most the {kills} kills, got {special}"
        )
    if not 0 <= losses <= steps - kills:
        raise ScheduleError(f"`losses`: between 0 and the {steps - kills} steps without a kill, got {losses}")
    rng = random.Random(seed)
    targets = (
        [Target.SERVER] * server_kills
        + [Target.WORKER] * worker_kills
        + [Target.WORKER_IN_RESTART] * restart_losses
    )
    services = list(SERVICES)
    while len(targets) < kills:
        rng.shuffle(services)
        targets.extend(services[: kills - len(targets)])
    rng.shuffle(targets)
    killed = dict(zip(sorted(rng.sample(range(steps), kills)), targets, strict=True))
    calm = [i for i in range(steps) if i not in killed]
    lost = {i: (Loss.WORKER, Loss.NODE)[n % 2] for n, i in enumerate(sorted(rng.sample(calm, losses)))}
    out = []
    for index in range(steps):
        draw, burst = rng.random(), rng.random() < BURST_SHARE
        kill = None
        if index in killed:
            target = killed[index]
            kill = Kill(target=target, stage=rng.choice(STAGES_OF[target]), down_s=rng.uniform(*DOWN_S))
        out.append(Step(index=index, draw=draw, burst=burst, kill=kill, loss=lost.get(index)))
    return Schedule(seed=seed, steps=tuple(out))
