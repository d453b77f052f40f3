"""Every NATS name LiveR uses: subjects, streams, key-value buckets, object stores and headers.

Names live in one module so that services, workers, the server's permission config and the tests can
never disagree on a spelling, and so that the public contract (what users publish and subscribe to) is
visible in one place.

Public subjects are fixed names; the job id travels in the message body, so an external publisher (a
cloud-provider bridge, an autoscaler) needs to know nothing about LiveR's internals. Internal subjects
live under ``liver.`` and carry the job (and, for commands, the worker) as subject tokens, so that a
worker can be allowed to see only its own job's traffic and a JetStream consumer can filter per job.

Ids that become subject tokens must be *token-safe*: 1-128 characters of ASCII letters, digits, ``_``
and ``-``. NATS splits subjects on ``.``, treats ``*`` and ``>`` as wildcards and forbids whitespace;
the stricter set also keeps the same ids usable as JetStream key-value keys and message-dedup ids.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from liver.shared.errors import InputError


class SubjectError(InputError):
    """An id that cannot be used as a NATS subject token."""


TOKEN_PATTERN: Final = r"^[A-Za-z0-9_-]{1,128}\Z"
"""Ids that appear in subjects, key-value keys or dedup headers (job, worker, event ids). ``\\Z``, not
``$``: Python's ``$`` also matches before a final newline, and msgspec checks patterns with
``re.search``, so ``"job\n"`` would pass and then fail as a key."""

_TOKEN = re.compile(TOKEN_PATTERN)
MAX_NODE_CHARS: Final = 253
"""The longest node id a device probe's subject carries (a DNS name's limit)."""


def validate_token(value: str, what: str = "id") -> str:
    """Return ``value`` when it is a safe subject token; raise :class:`SubjectError` naming ``what``.

    A dot would silently add a subject level and a ``*`` or ``>`` would turn a publish target into a
    subscription pattern, so every builder below checks its ids instead of trusting the caller.
    """
    if not isinstance(value, str) or _TOKEN.match(value) is None:
        raise SubjectError(
            f"{what} {value!r} is not a valid subject token: use 1-128 ASCII letters, digits, '_' or '-'"
        )
    return value


# -- public subjects: the contract users code against ---------------------------------------------

SPOT_WARNING: Final = "spot.warning"
"""A node will be reclaimed soon (``SpotWarning``). Published by provider bridges; read by the ingester."""

SCALE_REQUEST: Final = "scale.request"
"""A planned change of the job's nodes or size (``ScaleRequest``). Published by operators/autoscalers."""

GENERATION_COMMITTED: Final = "generation.committed"
"""A new generation is live (``GenerationCommitted``). Published by the coordinator."""

GENERATION_ABORTED: Final = "generation.aborted"
"""A handoff did not commit (``GenerationAborted``). Published by the coordinator."""

PUBLIC_SUBJECTS: Final = (SPOT_WARNING, SCALE_REQUEST, GENERATION_COMMITTED, GENERATION_ABORTED)

# -- internal subjects -------------------------------------------------------------------------------

PREFIX: Final = "liver"

RESIZE_REQUESTED_ANY: Final = "liver.resize.requested.*"
TOPOLOGY_REQUEST_ANY: Final = "liver.topology.request.*"
TOPOLOGY_PLANNED_ANY: Final = "liver.topology.planned.*"
TRANSFER_PLANNED_ANY: Final = "liver.transfer.planned.*"
PLANNING_FAILED_ANY: Final = "liver.planning.failed.*"
WORLD_STARTED_ANY: Final = "liver.world.started.*"
WORKER_HELLO_ANY: Final = "liver.worker.hello.*"
WORKER_HEARTBEAT_ANY: Final = "liver.worker.heartbeat.*"
WORKER_STATUS_ANY: Final = "liver.worker.status.*"
ERRORS_ANY: Final = "liver.errors.*"
DEAD_LETTERS_ANY: Final = "liver.dlq.*"


def resize_requested(job_id: str) -> str:
    """Ingester -> coordinator: a validated, de-duplicated resize of one job."""
    return f"liver.resize.requested.{validate_token(job_id, 'job_id')}"


def topology_request(job_id: str) -> str:
    """Coordinator -> topology planner: choose the target world of the next generation."""
    return f"liver.topology.request.{validate_token(job_id, 'job_id')}"


def topology_planned(job_id: str) -> str:
    """Topology planner -> transfer planner and coordinator: the chosen target layout and placement."""
    return f"liver.topology.planned.{validate_token(job_id, 'job_id')}"


def transfer_planned(job_id: str) -> str:
    """Transfer planner -> coordinator: the verified plan is in the object store."""
    return f"liver.transfer.planned.{validate_token(job_id, 'job_id')}"


def planning_failed(job_id: str) -> str:
    """Topology or transfer planner -> coordinator: no target or no plan for the requested generation."""
    return f"liver.planning.failed.{validate_token(job_id, 'job_id')}"


def world_started(job_id: str) -> str:
    """Launcher -> coordinator: a world started off the live path (the first one, or from a checkpoint)."""
    return f"liver.world.started.{validate_token(job_id, 'job_id')}"


def worker_hello(job_id: str) -> str:
    """Worker -> coordinator: a worker process joined (or rejoined) the job."""
    return f"liver.worker.hello.{validate_token(job_id, 'job_id')}"


def worker_heartbeat(job_id: str) -> str:
    """Worker -> coordinator: periodic liveness with the worker's current generation and iteration."""
    return f"liver.worker.heartbeat.{validate_token(job_id, 'job_id')}"


def worker_status(job_id: str) -> str:
    """Worker -> coordinator: acks and phase reports for a generation's commands."""
    return f"liver.worker.status.{validate_token(job_id, 'job_id')}"


def worker_commands(job_id: str) -> str:
    """Coordinator -> every worker of a job at once (one publish instead of one per worker).

    This subject is *not* matched by ``worker_command(job, "*")``: a worker subscribes to both.
    """
    return f"liver.worker.cmd.{validate_token(job_id, 'job_id')}"


def worker_command(job_id: str, worker_id: str) -> str:
    """Coordinator -> one worker: commands meant for that worker only (its plan slice differs)."""
    return f"liver.worker.cmd.{validate_token(job_id, 'job_id')}.{validate_token(worker_id, 'worker_id')}"


def worker_probe(job_id: str, worker_id: str) -> str:
    """Coordinator -> one worker, request/reply: is this worker's process still there? Its companion
    answers at once; a process that is gone has no subscription left, so the server answers "no
    responders" within a round trip, long before a heartbeat deadline passes."""
    return f"liver.worker.probe.{validate_token(job_id, 'job_id')}.{validate_token(worker_id, 'worker_id')}"


def device_probe(job_id: str, node: str, index: int) -> str:
    """Coordinator -> the worker on one device, request/reply, as :func:`worker_probe` asks a worker by
    name: a coordinator that restarted asks for a device of its world whose worker it has not heard
    from, and whose name no record kept, the same question. The node's id is in hex: node ids may be
    DNS names or provider ids, whose dots and slashes a subject token cannot hold."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise SubjectError(f"index: a device index is a non-negative integer, got {index!r}")
    if not isinstance(node, str) or not 0 < len(node) <= MAX_NODE_CHARS:
        raise SubjectError(f"node: a node id is 1-{MAX_NODE_CHARS} characters, got {node!r}")
    return f"liver.worker.probe.{validate_token(job_id, 'job_id')}.device.{node.encode().hex()}.{index}"


def worker_commands_any(job_id: str) -> str:
    """Pattern matching the per-worker command subjects of one job (for permissions and monitoring)."""
    return f"liver.worker.cmd.{validate_token(job_id, 'job_id')}.*"


def errors(source: str) -> str:
    """Where a service reports input it rejected (``ErrorEvent``); ``source`` is the service name."""
    return f"liver.errors.{validate_token(source, 'source')}"


def dead_letters(source: str) -> str:
    """Where a service copies the raw messages it gave up on, headers included, to be kept and replayed."""
    return f"liver.dlq.{validate_token(source, 'source')}"


def max_deliveries_advisory(stream: str, consumer: str) -> str:
    """JetStream's advisory when a message exhausted ``max_deliver`` (copy it to the dead letters)."""
    return (
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES."
        f"{validate_token(stream, 'stream')}.{validate_token(consumer, 'consumer')}"
    )


# -- headers -----------------------------------------------------------------------------------------

HEADER_MSG_ID: Final = "Nats-Msg-Id"
"""JetStream de-duplicates on this header within the stream's duplicate window: set it to the event or
generation id so that a retried publish is harmless."""

HEADER_ORIGINAL_SUBJECT: Final = "Liver-Original-Subject"
HEADER_ORIGINAL_STREAM: Final = "Liver-Original-Stream"
HEADER_ORIGINAL_SEQUENCE: Final = "Liver-Original-Sequence"
HEADER_ERROR: Final = "Liver-Error"
"""Dead letters carry these so that the raw payload can be traced back and replayed."""


# -- JetStream streams, key-value buckets and object stores ----------------------------------------


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A stream's name and the subjects it captures; services declare these idempotently."""

    name: str
    subjects: tuple[str, ...]
    description: str


STREAM_INGEST: Final = StreamSpec(
    name="LIVER_INGEST",
    subjects=(SPOT_WARNING, SCALE_REQUEST),
    description="Resize events from outside, kept until the ingester acknowledges them.",
)
STREAM_CONTROL: Final = StreamSpec(
    name="LIVER_CONTROL",
    subjects=(
        RESIZE_REQUESTED_ANY,
        TOPOLOGY_REQUEST_ANY,
        TOPOLOGY_PLANNED_ANY,
        TRANSFER_PLANNED_ANY,
        PLANNING_FAILED_ANY,
        WORLD_STARTED_ANY,
    ),
    description="Resize requests, topology requests, plans and started worlds between the control-plane "
    "services.",
)
STREAM_GENERATIONS: Final = StreamSpec(
    name="LIVER_GENERATIONS",
    subjects=(GENERATION_COMMITTED, GENERATION_ABORTED),
    description="Outcome of every handoff; a restarted coordinator replays it.",
)
STREAM_ERRORS: Final = StreamSpec(
    name="LIVER_ERRORS",
    subjects=(ERRORS_ANY,),
    description="Rejected input, with the field that was wrong.",
)
STREAM_DEAD_LETTERS: Final = StreamSpec(
    name="LIVER_DLQ",
    subjects=(DEAD_LETTERS_ANY,),
    description="Raw messages that were terminated, kept so nothing is lost.",
)
STREAMS: Final = (STREAM_INGEST, STREAM_CONTROL, STREAM_GENERATIONS, STREAM_ERRORS, STREAM_DEAD_LETTERS)

KV_GENERATIONS: Final = "liver-generations"
"""Key = job id, value = the job's current generation record; commit is a compare-and-set on it."""

KV_MEMBERSHIP: Final = "liver-membership"
"""Key = job id, value = the job's ``JobMembership`` (its current world's workers and their devices),
written by the coordinator; the ingester reads it to map a reclaimed node to the job's devices."""

KV_EVENTS_SEEN: Final = "liver-events-seen"
"""Key = ``<job id>.<event id>``; lets the ingester drop a re-sent event after JetStream's dedup window
has passed."""

OBJECT_STORE_PLANS: Final = "liver-plans"
"""Transfer plans, and the per-device slices too large for :data:`KV_PLAN_SLICES`: a large job's plan
exceeds the 1 MiB message limit."""

KV_PLAN_SLICES: Final = "liver-slices"
"""Per-device plan slices that fit one message, key = :meth:`liver.shared.messages.SliceIndex.key`
(``<job>.<generation>.s<seq>.<index>``): one put to write and one direct get to read, where an object
costs several round trips each way. History 1; entries expire with the plan store's TTL."""


def plan_object_name(job_id: str, generation: int, part: str = "plan") -> str:
    """Object-store name of a plan (``part="plan"``) or of one worker's slice (``part=<worker id>``)."""
    if generation < 0:
        raise SubjectError(f"generation must be >= 0, got {generation}")
    return f"{validate_token(job_id, 'job_id')}/{generation}/{validate_token(part, 'part')}"


def kv_key_prefix(object_prefix: str) -> str:
    """The key-value keys' first tokens for objects named ``<object_prefix>...``: ``/`` become ``.``
    and a final ``-`` becomes ``.`` (``job-1/3/s7-`` gives ``job-1.3.s7.``). One rule for the slice
    index's keys and the purge of a generation's keys, so that the pattern matches every key."""
    dotted = object_prefix.replace("/", ".")
    if dotted.endswith("-"):
        dotted = dotted[:-1] + "."
    return dotted if dotted.endswith(".") else dotted + "."


def slice_keys_of_generation(job_id: str, generation: int) -> str:
    """Subject pattern of every :data:`KV_PLAN_SLICES` key of one generation's plans, whatever their
    sequence (``job-1.3.>``): what a coordinator that lost the plan's names purges."""
    return kv_key_prefix(plan_object_name(job_id, generation, "x").rsplit("/", 1)[0]) + ">"


def topology_request_msg_id(job_id: str, generation: int) -> str:
    """``Nats-Msg-Id`` of the coordinator's request for generation ``generation``'s topology: each
    generation is requested once (a re-plan gets a new generation), so a retry is dropped."""
    if generation < 0:
        raise SubjectError(f"generation must be >= 0, got {generation}")
    return f"{validate_token(job_id, 'job_id')}-topology-{generation}"


def generation_msg_id(job_id: str, generation: int) -> str:
    """``Nats-Msg-Id`` of a generation's outcome: a coordinator that retries after a crash republishes
    the same id, and JetStream drops the copy."""
    if generation < 0:
        raise SubjectError(f"generation must be >= 0, got {generation}")
    return f"{validate_token(job_id, 'job_id')}-generation-{generation}"
