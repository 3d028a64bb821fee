#!/usr/bin/env bash
# Create the environment and run the benchmarks (the README's first command): the
# drainer against legacy mode, and (benchmarks A-E) against stock kombu/py-amqp and
# amqpstorm in the same run. Full mode by default (about 13 minutes), then a short soak
# (scripts/soak.sh: four runs of SOAK_SECONDS, default 30 here, about 4 minutes;
# SOAK_SECONDS=600 for the long soak, about 42 minutes; SOAK_SECONDS=0 skips it);
# DRAINER_BENCH_QUICK=1 for the short CI variant (no soak).
# Prints each benchmark's table and writes bench-results/report.md, results.json and
# the PNG plots. Extra arguments go to pytest (e.g. -k reset_peer).
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
# Benchmark D opens 1,000 idle connections: the shared broker allows about 830 sockets,
# so with RabbitMQ installed locally they go to a node of the benchmark's own.
if [ "$DRAINER_BENCH_QUICK" != 1 ] && [ -x "${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}/rabbitmq-server" ]; then
  export DRAINER_BENCH_OWN_BROKER="${DRAINER_BENCH_OWN_BROKER:-1}"
fi
start=$(date +%s)
# bench_*.py files are benchmarks too: pytest collects only test_*.py by default.
.venv/bin/python -m pytest tests/benchmarks -m benchmark -s -p no:cacheprovider \
    -o python_files='test_*.py bench_*.py' "$@"
echo "benchmarks done in $(( $(date +%s) - start )) s; report: bench-results/report.md"
if [ "$DRAINER_BENCH_QUICK" != 1 ] && [ "${SOAK_SECONDS:-30}" != 0 ]; then
  SOAK_SECONDS="${SOAK_SECONDS:-30}" bash scripts/soak.sh
fi
