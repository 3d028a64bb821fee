#!/usr/bin/env bash
# Create the environment and run the soak: one kombu connection shared by many threads
# through a fault proxy, a fault every few seconds, for SOAK_SECONDS per run (default
# 600: the four runs take about 42 minutes; scripts/bench.sh runs it last, 30 s per run
# by default). Runs scenario A (20 threads) with the drainer, in legacy mode and with
# stock kombu behind one lock, and scenario B (8 retrying publishers). Runs under 300 s
# report the RSS slope without judging it, and bound stuck threads by 45 s rather than
# twice the longest fault (tests/soak/run.py: targets). Prints one line per run and a
# summary; writes bench-results/soak.json. With RabbitMQ installed locally it starts a node of its own,
# so the memory-alarm fault is drawn too (SOAK_OWN_NODE=0: the shared broker only).
# Extra arguments go to the soak (e.g. --seed 5 --runs A/drainer).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
args=(--seconds "${SOAK_SECONDS:-600}" --out bench-results/soak.json)
if [ "${SOAK_OWN_NODE:-1}" = 1 ] && [ -x "${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}/rabbitmq-server" ]; then
  args+=(--own-node)
fi
start=$(date +%s)
status=0
PYTHONPATH=src:tests .venv/bin/python -m soak "${args[@]}" "$@" || status=$?
echo "soak done in $(( $(date +%s) - start )) s; results: bench-results/soak.json"
exit "$status"
