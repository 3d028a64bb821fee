#!/usr/bin/env bash
# py-amqp's and kombu's own integration suites, stock and then with every connection a
# drainer_amqp.Connection(dedicated_drainer=True) (tests/peer/drainer_plugin.py), against
# the local broker. Every test that passes on stock must pass with the drainer, and the
# drainer runs must really use drainer threads. Run by scripts/test.sh; needs .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
work=$PWD/.peer-suites
mkdir -p "$work"
amqp_version=$($py -c 'import amqp; print(amqp.__version__)')
kombu_version=$($py -c 'import kombu; print(kombu.__version__)')
for pkg in "amqp==$amqp_version" "kombu==$kombu_version"; do
  dir="$work/${pkg/==/-}"
  if [ ! -d "$dir/t/integration" ]; then
    $py -m pip download -q --no-deps --no-binary :all: -d "$work" "$pkg"
    tar -xzf "$work/${pkg/==/-}.tar.gz" -C "$work"
  fi
done

queues() { rabbitmqctl -q list_queues name 2>/dev/null | sort; }
# The suites leave queues of fixed names behind (some tests never ack); delete those a
# run created, so the next run starts from the same broker state. Only names written in
# the suite's own source: the project's test suite runs beside this one on the same
# broker, and its queues (server-named ones too) are in use.
cleanup() {  # source dir
  { comm -13 "$work/queues.before" <(queues) || true; } | while read -r q; do
    if [ -n "$q" ] && grep -rqF -- "$q" "$1/t"; then
      rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true
    fi
  done
}

status=0
run_suite() {  # name, source dir, test path, extra pytest args...
  local name=$1 dir=$2 path=$3
  shift 3
  for mode in stock drainer; do
    # kombu's test_publish_requeue_consume never acks its messages and counts on an empty
    # queue of this fixed name (upstream marks it flaky): start it from one.
    rabbitmqctl -q delete_queue priority_requeue_test >/dev/null 2>&1 || true
    queues >"$work/queues.before"
    (cd "$dir" && DRAINER_PEER=$([ $mode = drainer ] && echo 1 || echo 0) \
      DRAINER_PEER_REPORT="$work/$name-report.json" PYTHONPATH="$OLDPWD/tests/peer" \
      RABBITMQ_HOST=127.0.0.1 RABBITMQ_5672_TCP=5672 \
      timeout 600 "$py" -m pytest -q -p no:cacheprovider -p drainer_plugin -o addopts= \
        --junitxml="$work/$name-$mode.xml" "$path" "$@" >"$work/$name-$mode.log" 2>&1) || true
    tail -n 1 "$work/$name-$mode.log"
    cleanup "$dir"
  done
  "$py" tests/peer/compare.py "$name" "$work/$name-stock.xml" "$work/$name-drainer.xml" \
    "$work/$name-report.json" || status=1
}

# py-amqp: the plain cases of test_rmq.py; its TLS cases need a TLS listener on 5671 and
# badssl.com, neither of which this machine has.
run_suite py-amqp "$work/amqp-$amqp_version" t/integration/test_rmq.py -k "not tls"
run_suite kombu "$work/kombu-$kombu_version" t/integration/test_py_amqp.py
exit $status
