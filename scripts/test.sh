#!/usr/bin/env bash
# Create the environment and run the tests (the README's second command; CI runs it):
# lint and types, the docs build, the package check, the test suite, then the benchmarks
# in quick mode, so that their hard bounds and deadlock checks hold on every change, the
# peer suites, and last the version matrix (noxfile.py: the behaviour tests on the oldest
# and the newest releases declared). Extra arguments go to the test run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench,dramatiq]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet   # the docs site, into site/
bash scripts/check-package.sh   # build, twine check --strict, the wheel in a clean venv
.venv/bin/python -m pytest -q "$@"
DRAINER_BENCH_QUICK=1 .venv/bin/python -m pytest -q tests/benchmarks -m benchmark \
    -o python_files='test_*.py bench_*.py'
# py-amqp's and kombu's own integration suites, stock and with the drainer injected.
bash scripts/peer-suites.sh
# The version matrix: Python 3.10 with amqp 5.2.0, kombu 5.3.0, celery 5.3.0, and Python
# 3.13 with the latest, on the wheel checked above. Both sessions at once: they mostly wait
# on the broker. Each one's log is in .nox/SESSION.log.
mkdir -p .nox
start=$(date +%s)
wheel=$(ls "$PWD"/dist/*.whl)
DRAINER_WHEEL="$wheel" .venv/bin/nox --no-color -s oldest >.nox/oldest.log 2>&1 &
oldest=$!
DRAINER_WHEEL="$wheel" .venv/bin/nox --no-color -s newest >.nox/newest.log 2>&1 &
newest=$!
status=0
for session in oldest newest; do
  if wait "${!session}"; then
    grep -E '^3\.[0-9]+\.[0-9]+ amqp|passed|Session' ".nox/$session.log" || true
  else
    status=1
    cat ".nox/$session.log"
  fi
done
echo "version matrix done in $(( $(date +%s) - start )) s"
exit "$status"
