"""System calls per thread of this process, counted in the kernel by ``perf stat``.

``perf stat -e raw_syscalls:sys_enter -p PID --per-thread`` counts every system call's
entry, thread by thread, with no tracing of each call (strace would stop the process at
each one, and change what it measures: a publisher that waits longer writes bigger
batches). It starts with its counters off; :meth:`SyscallCount.start` turns them on and
:meth:`SyscallCount.stop` off, each waiting for perf's acknowledgement, so the count
covers exactly that window. perf counts the threads that exist when it attaches: create
every thread of the window first. Without perf, or without the right to use the
tracepoint (``kernel.perf_event_paranoid``, not root), the counts are None and the
report says so; nothing else depends on it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["SyscallCount"]

#: Seconds perf may take to start, to acknowledge a command, or to write its counts.
PERF_TIMEOUT = 10.0
#: Set once perf failed to count: later windows do not try again (nor wait for it).
_failed = False


class SyscallCount:
    """One window of counting: ``attach()`` once every thread exists, then ``start()``
    and ``stop()`` around the window; ``counts`` maps thread id -> system calls (None:
    not measured). Owned by the thread that runs the benchmark; ``close()`` always."""

    def __init__(self) -> None:
        self.counts: dict[int, int] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="drainer-perf-"))
        self._perf: subprocess.Popen[bytes] | None = None
        self._ctl = self._ack = -1

    def attach(self) -> None:
        perf = shutil.which("perf")
        if perf is None or _failed:
            return
        ctl, ack = self._dir / "ctl", self._dir / "ack"
        os.mkfifo(ctl)
        os.mkfifo(ack)
        # Read-write: opening a FIFO so never blocks, whether or not perf opens it.
        self._ctl = os.open(ctl, os.O_RDWR)
        self._ack = os.open(ack, os.O_RDWR)
        command = [perf, "stat", "-e", "raw_syscalls:sys_enter", "-p", str(os.getpid())]
        command += ["--per-thread", "-x", ",", "-D", "-1", "-o", str(self._dir / "out")]
        command += ["--control", f"fifo:{ctl},{ack}"]
        self._perf = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self._command("enable")

    def stop(self) -> None:
        if not self._command("disable") or self._perf is None:
            return
        self._perf.send_signal(signal.SIGINT)
        try:
            self._perf.wait(PERF_TIMEOUT)
        except subprocess.TimeoutExpired:
            return
        self.counts = {}
        for line in (self._dir / "out").read_text().splitlines():
            fields = line.split(",")
            if len(fields) > 3 and fields[3] == "raw_syscalls:sys_enter" and fields[1].isdigit():
                self.counts[int(fields[0].rpartition("-")[2])] = int(fields[1])

    def close(self) -> None:
        if self._perf is not None and self._perf.poll() is None:
            self._perf.kill()
            self._perf.wait(PERF_TIMEOUT)
        for fd in (self._ctl, self._ack):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _command(self, command: str) -> bool:
        """Send perf ``command``; whether it acknowledged it in time (False: perf is not
        there, or ended: no count, now or in any later window)."""
        global _failed
        if self._perf is None or _failed:
            return False
        os.write(self._ctl, f"{command}\n".encode())
        reply = b""
        deadline = time.monotonic() + PERF_TIMEOUT
        while b"\n" not in reply:
            if self._perf.poll() is not None or time.monotonic() > deadline:
                _failed = True
                return False
            readable, _, _ = select.select([self._ack], [], [], 0.1)  # then look at perf
            if readable:
                reply += os.read(self._ack, 64)
        _failed = reply.strip(b"\x00 \n") != b"ack"  # perf writes "ack\n\0"
        return not _failed
