#!/bin/sh
# Make a local certificate authority and a certificate for the NATS server, signed by it (default
# folder: infra/tls, which compose.yaml mounts). Clients trust the CA through $NATS_TLS_CA=ca.crt.
#
#   infra/make-tls.sh [DIR] [NAME ...]
#
# The server's certificate is valid for `nats` (its compose service name), `localhost` and 127.0.0.1,
# plus each NAME given (a DNS name, or an IPv4 address), as a server and as a client: NATS servers in a
# cluster present it to each other on their routes (mutual TLS, as infra/k8s's cluster does). It never overwrites: remove the folder first to
# make a new CA and certificate (then restart the stack). On Kubernetes, cert-manager makes them instead
# (infra/k8s/tls.yaml).
set -eu

out="${1:-$(dirname "$0")/tls}"
[ $# -gt 0 ] && shift
if [ -e "$out/ca.crt" ] || [ -e "$out/server.crt" ]; then
    echo "make-tls: $out already holds certificates; remove it first to make new ones" >&2
    exit 1
fi
command -v openssl >/dev/null || { echo "make-tls: openssl is needed" >&2; exit 1; }

names="DNS:nats,DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
    case "$name" in
        *[!0-9.]*) names="$names,DNS:$name" ;;
        *) names="$names,IP:$name" ;;
    esac
done

mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
umask 077
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -days 3650 \
    -subj "/CN=LiveR local CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash" \
    -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -subj "/CN=nats" \
    -keyout "$work/server.key" -out "$work/server.csr" 2>/dev/null
cat > "$work/server.ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
subjectAltName = $names
EXT
openssl x509 -req -in "$work/server.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
    -sha256 -days 825 -extfile "$work/server.ext" -out "$work/server.crt" 2>/dev/null
chmod 644 "$work/ca.crt" "$work/server.crt"
mv "$work/ca.crt" "$work/ca.key" "$work/server.crt" "$work/server.key" "$out/"
echo "make-tls: wrote $out (ca.crt, ca.key, server.crt, server.key) for $names"
