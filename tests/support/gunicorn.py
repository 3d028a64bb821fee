"""A gunicorn server running the example app (examples/gunicorn_app.py), for the tests
and the benchmarks: start, requests, health of each worker, bounded stop."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from support.broker import BROKER_HOST, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
APP = "examples.gunicorn_app:app"
REQUEST_TIMEOUT = 10.0  # seconds: a request not answered by then counts as a hang
START_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0  # gunicorn runs with --graceful-timeout 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _has_control_socket_flag() -> bool:
    """gunicorn >= 25 opens a control socket at a fixed path unless told not to."""
    out = subprocess.run(
        [sys.executable, "-m", "gunicorn", "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    return "--no-control-socket" in out


class Gunicorn:
    """A gunicorn master running the example app, started and stopped by the test.

    It runs in a session of its own, so a test that fails can end the master and its
    workers together (by that process group's id). ``confirms=False`` runs the app
    without publisher confirms (``APP_CONFIRMS=0``)."""

    _control_flag: bool | None = None

    def __init__(
        self,
        mode: str,
        queue: str,
        *,
        workers: int = 2,
        threads: int = 8,
        preload_connect: bool = True,
        confirms: bool = True,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        if Gunicorn._control_flag is None:
            Gunicorn._control_flag = _has_control_socket_flag()
        self.port = free_port()
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [
            sys.executable, "-m", "gunicorn",
            "-k", "gthread", "--threads", str(threads), "-w", str(workers),
            "--preload", "--graceful-timeout", "10",
            "-b", f"127.0.0.1:{self.port}",
        ]  # fmt: skip
        if Gunicorn._control_flag:
            cmd.append("--no-control-socket")
        cmd.append(APP)
        self.command = cmd
        env = dict(
            os.environ,
            DRAINER_MODE=mode,
            AMQP_URL=f"amqp://guest:guest@{BROKER_HOST}//",
            APP_QUEUE=queue,
            PRELOAD_CONNECT="1" if preload_connect else "0",
            APP_CONFIRMS="1" if confirms else "0",
            PYTHONUNBUFFERED="1",
            **(extra_env or {}),
        )
        self.process = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def get(self, path: str, timeout: float = REQUEST_TIMEOUT) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def wait_ready(self) -> None:
        def answers() -> bool:
            assert self.process.poll() is None, f"gunicorn exited early:\n{self.output()}"
            try:
                return self.get("/health", timeout=5)[0] == 200
            except OSError:
                return False

        assert wait_until(answers, START_TIMEOUT, interval=0.1), self.output()

    def stop(self) -> float:
        """SIGTERM to the master; return how long it took to exit."""
        start = time.perf_counter()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(STOP_TIMEOUT)
        return time.perf_counter() - start

    def kill(self) -> None:
        """Last resort for a test that failed: end the master and its workers."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.kill()
        self.log.close()


def health_by_pid(server: Gunicorn, workers: int) -> dict[int, dict[str, Any]]:
    """``/health`` of every worker (requests land on any worker: ask until each answered)."""
    seen: dict[int, dict[str, Any]] = {}

    def ask() -> bool:
        status, body = server.get("/health")
        assert status == 200, body
        info = json.loads(body)
        seen[info["pid"]] = info
        return len(seen) == workers

    assert wait_until(ask, START_TIMEOUT, interval=0), f"workers that answered: {sorted(seen)}"
    return seen
