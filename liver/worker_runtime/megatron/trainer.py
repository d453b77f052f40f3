"""A Megatron-core GPT trainer on one world: one step over a global batch, and the loss it computes.

:class:`MegatronTrainer` holds what :func:`~.train.build_trainer` assembled (the DDP-wrapped GPTModel,
Megatron's optimizer, the LR/WD schedule) and runs Megatron's own schedule in
:meth:`MegatronTrainer.train_step` with a ``forward_step_func``: Megatron's GPT forward step
(:func:`gpt_forward_step`, the model computing its loss) or the user's own. The step runs with
``parallel_state`` answering for the trainer's world (:mod:`.pinned_state`), so code written for a plain
Megatron job (Megatron's standard loss reads the TP group from there) works in every world a job moves
to. It is apart from the build so that the state mapping (:mod:`.state`), which reads a trainer, and
the build, which checks a new trainer against that mapping, each import it without importing each
other. How vocabulary padding is kept out of the state: see :mod:`.train`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, NamedTuple

import structlog
import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from liver.shared.errors import InputError
from liver.shared.geometry import ModelGeometry
from liver.shared.layout import ParallelLayout
from liver.worker_runtime.megatron.build import ParallelGroups, ensure_global_memory_buffer
from liver.worker_runtime.megatron.data import Corpus
from liver.worker_runtime.megatron.pinned_state import parallel_state_of
from liver.worker_runtime.megatron.source import ModelSource
from liver.worker_runtime.megatron.train_config import TrainConfig
from liver.worker_runtime.peers import StepAbandoned, is_peer_failure

__all__ = ["ForwardStep", "MegatronTrainer", "StepResult", "gpt_forward_step", "gpt_loss_func"]

log = structlog.get_logger(__name__)


class StepResult(NamedTuple):
    """One training step as every rank of the world sees it (loss and norm agree on all ranks)."""

    iteration: int  # the step just completed (1 after the first step)
    loss: float  # mean token loss of the global batch
    grad_norm: float  # before clipping
    lr: float
    skipped: bool  # the optimizer refused the step (fp16 overflow)
    seconds: float


# --------------------------------------------------------------------------- the step's loss

ForwardStep = Callable[
    [Iterator[dict[str, torch.Tensor]], torch.nn.Module], tuple[torch.Tensor, Callable[..., Any]]
]
"""A Megatron ``forward_step_func``: ``(data_iterator, model) -> (output_tensor, loss_func)``. The
iterator yields this rank's micro-batches as dicts of ``[batch, seq]`` tensors keyed ``tokens``,
``labels``, ``loss_mask`` and ``position_ids`` (Megatron's ``GPTDataset`` samples, collated; no
``attention_mask``: the causal mask). ``loss_func`` follows Megatron's contract and reports the loss
under a key (``"lm loss"``) as ``[loss_sum, num_tokens]`` or as a mean."""


_TRAINING_FUNCTIONS = (
    "grad_scale_func",
    "no_sync_func",
    "grad_sync_func",
    "param_sync_func",
    "finalize_model_grads_func",
)
"""What the trainer (Megatron-LM's way) sets on a model's TransformerConfig for the schedules."""


def gpt_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Megatron's GPT loss contract (``pretrain_gpt``): summed loss, token count, and the report."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(output_tensor.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def gpt_forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Megatron's GPT forward step: the model computes the per-token loss itself (Megatron's
    vocab-parallel cross entropy, on the TP group ``parallel_state`` names: the trainer's world)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(gpt_loss_func, batch["loss_mask"])


def forget_tracked_groups() -> None:
    """Drop the process groups Megatron's global loss trackers keep between steps (the MoE router's
    aux-loss tracker stores its reduce groups, the data-parallel one for a global aux loss; so does
    the MTP loss tracker). They outlive every trainer: a broken world's group kept there stays open,
    and a survivor waiting in one of its collectives (a router's all-reduce met by the loss) waits for
    its timeout instead of failing at once. The next step stores its own world's groups again."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    for entry in get_moe_layer_wise_logging_tracker().values():
        entry["reduce_group"] = entry["avg_group"] = None
    mtp = sys.modules.get("megatron.core.transformer.multi_token_prediction")
    if mtp is not None:
        tracker = mtp.MTPLossLoggingHelper.tracker
        if tracker:
            tracker["reduce_group"] = tracker["avg_group"] = None


def _holds_graph(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    if isinstance(value, (list, tuple)):
        return any(_holds_graph(item) for item in value)
    return False


def forget_step_tensors(chunks: Sequence[torch.nn.Module]) -> None:
    """Drop the tensors of the last forward that modules, and the helpers they own, keep as
    attributes between steps (an MoE token dispatcher keeps its routing probabilities, the output of
    a masked select). Those tensors carry the step's autograd graph, whose gradient accumulators hold
    DDP's hooks, which hold DDP: a cycle through C++ nodes that Python's collector cannot break, so
    the broken world's groups would stay open. Parameters and buffers are leaves and stay."""
    for chunk in chunks:
        for module in chunk.modules():
            holders = [module]
            holders.extend(
                value
                for value in vars(module).values()
                if hasattr(value, "__dict__")
                and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
                and type(value).__module__.startswith("megatron.")
            )
            for holder in holders:
                for name, value in list(vars(holder).items()):
                    if _holds_graph(value):
                        setattr(holder, name, None)


class MegatronTrainer:
    """A GPT training job on one world. Build it with :func:`build_trainer`.

    ``model_chunks`` are the DDP-wrapped model chunks (one; ``layout.vpp`` with virtual pipeline
    parallelism, as Megatron-LM's ``model`` list), ``model`` the first of them (``model.module`` the
    GPTModel), ``optimizer`` Megatron's (chained) optimizer over all chunks, ``scheduler`` the LR/WD
    schedule. ``iteration`` counts completed steps and ``consumed_samples`` is the data position
    (``iteration * global_batch_size`` unless restored).
    """

    def __init__(
        self,
        source: ModelSource,
        layout: ParallelLayout,
        config: TrainConfig,
        groups: ParallelGroups,
        model_chunks: Sequence[DistributedDataParallel],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        corpus: Corpus,
        *,
        forward_step: ForwardStep = gpt_forward_step,
        loss_key: str = "lm loss",
    ) -> None:
        self.source = source
        self._geometry = source.geometry.with_ddp(config.ddp)
        self.layout = layout
        self.config = config
        self.groups = groups
        self.model_chunks = list(model_chunks)
        if len(self.model_chunks) != layout.vpp:
            raise ValueError(
                f"model_chunks: {len(self.model_chunks)} chunk(s), {layout.describe()} has {layout.vpp}"
            )
        self.model = self.model_chunks[0]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.corpus = corpus
        self.forward_step = forward_step
        self.loss_key = loss_key
        self.iteration = 0
        self.consumed_samples = 0
        self.params_stale = False  # a step with overlap_param_gather left the gather to the next forward
        self.adam_steps = 0  # optimizer steps taken (Adam's step; a skipped fp16 step does not count)
        # Built for a stream to fill (build_trainer(initialize=False)): state made before the stream may
        # be left as allocated (the runtime zeroes it beside training), not zeroed on the training thread.
        self.filled_by_stream = False
        self.abandoned: StepAbandoned | None = None  # set when a step met a lost peer: the world is broken
        self.commit_votes = 0  # iterations whose update every rank of the world agreed to begin
        self.before_update: list[Callable[[], object]] = []
        """Called on the training thread right before each iteration's first update (and its commit
        vote): what reads the state between updates waits here (the peer copies' sender)."""
        self._voted = False
        for inner in self._inner_optimizers():
            inner.register_step_pre_hook(self._commit_vote)
        self.num_microbatches = config.micro_batches_per_rank(layout.dp)
        self._collection = groups.collection()
        self._forward_backward = get_forward_backward_func(
            pp_size=layout.pp, vp_size=layout.vpp if layout.vpp > 1 else None
        )
        self._p2p = P2PCommunicator(pp_group=groups.pp, config=self.model.config) if layout.pp > 1 else None
        self._log = log.bind(layout=layout.describe(), rank=groups.rank)

    @property
    def gpt(self) -> GPTModel:
        """The first model chunk's GPTModel (the whole model of the rank without virtual pipelining)."""
        return self.model.module

    @property
    def chunks(self) -> list[GPTModel]:
        """Every model chunk's GPTModel, in ``vp_stage`` order."""
        return [chunk.module for chunk in self.model_chunks]

    @property
    def geometry(self) -> ModelGeometry:
        """What the plans move: every tensor of this trainer's state is one of its tensors, sharded as
        its DDP and optimizer shard them."""
        return self._geometry

    def data_iterator(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global batch, as the forward step takes them."""
        batches = self.corpus.micro_batches(
            self.consumed_samples,
            self.config.global_batch_size,
            self.config.micro_batch_size,
            self.groups.dp.rank(),
            self.layout.dp,
        )
        return (batch._asdict() for batch in batches)

    def _schedule_data(self) -> Any:
        """The schedule's data: interleaved, every chunk draws the micro-batches from an iterator of its
        own."""
        if self.layout.vpp == 1:
            return self.data_iterator()
        return [self.data_iterator() for _ in range(self.layout.vpp)]

    def train_step(self) -> StepResult:
        """One iteration over the next global batch: forward/backward, grad sync, optimizer, LR.

        The optimizer step is the iteration's commit point: the loss is reduced before it, so that no
        collective follows the update (the distributed optimizer's parameter all-gather aside), and
        right before the first update every rank of the world agrees to begin it (a one-element
        all-reduce, see :meth:`_commit_vote`). A step whose collective finds a peer lost
        (:func:`~liver.worker_runtime.peers.is_peer_failure`) raises
        :class:`~liver.worker_runtime.peers.StepAbandoned`: nothing of it reached the parameters or the
        optimizer state, the iteration and data position are the last completed ones, and every later
        call raises the same (the world is broken; the runtime's next ``step`` recovers).
        """
        if self.abandoned is not None:
            raise self.abandoned
        start = time.perf_counter()
        ensure_global_memory_buffer()
        config = self.config
        stale = self.params_stale
        marks: tuple[float, ...] | None = None
        abandoned: StepAbandoned | None = None
        self._voted = False
        try:
            with parallel_state_of(self.groups):
                for chunk in self.model_chunks:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                reports = self._forward_backward(
                    forward_step_func=self.forward_step,
                    data_iterator=self._schedule_data(),
                    model=self.model_chunks,
                    num_microbatches=self.num_microbatches,
                    seq_length=config.seq_length,
                    micro_batch_size=config.micro_batch_size,
                    forward_only=False,
                    p2p_communicator=self._p2p,
                    pg_collection=self._collection,
                )
                loss = self._global_loss(reports)
                marks = self._update_marks()
                succeeded, grad_norm, _ = self.optimizer.step()
                if succeeded:
                    self.adam_steps += 1
                    self.scheduler.step(increment=config.global_batch_size)
                self.iteration += 1
                self.consumed_samples += config.global_batch_size
                self.params_stale = config.overlap_param_gather
        except Exception as error:
            if not is_peer_failure(error):
                raise
            abandoned = self._abandon(error, stale, marks)
        if abandoned is not None:
            # Raised here, not from the failure: its traceback's frames hold the broken world's groups,
            # which must go for the peers to notice (see drop_world).
            raise abandoned
        lr = float(self.optimizer.param_groups[0]["lr"])
        result = StepResult(
            iteration=self.iteration,
            loss=loss,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            skipped=not succeeded,
            seconds=time.perf_counter() - start,
        )
        self._log.debug("megatron_train.step", **result._asdict())
        return result

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that update the state (one per chained Megatron optimizer)."""
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        inner = (getattr(optimizer, "optimizer", None) for optimizer in chained)
        return [o for o in inner if isinstance(o, torch.optim.Optimizer)]

    def _commit_vote(self, *_: object) -> None:
        """Before the iteration's first update (a pre-hook of each inner optimizer's step; the later
        ones of a chain follow without a collective between): every rank of the world says it got
        here. Without it a lost peer splits the survivors: a replica whose last collectives of the
        step (the grad norm over its model-parallel group) did not involve the lost process updates,
        one that waited on it does not, and their states are iterations apart, which no recovery can
        join. With it, a peer lost before the vote fails every survivor's vote, so all keep the last
        completed iteration; only a loss inside this one small all-reduce can still split them (the
        recovery then refuses and the job falls back to its checkpoint). A CPU tensor: gloo's
        connections fail at once on a lost peer, also beside NCCL."""
        if self._voted:
            return
        self._voted = True
        for wait in self.before_update:
            wait()
        dist.all_reduce(torch.ones(1), group=self.groups.world)
        self.commit_votes += 1

    def _update_marks(self) -> tuple[float, ...]:
        """Each inner optimizer's Adam step as it stands (-1: no state yet): what tells, after a failed
        ``optimizer.step()``, whether any update began."""
        marks = []
        for optimizer in self._inner_optimizers():
            mark = -1.0
            for entry in optimizer.state.values():
                if isinstance(entry, dict) and "step" in entry:
                    mark = float(entry["step"])
                    break
            marks.append(mark)
        return tuple(marks)

    def _abandon(self, error: BaseException, stale: bool, marks: tuple[float, ...] | None) -> StepAbandoned:
        """Give the step up after a lost peer. Before the optimizer's first update nothing of the step
        is in the state; an update that began (only the distributed optimizer has a collective after
        one: its parameter all-gather) or parameters still waiting for a deferred all-gather leave the
        state torn, which no plan may read."""
        began = marks is not None and self._update_marks() != marks
        reason = str(error).splitlines()[0][:300] if str(error) else repr(error)
        self.abandoned = StepAbandoned(self.iteration, reason, torn=began or stale)
        self._log.warning(
            "megatron_train.step_abandoned", iteration=self.iteration, torn=self.abandoned.torn, error=reason
        )
        return self.abandoned

    def drop_world(self) -> None:
        """Let go of everything that holds the broken world's process groups (the DDP-wrapped model,
        the optimizer, the schedule, the groups), once the state was taken out of it
        (``MegatronJob.keep_state``): a gloo group closes its connections only when its last reference
        goes, and only then do the peers still waiting in one of its collectives fail. That includes
        the frames of the step that met the loss: its ``StepAbandoned`` (kept here and by the runtime)
        carries them in its traceback, with whatever their locals hold (a model chunk of a loop), so
        the traceback goes too. The trainer can only refuse steps afterwards."""
        if self.abandoned is None:
            raise RuntimeError("drop_world: the trainer's world is not broken")
        self.abandoned.__traceback__ = None
        built = "model_chunks" in self.__dict__
        wrapped = self.model_chunks if built else []  # the DDP-wrapped chunks
        # The model's TransformerConfig outlives the modules (class-level caches keep it) and holds the
        # training functions set at build: the optimizer's loss scaling, DDP's no_sync and grad sync.
        # Those hold the optimizer and DDP, which hold the groups: cut them.
        for chunk in self.chunks if built else ():
            config = chunk.config
            for attr in _TRAINING_FUNCTIONS:
                if getattr(config, attr, None) is not None:
                    setattr(config, attr, None)
        forget_tracked_groups()
        forget_step_tensors(wrapped)
        # DDP keeps the gradient accumulators its backward hooks sit on, and those hooks close over
        # DDP: a cycle through autograd's C++ nodes, which Python's collector cannot see, so DDP (and
        # every group it holds) would outlive the trainer. Let go of the accumulators: their hooks go.
        for chunk in wrapped:
            accumulators = getattr(chunk, "grad_accs", None)
            if isinstance(accumulators, list):
                accumulators.clear()
        for name in (
            "model",
            "model_chunks",
            "optimizer",
            "scheduler",
            "groups",
            "_collection",
            "_p2p",
            "_forward_backward",
        ):
            self.__dict__.pop(name, None)
        del wrapped

    def sync_params(self) -> None:
        """Gather the parameters the distributed optimizer updated on other DP ranks now, when a step
        left that to the next forward (``overlap_param_gather``): a collective over the DP group."""
        if not self.params_stale:
            return
        with parallel_state_of(self.groups):
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)
        self.params_stale = False

    def _global_loss(self, reports: list[dict[str, torch.Tensor]]) -> float:
        """Mean token loss of the global batch, the same on every rank.

        A ``[loss_sum, num_tokens]`` report is summed over micro-batches and DP replicas and divided
        once; a one-value report is a mean and is averaged. Either way the last stage's value is shared
        along the pipeline (other stages add zeros, which keeps it exact)."""
        total = torch.zeros(2, dtype=torch.float32)
        if self.groups.is_last_stage:
            for report in reports:
                total += self._report_pair(report)
            dist.all_reduce(total, group=self.groups.dp_cp)  # CP ranks hold parts of each sequence
        if self.layout.pp > 1:
            dist.all_reduce(total, group=self.groups.pp)
        return float(total[0] / total[1])

    def _report_pair(self, report: object) -> torch.Tensor:
        """One micro-batch's report as ``[loss_sum, count]`` (a mean counts once)."""
        value = report.get(self.loss_key) if isinstance(report, dict) else None
        if not isinstance(value, torch.Tensor) or value.numel() not in (1, 2):
            found = sorted(report) if isinstance(report, dict) else type(report).__name__
            raise InputError(
                f"hooks.forward_step: its loss_func must report {self.loss_key!r} as a tensor "
                f"[loss_sum, num_tokens] or a mean (Megatron's contract); it reported {found}"
            )
        value = value.detach().float().reshape(-1)
        return value if value.numel() == 2 else torch.cat([value, torch.ones(1)])
