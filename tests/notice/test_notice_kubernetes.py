"""The Kubernetes notice source, driven by the official client against a local API server that replays
recorded watch streams of a node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from local_http import LocalHttp, QuietHandler, nothing_listening, serving

from liver.cli.main import main
from liver.notice.agent import NoticeAgent, PollOutcome
from liver.notice.kubernetes import KubernetesNotices
from liver.notice.model import NoticeKind, NoticeSourceError
from liver.shared.codec import decode
from liver.shared.messages import SpotWarning

NODE = "node-a"
ADDED_AT = "2026-12-04T16:00:00Z"


def node(version: str, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": NODE, "resourceVersion": version},
        "spec": {"taints": taints or []},
    }


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


KARPENTER = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule", "timeAdded": ADDED_AT}
GPU = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GONE = line(
    "ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
)


class FakeApiServer:
    """Answers each watch of the node with the next recorded stream (or an HTTP status)."""

    def __init__(self) -> None:
        self.streams: list[bytes | int] = []
        self.queries: list[dict[str, str]] = []
        fake = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.queries.append(query)
                reply = fake.streams.pop(0) if fake.streams else b""
                if url.path != "/api/v1/nodes" or query.get("watch") not in ("true", "True"):
                    reply = 404
                json_type = {"Content-Type": "application/json"}
                if isinstance(reply, int):
                    status = json.dumps({"kind": "Status", "code": reply, "reason": "Forbidden"}).encode()
                    self.answer(reply, status, json_type)
                else:
                    self.answer(200, reply, json_type)

        self.http = LocalHttp(Handler)
        self.endpoint = self.http.endpoint


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    with serving(fake.http):
        yield fake


def source(api: FakeApiServer, **options: Any) -> KubernetesNotices:
    return KubernetesNotices.connect(NODE, api.endpoint, wait_s=1, **options)


def test_a_node_without_a_disruption_taint_is_no_notice(api: FakeApiServer) -> None:
    api.streams = [line("ADDED", node("100", [GPU]))]
    assert source(api).poll() is None
    assert api.queries[0]["fieldSelector"] == f"metadata.name={NODE}"


def test_a_disruption_taint_is_a_notice_a_grace_after_it_was_added(api: FakeApiServer) -> None:
    api.streams = [line("ADDED", node("100")) + line("MODIFIED", node("101", [GPU, KARPENTER]))]
    notice = source(api, grace_s=90).poll()
    assert notice is not None
    assert (notice.provider, notice.kind) == ("kubernetes", NoticeKind.TERMINATION)
    assert notice.deadline == datetime(2026, 12, 4, 16, 0, tzinfo=UTC) + timedelta(seconds=90)
    assert notice.event_id(NODE) == "kubernetes-node-a-karpenter-sh-disrupted-20261204T160000Z"


@pytest.mark.parametrize(
    "taint",
    [
        "ToBeDeletedByClusterAutoscaler",
        "aws-node-termination-handler/spot-itn",
        "cloud.google.com/impending-node-termination",
    ],
)
def test_each_known_disruption_taint_is_a_notice(api: FakeApiServer, taint: str) -> None:
    api.streams = [line("ADDED", node("100", [{"key": taint, "effect": "NoSchedule"}]))]
    notice = source(api).poll()
    assert notice is not None and taint.replace("/", "-").replace(".", "-") in notice.event_id(NODE)


def test_the_next_watch_resumes_from_the_last_version_seen(api: FakeApiServer) -> None:
    api.streams = [line("ADDED", node("100")), line("MODIFIED", node("105", [KARPENTER]))]
    s = source(api)
    assert s.poll() is None
    assert s.poll() is not None
    assert "resourceVersion" not in api.queries[0]
    assert api.queries[1]["resourceVersion"] == "100"


def test_an_expired_version_starts_over_with_a_fresh_list(api: FakeApiServer) -> None:
    api.streams = [line("ADDED", node("100")), GONE, line("ADDED", node("300", [KARPENTER]))]
    s = source(api)
    assert s.poll() is None
    assert s.poll() is None  # 410 Gone: the version is dropped
    assert s.poll() is not None
    assert "resourceVersion" not in api.queries[2]


def test_a_refused_watch_is_a_source_error_naming_the_status(api: FakeApiServer) -> None:
    api.streams = [403]
    with pytest.raises(NoticeSourceError, match="HTTP 403"):
        source(api).poll()


def test_an_unreachable_api_server_is_a_source_error() -> None:
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = nothing_listening()
    configuration.retries = 0
    s = KubernetesNotices(NODE, client.CoreV1Api(client.ApiClient(configuration)), wait_s=1)
    with pytest.raises(NoticeSourceError, match=f"watching node {NODE}"):
        s.poll()


async def test_the_agent_publishes_the_taint_once_and_a_restarted_one_makes_the_same_event(
    api: FakeApiServer,
) -> None:
    tainted = line("ADDED", node("200", [KARPENTER]))
    api.streams = [tainted, tainted, tainted]
    events: list[Any] = []

    async def publish(e: Any) -> None:
        events.append(e)

    agent = NoticeAgent(source(api), job_id="j", node=NODE, publish=publish)
    assert await agent.poll_once() == PollOutcome.PUBLISHED
    assert await agent.poll_once() == PollOutcome.ALREADY_PUBLISHED
    restarted = NoticeAgent(source(api), job_id="j", node=NODE, publish=publish)
    assert await restarted.poll_once() == PollOutcome.PUBLISHED
    assert len({e.event_id for e in events}) == 1


def test_notice_once_with_the_kubernetes_source_prints_the_taint(
    api: FakeApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    api.streams = [line("ADDED", node("100", [KARPENTER]))]
    argv = ["notice", "--source", "kubernetes", "--endpoint", api.endpoint, "--job", "j", "--node", NODE]
    assert main([*argv, "--interval", "1", "--grace", "30", "--once", "--dry-run"]) == 0
    warning = decode(capsys.readouterr().out.strip().splitlines()[-1].encode(), SpotWarning)
    assert warning.deadline == datetime(2026, 12, 4, 16, 0, 30, tzinfo=UTC)
