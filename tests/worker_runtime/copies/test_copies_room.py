"""Peer copies take only the host memory they are given: a keeper whose sources' copies do not fit
keeps none (its sources send nothing and train on), and own copies that do not fit beside them are not
kept. A world's processes build their copies together, so each is built in its own thread here."""

from __future__ import annotations

import threading
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from liver.reshard.redundancy import own_copy_bytes, redundancy
from liver.shared.layout import Device, ParallelLayout, Placement
from liver.shared.model import PRESETS
from liver.worker_runtime.copies.manager import CopyManager, CopyOptions
from liver.worker_runtime.copies.peer import PeerCopies
from liver.worker_runtime.megatron.train_config import TrainConfig

LAYOUT = ParallelLayout(tp=2, pp=1, dp=2)
PLACEMENT = Placement((Device("a", 0), Device("a", 1), Device("b", 0), Device("b", 1)))
MODEL = PRESETS["tiny-gpt"].geometry().with_ddp(TrainConfig(use_distributed_optimizer=True).ddp)
PLAN = redundancy(MODEL, LAYOUT, PLACEMENT)
OWN = own_copy_bytes(MODEL, LAYOUT, PLACEMENT)


def build(budgets: dict[int, int | None], keep_own: bool = False) -> dict[int, PeerCopies]:
    store = dist.HashStore()
    built: dict[int, PeerCopies] = {}
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            built[rank] = PeerCopies(
                MODEL,
                LAYOUT,
                PLACEMENT,
                generation=1,
                rank=rank,
                store=store,
                namespace="job/g1",
                host="127.0.0.1",
                keep_own=keep_own,
                host_budget_bytes=budgets.get(rank),
                timeout=timedelta(seconds=30),
            )
        except BaseException as error:  # handed to the test
            errors.append(error)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(LAYOUT.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return built


@pytest.fixture
def copies_of():
    made: list[dict[int, PeerCopies]] = []

    def make(budgets: dict[int, int | None], keep_own: bool = False) -> dict[int, PeerCopies]:
        made.append(build(budgets, keep_own))
        return made[-1]

    yield make
    for built in made:
        for copies in built.values():
            copies.close()


def test_the_world_keeps_every_copy_that_fits(copies_of) -> None:
    built = copies_of({r: PLAN.kept_bytes[r] for r in range(4)})
    assert all(built[r].keeper is not None for r in range(4) if PLAN.sources(r))
    assert all(built[r].sender is not None for r in range(4))


def test_a_keeper_without_room_keeps_nothing_and_its_source_sends_nothing(copies_of) -> None:
    keeper = PLAN.keepers[3]
    built = copies_of({keeper: PLAN.kept_bytes[keeper] - 1})
    assert built[keeper].keeper is None
    assert built[3].sender is None
    others = [r for r in range(4) if r != 3]
    assert all(built[r].sender is not None for r in others)


def test_own_copies_that_do_not_fit_beside_the_kept_ones_are_not_kept(copies_of) -> None:
    tight = {r: PLAN.kept_bytes[r] + OWN[r] - 1 for r in range(4)}
    built = copies_of(tight | {0: PLAN.kept_bytes[0] + OWN[0]}, keep_own=True)
    assert built[0].sender.keep_own
    assert not any(built[r].sender.keep_own for r in (1, 2, 3))
    assert all(built[r].keeper is not None for r in range(4) if PLAN.sources(r))


def test_by_default_the_budget_is_half_the_available_memory_shared_by_the_nodes_processes() -> None:
    manager = CopyManager(CopyOptions(), MODEL, build_timeout_s=30)
    available = psutil.virtual_memory().available
    budget = manager.host_budget(PLACEMENT, 0)
    assert 0.8 * available / 4 < budget < 1.2 * available / 4


def test_a_budget_given_is_taken_as_it_is() -> None:
    manager = CopyManager(CopyOptions(host_budget_bytes=12345), MODEL, build_timeout_s=30)
    assert manager.host_budget(PLACEMENT, 0) == 12345
