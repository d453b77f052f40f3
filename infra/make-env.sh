#!/bin/sh
# Write the NATS passwords of a LiveR deployment to an env file (default: infra/.env, which
# `docker compose` reads from the compose file's folder). One random password per user of
# infra/nats.conf, and the route password of the Kubernetes NATS cluster: 'p' and 48 hex digits, so that
# nats-server reads it as a string (a value such as `true` or `2k` would not be) and a route URL can carry
# it as it is.
#
#   infra/make-env.sh [FILE]
#
# It never overwrites: remove the file first to rotate every password (then restart the stack).
set -eu

out="${1:-$(dirname "$0")/.env}"
if [ -e "$out" ]; then
    echo "make-env: $out exists; remove it first to make new passwords" >&2
    exit 1
fi

umask 077
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
{
    echo "# NATS passwords of a LiveR deployment, made by infra/make-env.sh. Keep this file secret."
    for role in INGESTER TOPOLOGY TRANSFER COORDINATOR WORKER PUBLISHER SUBSCRIBER OPERATOR; do
        secret="p$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
        echo "LIVER_NATS_PASSWORD_${role}=${secret}"
    done
    # The route user's password of a NATS cluster (infra/k8s/nats.yaml): servers join only with it.
    echo "LIVER_NATS_ROUTE_PASSWORD=p$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
} > "$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "make-env: wrote $out"
