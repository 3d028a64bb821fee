"""The version matrix: the behaviour tests against the oldest releases drainer-amqp
declares (Python 3.10, amqp 5.2.0, kombu 5.3.0, celery 5.3.0) and the newest (Python
3.13, the latest releases). ``nox`` runs both; scripts/test.sh runs it. The soak, the
cluster test, the benchmarks and the peer suites are run elsewhere (docs/versions.md).

Interpreters come from pyenv when they are not on PATH already.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["oldest", "newest"]
nox.options.error_on_missing_interpreters = True

PYTHONS = {"oldest": "3.10", "newest": "3.13"}
OLDEST = ["amqp==5.2.0", "kombu==5.3.0", "celery==5.3.0"]
NOT_BEHAVIOUR = ["tests/test_soak.py", "tests/test_cluster.py", "tests/benchmarks", "tests/peer"]


def _pyenv_on_path() -> None:
    """Put each pyenv-installed interpreter the matrix needs on PATH (newest patch)."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    for version in PYTHONS.values():
        found = sorted(root.glob(f"{version}.*/bin/python{version}"))
        if found:
            os.environ["PATH"] = f"{found[-1].parent}{os.pathsep}{os.environ['PATH']}"


_pyenv_on_path()


def _behaviour_tests(
    session: nox.Session, extras: str, *pins: str, ignore: tuple[str, ...] = ()
) -> None:
    # DRAINER_WHEEL: a wheel built already (scripts/test.sh passes the one it checked).
    session.install(f"{os.environ.get('DRAINER_WHEEL') or '.'}[{extras}]", *pins)
    versions = (
        "import sys, amqp, kombu, celery; print(sys.version.split()[0], "
        "*(f'{m.__name__} {m.__version__}' for m in (amqp, kombu, celery)))"
    )
    session.run("python", "-c", versions)
    ignores = [f"--ignore={path}" for path in (*NOT_BEHAVIOUR, *ignore)]
    session.run("python", "-m", "pytest", "-q", *ignores, *session.posargs)


@nox.session(python=PYTHONS["oldest"])
def oldest(session: nox.Session) -> None:
    """The oldest declared releases, on the oldest supported Python (without the dramatiq
    test: dramatiq-kombu-broker needs kombu >= 5.6.1)."""
    _behaviour_tests(session, "test", *OLDEST, ignore=("tests/test_dramatiq.py",))


@nox.session(python=PYTHONS["newest"])
def newest(session: nox.Session) -> None:
    """The newest releases, on the newest supported Python."""
    _behaviour_tests(session, "test,dramatiq", "--upgrade", "amqp", "kombu", "celery")
