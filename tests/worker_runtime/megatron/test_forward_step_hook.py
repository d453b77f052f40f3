"""The user's ``forward_step_func`` is what a step runs, and a loss report LiveR cannot read is named."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from megatron.core import parallel_state

from liver.shared.errors import InputError
from liver.shared.layout import ParallelLayout
from liver.shared.model import PRESETS
from liver.worker_runtime.megatron.build import initialize_parallel_state
from liver.worker_runtime.megatron.train import TrainerHooks, build_trainer
from liver.worker_runtime.megatron.train_config import TrainConfig
from liver.worker_runtime.mock_warmup import fake_world

CONFIG = TrainConfig(global_batch_size=2, micro_batch_size=1, seq_length=16)
LAYOUT = ParallelLayout(tp=1, pp=1, dp=1)
SEEN: list[dict[str, Any]] = []


def _loss(loss_mask: torch.Tensor, losses: torch.Tensor, key: str) -> tuple[Any, ...]:
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1).float() * mask)
    return loss, mask.sum().to(torch.int), {key: torch.stack([loss.detach(), mask.sum()])}


def _step(key: str, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    SEEN.append({"keys": sorted(batch), "last_stage": parallel_state.is_pipeline_last_stage()})
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"], key=key)


def _train_one_step(hooks: TrainerHooks) -> Any:
    with fake_world(0, 1):
        initialize_parallel_state(LAYOUT, gloo_groups=False)
        try:
            return build_trainer(PRESETS["tiny-gpt"], LAYOUT, CONFIG, hooks=hooks).train_step()
        finally:
            parallel_state.destroy_model_parallel()


def test_the_users_forward_step_runs_on_every_micro_batch_with_megatrons_batch_dict() -> None:
    SEEN.clear()
    result = _train_one_step(TrainerHooks(forward_step=partial(_step, "mine"), loss_key="mine"))
    assert len(SEEN) == CONFIG.global_batch_size // CONFIG.micro_batch_size
    assert SEEN[0] == {"keys": ["labels", "loss_mask", "position_ids", "tokens"], "last_stage": True}
    assert result.loss > 0


def test_a_loss_report_without_the_loss_key_is_refused_naming_the_hook() -> None:
    with pytest.raises(InputError, match=r"hooks\.forward_step.*'lm loss'.*\['other'\]"):
        _train_one_step(TrainerHooks(forward_step=partial(_step, "other")))


@pytest.mark.parametrize(
    ("settings", "field"),
    [({"forward_step": "forward_step"}, "hooks.forward_step"), ({"loss_key": ""}, "hooks.loss_key")],
)
def test_hooks_that_are_not_what_they_name_are_refused(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TrainerHooks(**settings)
