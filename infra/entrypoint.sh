#!/usr/bin/env bash
# The LiveR image's entrypoint: one image, one command per role (see infra/README.md).
#
#   ingester | topology | transfer | coordinator [OPTIONS]   a control-plane service (`liver serve ...`)
#   worker [OPTIONS]         one training process of a job (`liver worker`, e.g. --job J --node N ...)
#   simulate [OPTIONS]       a stand-in job of simulated workers (`liver workers`, e.g. --simulate 4)
#   run COMMAND [ARGS]       your own training command (torchrun ... train.py) with the NATS_* settings
#   health SERVICE           exit 0 when SERVICE answers NATS discovery (the container health check)
#   liver [ARGS]             any other `liver` command
#
# Every role connects to $NATS_URL with $NATS_USER/$NATS_PASSWORD ($NATS_TOKEN or $NATS_CREDS work too).
# Commands replace this shell (exec), so SIGTERM from `docker stop` reaches Python, which drains and
# exits 0.
set -euo pipefail

here="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
python="${LIVER_PYTHON:-python3}"

usage() {
    sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

if [[ $# -eq 0 ]]; then
    usage >&2
    exit 2
fi

role="$1"
shift
case "$role" in
    ingester | topology | transfer | coordinator)
        # The command modules' own entry points behave as `liver serve|worker|workers` and start in a
        # fraction of the time: `liver` builds every subcommand's parser first, importing torch and scipy.
        exec "$python" -m liver.cli.serve_cmd "$role" "$@"
        ;;
    worker)
        exec "$python" -m liver.cli.worker_cmd "$@"
        ;;
    simulate)
        exec "$python" -m liver.cli.workers_cmd "$@"
        ;;
    run)
        if [[ $# -eq 0 ]]; then
            echo "entrypoint: run needs the command to run, e.g. run torchrun train.py" >&2
            exit 2
        fi
        exec "$@"
        ;;
    health)
        exec "$python" "$here/healthcheck.py" "$@"
        ;;
    liver)
        exec liver "$@"
        ;;
    help | -h | --help)
        usage
        ;;
    *)
        echo "entrypoint: unknown command '$role'" >&2
        usage >&2
        exit 2
        ;;
esac
