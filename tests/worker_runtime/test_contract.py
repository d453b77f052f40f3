"""The job contract: a factory is checked once, when the runtime starts, and each optional protocol it
implements is found then (what a job can do is said at its start, not discovered at its first loss)."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from liver.worker_runtime.contract import (
    _REQUIRED,
    BuildsForStream,
    Checkpoints,
    ChecksLayouts,
    FeedsPeerCopies,
    JobAbilities,
    RecoversLive,
    TrainerFactory,
)


class Minimal:
    """Exactly what every job implements, nothing optional."""

    model: Any = None

    def build(self, world: Any) -> Any: ...
    def warm_up(self, layout: Any, rank: int) -> Any: ...
    def iteration(self, trainer: Any) -> int:
        return 0

    def local_state(self, trainer: Any) -> dict[int, Any]:
        return {}

    def progress(self, trainer: Any) -> bytes:
        return b""

    def resume(self, trainer: Any, state: Any, progress: bytes) -> None: ...
    def dispose(self, trainer: Any) -> None: ...
    def capture_rng(self) -> object: ...
    def restore_rng(self, captured: object) -> None: ...


class Recovering(Minimal):
    def abandon(self, trainer: Any, iteration: int, reason: str) -> Any: ...
    def abandoned(self, trainer: Any) -> Any: ...
    def keep_state(self, trainer: Any) -> Any: ...
    def survives_one_loss(self, layout: Any) -> bool:
        return True


def test_the_required_names_are_the_protocols_members() -> None:
    assert sorted(_REQUIRED) == sorted(typing._get_protocol_attrs(TrainerFactory))


def test_a_factory_without_a_required_method_is_refused_naming_what_it_lacks() -> None:
    lacking = type("Lacking", (), {k: v for k, v in vars(Minimal).items() if k not in ("resume", "dispose")})
    with pytest.raises(TypeError, match=r"`factory`: Lacking is no TrainerFactory: it lacks resume, dispose"):
        JobAbilities.of(lacking())


def test_a_minimal_factory_has_no_optional_ability() -> None:
    abilities = JobAbilities.of(Minimal())
    assert abilities.names() == []
    assert abilities.live_recovery is None and abilities.checkpointing is None


def test_an_optional_protocol_counts_only_when_every_method_of_it_is_there() -> None:
    half = type("Half", (Minimal,), {"abandon": Recovering.abandon, "keep_state": Recovering.keep_state})
    assert JobAbilities.of(half()).live_recovery is None
    full = Recovering()
    assert JobAbilities.of(full).live_recovery is full
    assert JobAbilities.of(full).names() == ["RecoversLive"]


@pytest.mark.parametrize(
    "protocol", [BuildsForStream, ChecksLayouts, RecoversLive, FeedsPeerCopies, Checkpoints]
)
def test_no_optional_protocol_repeats_a_required_method(protocol: type) -> None:
    assert not set(typing._get_protocol_attrs(protocol)) & set(_REQUIRED)
