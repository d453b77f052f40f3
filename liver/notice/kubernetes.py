"""Kubernetes: a node that gets a disruption taint, seen through the official client's watch.

The components that take nodes away mark them first, each with a taint of its own:

- Karpenter: ``karpenter.sh/disrupted`` (v1; ``karpenter.sh/disruption`` before it);
- the cluster autoscaler: ``ToBeDeletedByClusterAutoscaler``;
- the AWS node termination handler: ``aws-node-termination-handler/spot-itn``,
  ``.../scheduled-maintenance`` and ``.../asg-lifecycle-termination``;
- GKE, on a preemption or a Spot reclaim: ``cloud.google.com/impending-node-termination``.

The source watches its own node (``list_node`` with ``fieldSelector=metadata.name=<node>``, resumed
from the last resource version, re-listed after a ``410 Gone``) for up to ``wait_s`` per call: a long
poll, so a taint is seen when it is set. A taint carries no deadline, so the notice is the taint's
``timeAdded`` (else the moment it was first seen) plus ``grace_s``; its key is the taint and that time,
so a restarted agent that finds the taint again makes the same event. The rebalance recommendation of
the termination handler is an early hint, not a reclaim, and is not a notice.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Final

from liver.notice.model import Notice, NoticeKind, NoticeSourceError

DISRUPTION_TAINTS: Final = (
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "ToBeDeletedByClusterAutoscaler",
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/scheduled-maintenance",
    "aws-node-termination-handler/asg-lifecycle-termination",
    "cloud.google.com/impending-node-termination",
)
DEFAULT_GRACE_S: Final = 60.0


class KubernetesNotices:
    """Watches node ``node`` for a disruption taint (:meth:`poll`)."""

    provider = "kubernetes"
    long_poll = True

    def __init__(
        self,
        node: str,
        api: Any | None = None,
        *,
        wait_s: float = 10.0,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        from kubernetes import client  # imported here: only this source needs the client

        self.node = node
        self.api = api if api is not None else client.CoreV1Api()
        self.wait_s = wait_s
        self.grace = timedelta(seconds=grace_s)
        self._version: str | None = None
        self._first_seen: dict[str, datetime] = {}

    @classmethod
    def connect(cls, node: str, endpoint: str | None = None, **options: Any) -> KubernetesNotices:
        """In a pod: the service account's credentials; elsewhere: the kubeconfig; ``endpoint``: an API
        server without authentication (a local proxy, ``kubectl proxy``, or a test)."""
        from kubernetes import client, config

        if endpoint is not None:
            configuration = client.Configuration()
            configuration.host = endpoint
            return cls(node, client.CoreV1Api(client.ApiClient(configuration)), **options)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as exc:
                reason = f"no Kubernetes credentials (in-cluster or kubeconfig): {exc}"
                raise NoticeSourceError(reason) from None
        return cls(node, **options)

    def poll(self) -> Notice | None:
        """The disruption announced for this node, or None when none is set within ``wait_s``."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        w = watch.Watch()
        try:
            for event in w.stream(
                self.api.list_node,
                field_selector=f"metadata.name={self.node}",
                resource_version=self._version,
                timeout_seconds=max(1, int(self.wait_s)),
                allow_watch_bookmarks=True,
            ):
                node = event.get("object")
                version = getattr(getattr(node, "metadata", None), "resource_version", None)
                if version:
                    self._version = version
                if event.get("type") in ("ADDED", "MODIFIED") and node is not None:
                    notice = self._notice_of(node)
                    if notice is not None:
                        return notice
            return None
        except ApiException as exc:
            if exc.status == 410:  # our resource version is too old: list again from now
                self._version = None
                return None
            raise NoticeSourceError(f"watching node {self.node}: HTTP {exc.status}: {exc.reason}") from None
        except (HTTPError, OSError, ValueError) as exc:
            raise NoticeSourceError(f"watching node {self.node}: {exc}") from None
        finally:
            w.stop()

    def _notice_of(self, node: Any) -> Notice | None:
        for taint in getattr(node.spec, "taints", None) or ():
            if taint.key not in DISRUPTION_TAINTS:
                continue
            added = taint.time_added
            if added is not None and added.tzinfo is None:
                added = added.replace(tzinfo=UTC)
            key = f"{taint.key}-{added.strftime('%Y%m%dT%H%M%SZ') if added else 'untimed'}"
            since = added or self._first_seen.setdefault(key, datetime.now(UTC))
            deadline = since + self.grace
            return Notice(provider=self.provider, kind=NoticeKind.TERMINATION, deadline=deadline, key=key)
        return None
