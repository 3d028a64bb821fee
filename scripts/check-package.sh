#!/usr/bin/env bash
# Build the sdist and the wheel, check their metadata as PyPI would (twine check
# --strict), install the wheel into a clean temporary venv and import it there, and check
# that the wheel carries py.typed. Lists README links that would not resolve on PyPI
# (its long description is README.md). Run by scripts/test.sh; needs .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf dist
"$py" -m build --outdir dist . >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$py" -m twine check --strict dist/*
wheel=$(ls dist/*.whl)
"$py" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "drainer_amqp/py.typed" in names, "py.typed is not in the wheel"
assert "drainer_amqp/compat.py" in names, "compat.py is not in the wheel"
print(f"{sys.argv[1]}: {len(names)} files, py.typed included")
PY
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
(cd "$tmp" && "$tmp/venv/bin/python" -c '
import amqp, kombu, drainer_amqp
from drainer_amqp import Connection, Transport
print("imported drainer_amqp", drainer_amqp.__version__, "from", drainer_amqp.__file__,
      "with amqp", amqp.__version__, "kombu", kombu.__version__)')
# Relative links and images in README.md render on PyPI as broken links.
relative=$(grep -noE '\]\([^)#:]+\)' README.md || true)
if [ -n "$relative" ]; then
  echo "README.md: $(wc -l <<<"$relative") relative links will not resolve on PyPI:"
  echo "$relative" | sed 's/^/  /'
fi
