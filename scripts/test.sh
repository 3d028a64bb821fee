#!/usr/bin/env bash
# Create the environment and run the tests (the README's second command; CI runs it), in
# steps: the install; lint, types, the docs build and the package check; the test suite,
# with the version matrix (noxfile.py), py-amqp's and kombu's own suites and the cluster
# tests beside it (they mostly wait on brokers); last the benchmarks in quick mode, alone,
# so that their hard bounds and deadlock checks hold on every change. Each step says what
# it is, how long it usually takes on 2 cores and how long is left; its output goes to
# .test-logs/STEP.log, its closing lines to the screen (all of it when it fails). Extra
# arguments go to the test suite's pytest (the cluster tests then run in it, if chosen).
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$PWD/.test-logs
rm -rf "$logs" && mkdir -p "$logs"
begun=$(date +%s)
left=470 # seconds the steps below usually take in all; each one subtracts its own
failed=()

# step NAME USUAL LOG COMMAND...: run COMMAND, its output to LOG; say when it overruns.
step() {
  local name=$1 usual=$2 log=$logs/$3.log
  shift 3
  echo "== $name: usually ${usual} s; about $(((left + 59) / 60)) min left in all"
  local start
  start=$(date +%s)
  "$@" >"$log" 2>&1 &
  local pid=$! warned=0 elapsed
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    elapsed=$(($(date +%s) - start))
    if [ "$warned" = 0 ] && [ "$elapsed" -gt $((usual * 2 + 30)) ]; then
      echo "   $name is taking long: ${elapsed} s so far (usually ${usual} s); see $log"
      warned=1
    fi
  done
  wait "$pid"
  report "$name" $? "$log" "$start"
  left=$((left > usual ? left - usual : 0))
}

# report NAME STATUS LOG START: the closing lines on success, everything on failure.
report() {
  local took=$(($(date +%s) - $4))
  if [ "$2" = 0 ]; then
    grep -E '(passed|failed|error|skipped|deselected)([ ,].*)? in [0-9.]+s|Session .* (successful|failed)|^(py-amqp|kombu) |^3\.[0-9]+\.[0-9]+ amqp|Success|All checks|files already formatted|py.typed' "$3" | sed 's/^/   /'
    echo "   $1: ok in ${took} s"
  else
    cat "$3"
    echo "   $1: FAILED (status $2) after ${took} s; log: $3"
    failed+=("$1")
  fi
}

install() {
  python3 -m venv .venv &&
    .venv/bin/python -m pip install -q --upgrade pip &&
    .venv/bin/python -m pip install -q -e '.[test,bench,dramatiq]'
}

checks() {
  .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy &&
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet && # into site/
    bash scripts/check-package.sh # build, twine check --strict, the wheel in a clean venv
}

# The version matrix (Python 3.10 with amqp 5.2.0, kombu 5.3.0, celery 5.3.0; Python 3.13
# with the latest) on the wheel the checks built, both sessions at once; after the newest
# (the shorter: the oldest's Celery tests wait on kombu 5.3's Hub), the peer suites
# (py-amqp's and kombu's integration suites, stock and with the drainer injected), then
# the cluster tests (when the suite is run whole), which mostly wait for RabbitMQ nodes
# of their own to boot, stop and fail over.
beside_the_suite() {
  local wheel status=0
  wheel=$(ls "$PWD"/dist/*.whl)
  matrix_session oldest "$wheel" &
  local oldest=$!
  (
    matrix_session newest "$wheel" || status=1
    bash scripts/peer-suites.sh || status=1
    [ "$cluster_beside" = 0 ] || cluster_tests || status=1
    exit "$status"
  ) &
  local newest=$!
  wait "$oldest" || status=1
  wait "$newest" || status=1
  return "$status"
}

# matrix_session NAME WHEEL: one nox session; its closing lines, or all of it on failure.
matrix_session() {
  local log=$logs/matrix-$1.log
  if DRAINER_WHEEL="$2" .venv/bin/nox --no-color -s "$1" >"$log" 2>&1; then
    grep -E '^3\.[0-9]+\.[0-9]+ amqp|passed|Session' "$log"
  else
    cat "$log"
    return 1
  fi
}

cluster_tests() {
  local log=$logs/cluster.log
  if .venv/bin/python -m pytest -q tests/test_cluster.py >"$log" 2>&1; then
    grep -E 'passed' "$log" | sed 's/^/cluster tests: /'
  else
    cat "$log"
    return 1
  fi
}

step "install (.venv, the project and its test extras)" 40 install install
[ ${#failed[@]} = 0 ] || exit 1
step "ruff, mypy, the docs build, the package check" 15 checks checks

# The suite in the foreground; the matrix, the peer suites and (unless the suite was
# given arguments) the cluster tests beside it.
cluster_beside=$([ $# = 0 ] && echo 1 || echo 0)
skip_cluster=()
[ "$cluster_beside" = 0 ] || skip_cluster=(--ignore=tests/test_cluster.py)
echo "== beside the suite: the version matrix, the peer suites, the cluster tests (log: $logs/beside.log)"
beside_start=$(date +%s)
beside_the_suite >"$logs/beside.log" 2>&1 &
beside=$!
step "the test suite (the rest runs beside it)" 340 suite \
  .venv/bin/python -m pytest -q --durations=25 "${skip_cluster[@]}" "$@"
if kill -0 "$beside" 2>/dev/null; then
  echo "== waiting for the version matrix, the peer suites and the cluster tests"
fi
wait "$beside"
report "the version matrix, the peer suites and the cluster tests" $? "$logs/beside.log" "$beside_start"

# Not here, each checking only what the suite already bounds: F (failover) and J
# (quorum confirms) start a cluster of their own (tests/test_cluster.py runs the failover
# scenario with its bounds); H (cost per publish) checks only that publishers end
# (test_promises: every thread progresses); I (1 ms away) and G (confirmed publishing)
# check that deferred confirms are acked (test_confirms, through the proxy too); C
# (gunicorn) that every request is answered (test_gunicorn); K (consuming) that every
# delivery arrives (test_kombu, test_promises: consumers in both modes); L (a Celery
# worker) that every task runs once (test_celery: both pools, real workers). bash
# scripts/bench.sh runs them all.
step "the benchmarks, quick mode (hard bounds only)" 70 benchmarks \
  env DRAINER_BENCH_QUICK=1 .venv/bin/python -m pytest -q --durations=5 tests/benchmarks \
  -m benchmark -o python_files='test_*.py bench_*.py' \
  --ignore=tests/benchmarks/bench_failover.py --ignore=tests/benchmarks/bench_quorum.py \
  --ignore=tests/benchmarks/bench_cost.py --ignore=tests/benchmarks/bench_rtt.py \
  --ignore=tests/benchmarks/bench_confirms.py --ignore=tests/benchmarks/bench_gunicorn.py \
  --ignore=tests/benchmarks/bench_consume.py --ignore=tests/benchmarks/bench_celery.py

echo "== done in $(($(date +%s) - begun)) s; logs in $logs/"
if [ ${#failed[@]} != 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
