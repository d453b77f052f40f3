"""``--source auto``: which platform this agent runs on, from what answers.

In a pod (``$KUBERNETES_SERVICE_HOST`` set) it is Kubernetes: the cluster's taints are the signal that
covers every kind of node there. Otherwise each metadata service is asked once, briefly, in an order that
cannot confuse them: EC2 (a session token from ``PUT /latest/api/token``; Azure's service, on the same
address, has no such path), then Azure (``/metadata/instance`` with ``Metadata: true``), then Compute
Engine (``Metadata-Flavor: Google`` echoed by the metadata server). None answering is an error naming
every address tried, so a misplaced agent says so at start instead of watching nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

from liver.notice import aws, azure, gcp
from liver.notice.http import Endpoint
from liver.notice.model import NoticeSourceError

PROBE_TIMEOUT_S: Final = 1.0


class Platform(StrEnum):
    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    KUBERNETES = "kubernetes"


def detect(
    environ: Mapping[str, str],
    *,
    aws_endpoint: str = aws.DEFAULT_ENDPOINT,
    azure_endpoint: str = azure.DEFAULT_ENDPOINT,
    gcp_endpoint: str = gcp.DEFAULT_ENDPOINT,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> Platform:
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return Platform.KUBERNETES
    tried = []
    probes = (
        (Platform.AWS, aws_endpoint, _is_aws),
        (Platform.AZURE, azure_endpoint, _is_azure),
        (Platform.GCP, gcp_endpoint, _is_gcp),
    )
    for platform, base, probe in probes:
        try:
            if probe(Endpoint(base, timeout_s)):
                return platform
        except NoticeSourceError:
            pass
        tried.append(f"{platform.value} at {base}")
    raise NoticeSourceError(f"no platform answered ({', '.join(tried)}; not in a Kubernetes pod)")


def _is_aws(endpoint: Endpoint) -> bool:
    answer = endpoint.send(
        aws.TOKEN_PATH, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    return answer.status == 200 and bool(answer.body.strip())


def _is_azure(endpoint: Endpoint) -> bool:
    return endpoint.send("/metadata/instance?api-version=2021-02-01", headers=azure.HEADERS).status == 200


def _is_gcp(endpoint: Endpoint) -> bool:
    answer = endpoint.send("/computeMetadata/v1/instance/id", headers=gcp.HEADERS)
    flavor = {k.lower(): v for k, v in answer.headers.items()}.get("metadata-flavor", "")
    return answer.status == 200 and flavor == "Google"
