"""Every Python example in the docs runs against the real broker.

Each fenced ``python`` block of :data:`PAGES`, and each script in ``examples/``, runs in a
subprocess of its own (``sys.executable -c``) with a :data:`TIMEOUT`, so a hanging example
fails instead of hanging the suite. The subprocess runs :data:`DRIVER`, which:

* records every py-amqp connection that connects (its class and mode), without
  importing drainer-amqp, so an example that forgets the import fails as a user's would;
* runs the block (with its doc's line numbers in tracebacks), then uses what it left:
  a ``kombu.Connection`` is connected (kombu connects on first use) and released, a
  dramatiq-kombu broker opens a channel and is closed, and Celery settings
  (``broker_...`` assignments) are loaded into a Celery app that connects;
* closes every ``drainer_amqp`` connection still open, and checks that none is left
  and that no drainer thread is alive.

A script in ``examples/`` is run as ``__main__``; a WSGI ``app`` in it answers
``GET /health`` and ``GET /publish``. Then the process exits normally: the script's own
exit clean-up and the library's exit hook close what it opened, and a check that runs
after them finds nothing left.

A block whose code names a queue (``Queue("name")``) gets a unique name in its place, and
the queue is deleted afterwards. ``<!-- not run: reason -->`` on the line before a fence
skips that block, with the reason in the report.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import amqp
import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The pages whose ``python`` blocks are run.
PAGES = (
    "README.md",
    "docs/quickstart.md",
    "docs/dramatiq.md",
    "docs/migrating.md",
    "docs/reliability.md",
    "docs/confirms.md",
)
EXAMPLES_DIR = "examples"
TIMEOUT = 30.0  # seconds per example
BROKER_HOST = os.environ.get("AMQP_HOST", "127.0.0.1:5672")
REPORT_MARKER = "DOCS-EXAMPLE-REPORT "

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
_QUEUE_NAME = re.compile(r"""Queue\(\s*(?P<quote>["'])(?P<name>[^"']+)(?P=quote)""")
_DRAINER_MODE = re.compile(r"""dedicated_drainer["']?\s*[:=]\s*True""")


@dataclass
class Example:
    """One example: a fenced block of a page, or a script in ``examples/``."""

    path: str  # relative to the repository root
    index: int  # the block's number in its page, from 1 (0 for a script)
    line: int  # the first line of its code in the file
    code: str
    not_run: str | None = None  # the reason given by a <!-- not run: ... --> marker
    queues: dict[str, str] = field(default_factory=dict)  # the doc's name -> unique name

    @property
    def kind(self) -> str:
        return "script" if self.path.startswith(f"{EXAMPLES_DIR}/") else "block"

    @property
    def id(self) -> str:
        return self.path if self.kind == "script" else f"{self.path}:{self.index}"

    @property
    def uses_drainer(self) -> bool:
        return "drainer" in self.code

    @property
    def expects_drainer_mode(self) -> bool:
        # Scripts run with DRAINER_MODE=drainer (see run_example).
        return self.kind == "script" or bool(_DRAINER_MODE.search(self.code))

    @property
    def settings_only(self) -> bool:
        """Only assignments (and imports): a settings block, such as Celery's."""
        tree = ast.parse(self.code)
        allowed = (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)
        return bool(tree.body) and all(isinstance(node, allowed) for node in tree.body)

    @property
    def celery_settings(self) -> bool:
        return self.settings_only and bool(re.search(r"^broker_\w+\s*=", self.code, re.M))


def blocks_of(path: str) -> list[Example]:
    """The fenced ``python`` blocks of a page, dedented (a block may sit in a list)."""
    text = (ROOT / path).read_text(encoding="utf-8")
    lines = text.splitlines()
    examples = []
    for index, match in enumerate(_FENCE.finditer(text), start=1):
        fence_line = text.count("\n", 0, match.start())  # 0-based line of the fence
        before = lines[fence_line - 1] if fence_line > 0 else ""
        marker = _NOT_RUN.match(before)
        examples.append(
            Example(
                path=path,
                index=index,
                line=fence_line + 2,
                code=textwrap.dedent(match["body"]),
                not_run=marker["reason"] if marker else None,
            )
        )
    return examples


def all_examples() -> list[Example]:
    examples = [block for page in PAGES for block in blocks_of(page)]
    for script in sorted((ROOT / EXAMPLES_DIR).glob("*.py")):
        path = script.relative_to(ROOT).as_posix()
        examples.append(Example(path, 0, 1, script.read_text(encoding="utf-8")))
    return examples


def with_unique_queues(example: Example) -> str:
    """The example's code with each queue it names renamed to a unique name (recorded in
    ``example.queues``, to be deleted)."""
    code = example.code
    for match in _QUEUE_NAME.finditer(example.code):
        name = match["name"]
        unique = example.queues.setdefault(name, f"{name}-docs-{uuid.uuid4().hex[:10]}")
        code = code.replace(f'"{name}"', f'"{unique}"').replace(f"'{name}'", f"'{unique}'")
    return code


def delete_queues(names: list[str]) -> None:
    """Delete ``names`` on the broker (a queue that is not there is fine)."""
    if not names:
        return
    with amqp.Connection(host=BROKER_HOST) as conn:
        for name in names:
            channel = conn.channel()
            try:
                channel.queue_delete(name)
                channel.close()
            except amqp.exceptions.NotFound:
                pass  # the broker closed the channel


#: Runs one example in the subprocess; argv[1] is a JSON object (see run_example).
DRIVER = r'''
import atexit, json, os, sys, threading, time

spec = json.loads(sys.argv[1])
report = {"connections": [], "checked": []}


def _left_open():
    module = sys.modules.get("drainer_amqp.connection")
    return [] if module is None else [repr(c) for c in list(module._connections)]


def _drainer_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("drainer-amqp-")]


def _check_nothing_left(when):
    deadline = time.monotonic() + 5
    while (_left_open() or _drainer_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _left_open() or _drainer_threads():
        raise AssertionError(
            f"{when}: connections open: {_left_open()}; drainer threads: {_drainer_threads()}"
        )


def _final_check():
    try:
        _check_nothing_left("at exit")
    except AssertionError as exc:
        print(exc, file=sys.stderr, flush=True)
        os._exit(3)
    print(spec["marker"] + json.dumps(report), flush=True)


atexit.register(_final_check)  # registered first, so it runs after every other exit hook

import amqp  # not drainer_amqp: importing it would register its URL schemes

_connect = amqp.Connection.connect


def _recording_connect(self, *args, **kwargs):
    kind = type(self)
    report["connections"].append(
        {
            "class": f"{kind.__module__}.{kind.__qualname__}",
            "dedicated_drainer": getattr(self, "dedicated_drainer", None),
        }
    )
    return _connect(self, *args, **kwargs)


amqp.Connection.connect = _recording_connect


def _use_and_close(namespace):
    """Use what the block left (kombu connects on first use), then close it all."""
    import kombu

    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, kombu.Connection):
            value.ensure_connection(max_retries=1)
            report["checked"].append(f"{name}: kombu connected")
            value.release()
        elif hasattr(value, "connection_holder") and callable(getattr(value, "close", None)):
            with value.connection_holder.acquire_consumer_channel():  # a dramatiq broker
                report["checked"].append(f"{name}: broker opened a channel")
            value.close()
    if spec["celery_settings"]:
        from celery import Celery

        app = Celery("docs_example", set_as_current=False)
        app.conf.update({k: v for k, v in namespace.items() if k.startswith("broker_")})
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            report["checked"].append("Celery app connected")
        app.close()
    module = sys.modules.get("drainer_amqp.connection")
    if module is not None:
        for conn in list(module._connections):  # what the example left open
            conn.close()


if spec["kind"] == "script":
    import runpy

    namespace = runpy.run_path(spec["path"], run_name="__main__")
    app = namespace.get("app")
    if callable(app):  # a WSGI app
        for path in ("/health", "/publish"):
            status = []
            environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
            body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
            if not status or not status[0].startswith("200"):
                raise AssertionError(f"GET {path}: {status} {body!r}")
            report["checked"].append(f"GET {path}: {status[0]}")
    # The process exits now: the script's own exit clean-up and the library's exit hook
    # close what it opened, then _final_check looks.
else:
    namespace = {"__name__": "__main__"}
    code = "\n" * (spec["line"] - 1) + spec["code"]  # tracebacks give the doc's lines
    exec(compile(code, spec["path"], "exec"), namespace)
    _use_and_close(namespace)
    _check_nothing_left("after the clean-up")
'''


def run_example(example: Example) -> dict[str, Any]:
    """Run ``example`` in a subprocess; return its report, or fail the test."""
    spec = {
        "kind": example.kind,
        "path": example.path,
        "line": example.line,
        "code": with_unique_queues(example),
        "celery_settings": example.celery_settings,
        "marker": REPORT_MARKER,
    }
    env = dict(os.environ)
    if example.kind == "script":
        queue = f"{Path(example.path).stem}-docs-{uuid.uuid4().hex[:10]}"
        example.queues[queue] = queue
        env.update(DRAINER_MODE="drainer", APP_QUEUE=queue)
    try:
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{example.id} (line {example.line}) did not finish in {TIMEOUT:g} s\n"
            f"stdout:\n{_text(exc.stdout)}\nstderr:\n{_text(exc.stderr)}"
        )
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, (
        f"{example.id} (line {example.line}) failed ({done.returncode})\n{output}"
    )
    reports = [
        line[len(REPORT_MARKER) :]
        for line in done.stdout.splitlines()
        if line.startswith(REPORT_MARKER)
    ]
    assert reports, f"{example.id}: no report\n{output}"
    report: dict[str, Any] = json.loads(reports[-1])
    return report


def _text(output: str | bytes | None) -> str:
    """What a timed-out subprocess had written (bytes or nothing, whatever ``text=``)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


EXAMPLES = all_examples()


def missing_requirement(example: Example) -> str | None:
    """Why ``example`` cannot run in this environment (an extra not installed), if so."""
    needs = {"dramatiq_kombu_broker": "dramatiq"}
    if example.celery_settings:
        needs["celery"] = "test"
    for module, extra in needs.items():
        if module in example.code and importlib.util.find_spec(module) is None:
            return f"{module} is not installed (the {extra!r} extra)"
    return None


def test_every_page_has_examples() -> None:
    """The extraction still finds the blocks (a broken pattern would run nothing)."""
    for page in PAGES:
        assert blocks_of(page), f"no python block found in {page}"
    assert any(e.kind == "script" for e in EXAMPLES), "no script found in examples/"


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example_runs(example: Example) -> None:
    if example.not_run is not None:
        pytest.skip(f"not run: {example.not_run}")
    missing = missing_requirement(example)
    if missing is not None:
        pytest.skip(missing)
    try:
        report = run_example(example)
    finally:
        delete_queues(list(example.queues.values()))
        example.queues.clear()
    opened = report["connections"]
    drainer = [c for c in opened if str(c["class"]).startswith("drainer_amqp.")]
    if example.uses_drainer:
        assert drainer, f"{example.id}: no drainer_amqp connection was opened: {report}"
    if example.expects_drainer_mode:
        assert any(c["dedicated_drainer"] for c in drainer), (
            f"{example.id}: no connection in drainer mode: {report}"
        )
