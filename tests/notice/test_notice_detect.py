"""``liver notice --source auto``: the platform is the one whose metadata service answers as it
documents, or Kubernetes inside a pod."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from local_http import LocalHttp, QuietHandler, serving

from liver.notice.detect import Platform, detect
from liver.notice.model import NoticeSourceError

Answer = Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, str], bytes]]


def aws_like(h: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
    if h.command == "PUT" and h.path == "/latest/api/token":
        return 200, {}, b"token"
    return 404, {}, b""


def azure_like(h: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
    if h.path.startswith("/metadata/instance") and h.headers.get("Metadata") == "true":
        return 200, {}, b"{}"
    return 400, {}, b""


def gcp_like(h: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
    if h.headers.get("Metadata-Flavor") != "Google":
        return 403, {}, b""
    return 200, {"Metadata-Flavor": "Google"}, b"1234"


def nothing(_: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
    return 404, {}, b""


class Fake:
    def __init__(self, answer: Answer) -> None:
        class Handler(QuietHandler):
            def _reply(self) -> None:
                status, headers, body = answer(self)
                self.answer(status, body, headers)

            do_GET = do_PUT = _reply

        self.http = LocalHttp(Handler)
        self.url = self.http.endpoint


@pytest.fixture
def fakes() -> Iterator[dict[str, Fake]]:
    answers = {"aws": aws_like, "azure": azure_like, "gcp": gcp_like, "none": nothing}
    made = {name: Fake(answer) for name, answer in answers.items()}
    with contextlib.ExitStack() as stack:
        for fake in made.values():
            stack.enter_context(serving(fake.http))
        yield made


def endpoints(fakes: dict[str, Fake], **which: str) -> dict[str, str]:
    return {f"{p}_endpoint": fakes[which.get(p, "none")].url for p in ("aws", "azure", "gcp")}


@pytest.mark.parametrize("platform", [Platform.AWS, Platform.AZURE, Platform.GCP])
def test_the_platform_whose_metadata_service_answers_is_chosen(
    fakes: dict[str, Fake], platform: Platform
) -> None:
    assert detect({}, **endpoints(fakes, **{platform.value: platform.value})) == platform


def test_an_azure_service_at_the_ec2_address_is_not_taken_for_ec2(fakes: dict[str, Fake]) -> None:
    same = fakes["azure"].url
    assert (
        detect({}, aws_endpoint=same, azure_endpoint=same, gcp_endpoint=fakes["none"].url) == Platform.AZURE
    )


def test_inside_a_pod_the_cluster_is_the_source(fakes: dict[str, Fake]) -> None:
    assert (
        detect({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, **endpoints(fakes, aws="aws")) == Platform.KUBERNETES
    )


def test_no_platform_answering_is_an_error_naming_every_address(fakes: dict[str, Fake]) -> None:
    with pytest.raises(NoticeSourceError, match="no platform answered") as info:
        detect({}, **endpoints(fakes))
    assert fakes["none"].url in str(info.value)
