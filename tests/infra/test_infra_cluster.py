"""The NATS cluster's routes (port 6222) in infra/k8s (issue 34, item 2): a server joins only with the
route user's password and over mutual TLS with a certificate of the job's CA.

The fast tests read what each pod gets: ``cluster.conf`` from the ConfigMap (parsed here), the routes
from the StatefulSet's arguments (the kubelet puts the password into them from the environment), the
route certificate from cert-manager. The slow test runs three nats-servers on loopback with exactly that
configuration, certificates from infra/make-tls.sh standing in for cert-manager's: they form a JetStream
cluster, and a server that offers a route without the password, or without TLS, is refused.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import pytest
from infra_helpers import INFRA, ROLES, make_tls, password_var
from test_infra_k8s import cert_manager, env_of, find

from liver.shared.nats_server import NatsServer, free_port

ROUTE_PASSWORD_ENV: Final = "LIVER_NATS_ROUTE_PASSWORD"
ROUTE_USER: Final = "route"
CLUSTER_HOST: Final = re.compile(r"liver-nats-(\d+)\.liver-nats-cluster\.liver\.svc")


# -- nats-server's configuration format, the part LiveR writes ----------------------------------------


class ConfSyntaxError(ValueError):
    """cluster.conf uses syntax this reader does not handle; keep it to `key: value`, blocks and lists."""


def parse_conf(text: str) -> dict[str, Any]:
    """``key: value``, ``key { ... }``, ``key: [ ... ]`` (one item a line) and ``include PATH`` (kept as
    ``include`` entries); ``#`` comments. Values are strings, as written (variables keep their ``$``)."""
    root: dict[str, Any] = {}
    stack: list[Any] = [root]
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        top = stack[-1]
        if line in ("}", "]"):
            if len(stack) == 1 or (line == "]") != isinstance(top, list):
                raise ConfSyntaxError(f"line {number}: unbalanced {line!r}")
            stack.pop()
            continue
        if isinstance(top, list):
            top.append(line.strip('"'))
            continue
        if line.startswith("include "):
            root.setdefault("include", []).append(line.split(None, 1)[1])
            continue
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?::|=)?\s*(.*)", line)
        if match is None:
            raise ConfSyntaxError(f"line {number}: {line!r}")
        key, value = match.groups()
        if key in top:
            raise ConfSyntaxError(f"line {number}: {key!r} given twice")
        if value in ("{", "["):
            top[key] = {} if value == "{" else []
            stack.append(top[key])
        elif value and value[0] not in "{[":
            top[key] = value.strip('"')
        else:
            raise ConfSyntaxError(f"line {number}: put the block's contents on lines of their own: {line!r}")
    if len(stack) != 1:
        raise ConfSyntaxError("a block is not closed")
    return root


def test_the_reader_reads_blocks_lists_and_variables() -> None:
    conf = parse_conf('include ./a.conf\nx: $V  # c\nb {\n  l: [\n    "u"\n  ]\n  c {\n    d: 1\n  }\n}\n')
    assert conf == {"include": ["./a.conf"], "x": "$V", "b": {"l": ["u"], "c": {"d": "1"}}}
    with pytest.raises(ConfSyntaxError):
        parse_conf("a {\n")


# -- what each pod gets -------------------------------------------------------------------------------


def statefulset() -> dict[str, Any]:
    return find("StatefulSet", "liver-nats")


def nats_container() -> dict[str, Any]:
    (container,) = statefulset()["spec"]["template"]["spec"]["containers"]
    return container


def cluster_conf_text() -> str:
    return str(find("ConfigMap", "liver-nats-cluster")["data"]["cluster.conf"])


def cluster_block() -> dict[str, Any]:
    return dict(parse_conf(cluster_conf_text())["cluster"])


def route_urls() -> list[str]:
    """The routes each server dials, from its arguments (``--routes``, comma-separated)."""
    args = [str(a) for a in nats_container()["args"]]
    assert args.count("--routes") == 1, "the routes come from the arguments"
    return args[args.index("--routes") + 1].split(",")


def projected(secret: str) -> dict[str, str]:
    """Where each key of ``secret`` is in the nats container (the projected config volume)."""
    pod = statefulset()["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    (mount,) = [m for m in nats_container()["volumeMounts"] if m["name"] == "config"]
    (source,) = [
        s["secret"] for s in volume["projected"]["sources"] if s.get("secret", {}).get("name") == secret
    ]
    return {item["key"]: f"{mount['mountPath']}/{item['path']}" for item in source["items"]}


def test_the_cluster_port_takes_only_the_route_user_with_its_password_from_the_secret() -> None:
    authorization = cluster_block()["authorization"]
    assert authorization["user"] == ROUTE_USER
    assert authorization["password"] == f"${ROUTE_PASSWORD_ENV}", "a variable: no password in the ConfigMap"
    assert float(authorization["timeout"]) > 0
    env = env_of(nats_container())
    assert env[ROUTE_PASSWORD_ENV] == {
        "secretKeyRef": {"name": "liver-nats-passwords", "key": ROUTE_PASSWORD_ENV}
    }, "the Secret made from make-env.sh's file"


def test_the_cluster_port_speaks_mutual_tls_with_a_certificate_of_the_jobs_ca() -> None:
    tls = cluster_block()["tls"]
    certificate = cert_manager("Certificate")["liver-nats-routes"]["spec"]
    files = projected(certificate["secretName"])
    assert (tls["cert_file"], tls["key_file"], tls["ca_file"]) == (
        files["tls.crt"],
        files["tls.key"],
        files["ca.crt"],
    )
    assert tls.get("verify", "true") == "true", "every server presents its certificate (always, for routes)"
    assert {"server auth", "client auth"} <= set(certificate["usages"]), "each server is both ends of a route"
    client = cert_manager("Certificate")["liver-nats-server"]["spec"]
    assert certificate["issuerRef"] == client["issuerRef"], "the job's CA, as for clients"
    assert certificate["secretName"] != client["secretName"], (
        "the clients' CA mount never holds the route key"
    )
    for url in route_urls():
        host = urlsplit(url).hostname or ""
        assert any(
            re.fullmatch(re.escape(n).replace(r"\*", r"[^.]+"), host) for n in certificate["dnsNames"]
        ), host


def test_every_route_carries_the_route_users_password_from_the_environment() -> None:
    urls = route_urls()
    replicas = statefulset()["spec"]["replicas"]
    listen_port = int(cluster_block()["listen"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in nats_container()["ports"]}
    hosts = []
    for url in urls:
        parts = urlsplit(url)
        assert (parts.username, parts.password) == (ROUTE_USER, f"$({ROUTE_PASSWORD_ENV})"), (
            "the kubelet expands $(VAR) in arguments from the container's environment"
        )
        assert parts.port == listen_port == ports["cluster"]
        match = CLUSTER_HOST.fullmatch(parts.hostname or "")
        assert match is not None, url
        hosts.append(int(match.group(1)))
    assert sorted(hosts) == list(range(replicas)), "every server of the StatefulSet, once"
    assert "routes" not in cluster_block(), "no route without credentials in the config"


def test_the_route_password_is_one_make_env_writes() -> None:
    text = (INFRA / "make-env.sh").read_text()
    assert f"{ROUTE_PASSWORD_ENV}=" in text


# -- three servers with it ------------------------------------------------------------------------------

FORM_S = 90.0
REFUSAL_S = 30.0


def _json(url: str) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        return dict(json.load(response))


def _wait(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.2)


def _log_has(server: NatsServer, needle: str) -> bool:
    try:
        return needle in server.log_file.read_text(errors="replace")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_servers_with_the_pods_config_form_a_cluster_and_refuse_routes_without_password_or_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The certificates cert-manager keeps (make-tls.sh's: valid for 127.0.0.1, server and client auth).
    made = make_tls(tmp_path / "made")
    client_dir, route_dir = tmp_path / "tls", tmp_path / "routes"
    for folder in (client_dir, route_dir):
        folder.mkdir()
        (folder / "tls.crt").write_bytes((made / "server.crt").read_bytes())
        (folder / "tls.key").write_bytes((made / "server.key").read_bytes())
    (route_dir / "ca.crt").write_bytes((made / "ca.crt").read_bytes())
    (tmp_path / "nats.conf").write_text((INFRA / "nats.conf").read_text())  # the liver-nats-auth Secret

    config = (
        cluster_conf_text()
        .replace("/etc/nats/tls/", f"{client_dir}/")
        .replace("/etc/nats/routes/", f"{route_dir}/")
    )
    assert "/etc/nats/" not in config, "every file the config names is one of the mounted Secrets'"
    listen = cluster_block()["listen"]
    route_ports = [free_port() for _ in range(3)]
    password = "pRoute0123456789abcdef"

    def on_loopback(url: str) -> str:
        """A route of the manifest as the kubelet expands it, each pod's host name its loopback port."""
        parts = urlsplit(url.replace(f"$({ROUTE_PASSWORD_ENV})", password))
        match = CLUSTER_HOST.fullmatch(parts.hostname or "")
        assert match is not None, url
        port = route_ports[int(match.group(1))]
        return parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:{port}").geturl()

    urls = [on_loopback(url) for url in route_urls()]
    for role in ROLES:
        monkeypatch.setenv(password_var(role), f"p{role}")
    monkeypatch.setenv(ROUTE_PASSWORD_ENV, password)

    members = []
    try:
        for i, port in enumerate(route_ports):
            conf = tmp_path / f"cluster-{i}.conf"
            conf.write_text(config.replace(f"listen: {listen}", f"listen: 127.0.0.1:{port}"))
            monkeypatch.setenv("SERVER_NAME", f"liver-nats-{i}")
            member = NatsServer(
                config_file=conf,
                store_dir=tmp_path / f"store-{i}",
                log_file=tmp_path / f"nats-{i}.log",
                startup_timeout_s=FORM_S,
                extra_args=("--routes", ",".join(urls)),
            )
            member.launch()
            members.append(member)
        for member in members:
            member.wait_ready()  # healthy only with a JetStream meta leader: a quorum of routed servers

        def full_mesh() -> bool:
            for i, member in enumerate(members):
                names = {
                    r.get("remote_name") for r in _json(f"{member.monitor_url}/routez").get("routes") or ()
                }
                if names != {f"liver-nats-{j}" for j in range(3) if j != i}:
                    return False
            return True

        _wait("every server routed to the two others", full_mesh, FORM_S)
        jsz = _json(f"{members[0].monitor_url}/jsz")
        assert jsz["meta_cluster"]["cluster_size"] == 3

        # A server that offers a route with TLS but without the password, and one with the password but
        # without TLS: neither joins.
        no_password = tmp_path / "no-password.conf"
        no_password.write_text(
            f"cluster {{\n  name: liver\n  listen: 127.0.0.1:{free_port()}\n"
            f"  tls {{\n    cert_file: {route_dir}/tls.crt\n    key_file: {route_dir}/tls.key\n"
            f"    ca_file: {route_dir}/ca.crt\n  }}\n}}\n"
        )
        no_tls = tmp_path / "no-tls.conf"
        no_tls.write_text(f"cluster {{\n  name: liver\n  listen: 127.0.0.1:{free_port()}\n}}\n")
        target = route_ports[0]
        intruders = [
            NatsServer(
                config_file=no_password,
                log_file=tmp_path / "no-password.log",
                extra_args=("--server_name", "intruder-a", "--routes", f"nats://127.0.0.1:{target}"),
            ),
            NatsServer(
                config_file=no_tls,
                log_file=tmp_path / "no-tls.log",
                extra_args=(
                    "--server_name",
                    "intruder-b",
                    "--routes",
                    f"nats://{ROUTE_USER}:{password}@127.0.0.1:{target}",
                ),
            ),
        ]
        try:
            for intruder in intruders:
                intruder.launch()
            _wait(
                "the route without the password refused",
                lambda: (
                    _log_has(members[0], "Router connection closed: Authentication Failure")
                    and _log_has(intruders[0], "Route Error 'Authorization Violation'")
                ),
                REFUSAL_S,
            )
            _wait(
                "the route without TLS refused",
                lambda: _log_has(members[0], "Router connection closed: TLS Handshake Failure"),
                REFUSAL_S,
            )
            time.sleep(2.0)  # what a refused route would have needed to register
            for member in members:
                names = {
                    r.get("remote_name") for r in _json(f"{member.monitor_url}/routez").get("routes") or ()
                }
                assert not names & {"intruder-a", "intruder-b"}, names
        finally:
            for intruder in intruders:
                intruder.stop()

        for i, member in enumerate(members):
            varz = json.dumps(_json(f"{member.monitor_url}/varz"))
            assert password not in varz, "the monitoring endpoint shows no route password"
            assert password not in (tmp_path / f"nats-{i}.log").read_text(), "nor does the log"
    finally:
        for member in members:
            member.stop()
