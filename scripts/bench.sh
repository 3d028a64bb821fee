#!/usr/bin/env bash
# Create the environment and run the benchmarks (the README's first command): the
# drainer against legacy mode, and against stock kombu/py-amqp, pika, aio-pika and
# amqpstorm, in the same run. About eight and a half minutes here (2 cores), install
# included; each benchmark says as it starts how long it usually takes and how long is
# left.
# Opt-in, one variable each:
#   DRAINER_BENCH_CLUSTER=1  benchmarks F (failover) and J (confirms on a quorum queue):
#                            a three-node cluster of our own, about four minutes more
#   DRAINER_BENCH_OWN_BROKER=1  benchmark D with 1,000 idle connections, on a node of its
#                            own (the shared broker allows about 830 sockets; default: 200
#                            connections on the shared broker), about 11 s more
#   SOAK_SECONDS=30          then the soak (scripts/soak.sh): four runs of SOAK_SECONDS
#                            (600: the long soak, about 42 minutes)
# DRAINER_BENCH_QUICK=1 is the short CI variant. Prints each benchmark's table and writes
# bench-results/report.md, results.json and the PNG plots. Extra arguments go to pytest
# (e.g. -k reset_peer).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
# The gunicorn benchmark loads the app with wrk when it is installed (Debian package),
# and with a small Python client otherwise.
if ! command -v wrk >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q wrk || (apt-get update -q && apt-get install -y -q wrk)) \
    >/dev/null 2>&1 || echo "wrk not available: the gunicorn benchmark uses its Python client"
fi
export DRAINER_BENCH_QUICK="${DRAINER_BENCH_QUICK:-0}"
skip=()
if [ "${DRAINER_BENCH_CLUSTER:-0}" != 1 ]; then
  skip=(--ignore=tests/benchmarks/bench_failover.py --ignore=tests/benchmarks/bench_quorum.py)
fi
start=$(date +%s)
# bench_*.py files are benchmarks too: pytest collects only test_*.py by default.
.venv/bin/python -m pytest tests/benchmarks -m benchmark -s -p no:cacheprovider \
    -o python_files='test_*.py bench_*.py' "${skip[@]}" "$@"
echo "benchmarks done in $(( $(date +%s) - start )) s; report: bench-results/report.md"
if [ "$DRAINER_BENCH_QUICK" != 1 ] && [ "${SOAK_SECONDS:-0}" != 0 ]; then
  SOAK_SECONDS="$SOAK_SECONDS" bash scripts/soak.sh
fi
