"""Which failures say that a peer of a collective is lost, and what an abandoned step carries."""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch.distributed as dist

from liver.worker_runtime.peers import StepAbandoned, is_peer_failure
from liver.worker_runtime.world import (
    NCCL_CLEAN_UP_ONLY,
    NCCL_ERROR_HANDLING_ENV,
    WorldError,
    keep_process_on_nccl_errors,
)

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:12717: Connection reset by peer"
)


def test_a_gloo_connection_reset_is_a_lost_peer() -> None:
    assert is_peer_failure(RuntimeError(GLOO_RESET))


def test_a_gloo_collective_past_its_timeout_is_a_lost_peer() -> None:
    error = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv")
    assert is_peer_failure(error)


def test_torch_distributed_backend_and_network_errors_are_lost_peers() -> None:
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted on rank 3"))
    assert is_peer_failure(dist.DistNetworkError("connection refused"))


def test_a_group_of_a_released_world_is_a_lost_peer() -> None:
    assert is_peer_failure(WorldError("the stream group into generation 3 was released"))


def test_a_lost_peer_is_found_behind_the_error_it_caused() -> None:
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as inner:
            raise ValueError("the forward step failed") from inner
    except ValueError as outer:
        assert is_peer_failure(outer)


def test_an_error_of_the_step_itself_is_no_lost_peer() -> None:
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not is_peer_failure(ValueError("connection reset by peer"))  # not raised by a collective
    assert not is_peer_failure(MemoryError())


def test_an_abandoned_step_names_the_kept_iteration_and_survives_pickling() -> None:
    abandoned = StepAbandoned(7, "connection reset by peer", torn=True)
    copy = pickle.loads(pickle.dumps(abandoned))
    assert (copy.iteration, copy.reason, copy.torn) == (7, "connection reset by peer", True)
    assert "step 8 abandoned" in str(copy) and "iteration 7 torn" in str(copy)
    assert is_peer_failure(copy)


def test_nccl_groups_raise_on_a_lost_peer_instead_of_ending_the_process(monkeypatch: Any) -> None:
    monkeypatch.delenv(NCCL_ERROR_HANDLING_ENV, raising=False)
    keep_process_on_nccl_errors()
    assert os.environ[NCCL_ERROR_HANDLING_ENV] == NCCL_CLEAN_UP_ONLY


def test_the_users_own_nccl_error_handling_is_kept(monkeypatch: Any) -> None:
    monkeypatch.setenv(NCCL_ERROR_HANDLING_ENV, "1")
    keep_process_on_nccl_errors()
    assert os.environ[NCCL_ERROR_HANDLING_ENV] == "1"
