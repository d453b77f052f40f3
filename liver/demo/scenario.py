"""What ``liver demo`` runs: the job's devices, its first world, the two resize events, and the pacing.

The default is the story the project is about, on a laptop: a job of four CPU workers on two "nodes"
trains as (TP2, PP2); a spot warning reclaims one node and the job moves live to (TP2, PP1) on the
other; capacity comes back (a scale request adds a third node, whose standby workers have been
waiting) and the job moves live to four workers again. The layouts after each event are the topology
planner's choice, not the demo's (the planner is given a CPU hardware profile and the job's batch).

``--short`` keeps the story with one device per node (two training workers and one standby), fewer
steps and the same services, so that the test suite can run it on two cores.

``--fail-stop`` tells the story without a notice: the reclaimed node's workers are killed (SIGKILL) in
the middle of training, the coordinator learns of it from their missed heartbeats, and the job moves
live onto the surviving node, whose workers hold a whole DP replica (the first world is TP2,PP1,DP2,
or DP2 with ``--short``), then scales out as before.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from liver.shared.layout import Device, ParallelLayout, Placement
from liver.worker_runtime.megatron.train_config import TrainConfig

Steps = Annotated[int, Meta(ge=1)]


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    job_id: str = "demo"
    model: str = "tiny-gpt"
    train: TrainConfig = TrainConfig(global_batch_size=4, micro_batch_size=1, seq_length=16, lr=2e-3)
    """Every layout of up to four ranks divides the batch. The learning rate is gentler than the
    default so that the curve shows the trend rather than the synthetic corpus's hardest batches."""
    layout: ParallelLayout
    """The first world's layout (the launcher's choice)."""
    devices_per_node: Annotated[int, Meta(ge=1)]
    active_nodes: tuple[str, ...]
    """Nodes whose devices run the first world, rank 0 on the first device of the first node."""
    standby_node: str
    """A node whose workers start in no world (the capacity the scale request brings back)."""
    reclaimed_node: str
    """The node the spot warning names."""
    notice_s: Annotated[float, Meta(gt=0)] = 120.0
    warmup_steps: Steps
    """Steps on the first world before the spot warning."""
    steps_between: Steps
    """Steps after the scale-in commits before the scale request."""
    tail_steps: Steps
    """Steps after the scale-out commits before the job is stopped."""
    transfer_budget_bytes: Annotated[int, Meta(ge=8)] = 256 * 1024
    """The staging budget per destination and streaming round: small, so each layer takes rounds."""
    heartbeat_s: Annotated[float, Meta(gt=0)] = 1.0
    heartbeat_timeout_s: Annotated[float, Meta(gt=0)] = 20.0
    """The coordinator's: generous, because a busy 2-core laptop delays beats of busy processes."""
    suspect_timeout_s: Annotated[float, Meta(gt=0)] = 3.0
    """The coordinator's, once a survivor reports its world lost a peer: three of the demo's beats."""
    fail_stop: bool = False
    """The first event is the reclaimed node's workers killed without notice, not a spot warning."""
    timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    """The whole run's limit: the demo gives up (and cleans up) after it."""

    def __post_init__(self) -> None:
        if self.reclaimed_node not in self.active_nodes:
            raise ValueError(f"`reclaimed_node`: {self.reclaimed_node!r} runs no worker of the first world")
        if self.standby_node in self.active_nodes:
            raise ValueError(f"`standby_node`: {self.standby_node!r} already runs the first world")
        if self.layout.world_size != len(self.first_devices):
            raise ValueError(
                f"`layout`: {self.layout.describe()} has {self.layout.world_size} ranks, the active nodes "
                f"hold {len(self.first_devices)} devices"
            )
        try:
            self.train.micro_batches_per_rank(self.layout.dp)
        except ValueError as exc:
            raise ValueError(f"`layout`: {exc}") from None

    def node_devices(self, node: str) -> tuple[Device, ...]:
        return tuple(Device(node, i) for i in range(self.devices_per_node))

    @property
    def first_devices(self) -> tuple[Device, ...]:
        return tuple(d for node in self.active_nodes for d in self.node_devices(node))

    @property
    def first_placement(self) -> Placement:
        return Placement(self.first_devices)

    @property
    def standby_devices(self) -> tuple[Device, ...]:
        return self.node_devices(self.standby_node)

    @property
    def all_devices(self) -> tuple[Device, ...]:
        return self.first_devices + self.standby_devices


FULL = Scenario(
    layout=ParallelLayout(tp=2, pp=2, dp=1),
    devices_per_node=2,
    active_nodes=("node000", "node001"),
    standby_node="node002",
    reclaimed_node="node001",
    warmup_steps=10,
    steps_between=10,
    tail_steps=10,
)
"""Four workers as (TP2, PP2) on node000-001, two standby workers on node002."""

SHORT = Scenario(
    layout=ParallelLayout(tp=1, pp=2, dp=1),
    devices_per_node=1,
    active_nodes=("node000", "node001"),
    standby_node="node002",
    reclaimed_node="node001",
    warmup_steps=3,
    steps_between=3,
    tail_steps=3,
)
"""Two workers as (TP1, PP2) on node000-001, one standby worker on node002."""

FULL_FAIL_STOP = msgspec.structs.replace(FULL, layout=ParallelLayout(tp=2, pp=1, dp=2), fail_stop=True)
"""Four workers as (TP2, PP1, DP2): a whole replica on each node, so node000 survives node001's loss.
The survivors report the loss at once, and the coordinator finds the silent workers within
``suspect_timeout_s``."""

SHORT_FAIL_STOP = msgspec.structs.replace(SHORT, layout=ParallelLayout(tp=1, pp=1, dp=2), fail_stop=True)
"""Two workers as (TP1, PP1, DP2), one standby."""
