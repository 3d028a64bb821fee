"""The version matrix: the tests of what depends on py-amqp's, kombu's and Celery's
versions, against the oldest releases drainer-amqp declares (Python 3.10, amqp 5.2.0,
kombu 5.3.0, celery 5.3.0) and the newest (Python 3.13, the latest releases). ``nox``
runs both; scripts/test.sh runs them beside the test suite.

Only the files in ``VERSIONED`` run here: they use py-amqp's, kombu's and Celery's
internals (the compat check, py-amqp's channel and transport internals, the encoder's
byte-for-byte match with py-amqp's frame writer, legacy reads through py-amqp's transport)
or integrate with them (kombu, Celery, dramatiq, TLS through kombu, reconnects); and the
quick tests of the machinery that leans on the interpreter itself (the writer, the inbox,
the send that keeps the interpreter lock, framing, locks, borrowed reads: a few seconds),
whose tests force interleavings through hooks that Python versions honour differently
(3.10 tests a deque subclass's truth without its ``__len__``). The rest (bounds, faults
through the proxy, promises at exit, the soak, the cluster) run once, in the main test
suite, on the versions the project installs.

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
VERSIONED = [
    "tests/test_compat.py",
    "tests/test_encoding.py",
    "tests/test_stock_semantics.py",
    "tests/test_bad_input.py",
    "tests/test_races.py",
    "tests/test_channel_close.py",
    "tests/test_connection.py",
    "tests/test_kombu.py",
    "tests/test_reconnect.py",
    "tests/test_tls.py",
    "tests/test_celery.py",
    "tests/test_event_loop.py",
    "tests/test_dramatiq.py",
    "tests/test_writer.py",
    "tests/test_inbox.py",
    "tests/test_sending.py",
    "tests/test_framing.py",
    "tests/test_locks.py",
    "tests/test_borrowed_reads.py",
]


def _pyenv_on_path() -> None:
    """Put each pyenv-installed interpreter the matrix needs on PATH (newest patch)."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    for version in PYTHONS.values():
        found = sorted(root.glob(f"{version}.*/bin/python{version}"))
        if found:
            os.environ["PATH"] = f"{found[-1].parent}{os.pathsep}{os.environ['PATH']}"


_pyenv_on_path()


def _versioned_tests(
    session: nox.Session, extras: str, *pins: str, ignore: tuple[str, ...] = ()
) -> None:
    # DRAINER_WHEEL: a wheel built already (scripts/test.sh passes the one it checked).
    session.install(f"{os.environ.get('DRAINER_WHEEL') or '.'}[{extras}]", *pins)
    versions = (
        "import sys, amqp, kombu, celery; print(sys.version.split()[0], "
        "*(f'{m.__name__} {m.__version__}' for m in (amqp, kombu, celery)))"
    )
    session.run("python", "-c", versions)
    files = [path for path in VERSIONED if path not in ignore]
    session.run("python", "-m", "pytest", "-q", *files, *session.posargs)


@nox.session(python=PYTHONS["oldest"])
def oldest(session: nox.Session) -> None:
    """The oldest declared releases, on the oldest supported Python (without the dramatiq
    test: dramatiq-kombu-broker needs kombu >= 5.6.1)."""
    _versioned_tests(session, "test", *OLDEST, ignore=("tests/test_dramatiq.py",))


@nox.session(python=PYTHONS["newest"])
def newest(session: nox.Session) -> None:
    """The newest releases, on the newest supported Python."""
    _versioned_tests(session, "test,dramatiq", "--upgrade", "amqp", "kombu", "celery")
