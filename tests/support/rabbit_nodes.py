"""Extra RabbitMQ nodes for tests: single nodes and a three-node cluster.

Each :class:`RabbitNode` is its own Erlang node (``drainer-test-<pid>-<n>@localhost``)
with its own AMQP and distribution ports (picked free), its own mnesia, log and config
files in a temporary directory, its own Erlang cookie (a private ``HOME``) and no
plugins. The default node on 5672 is never touched: every ``rabbitmqctl`` call names
its node with ``-n``, and no configuration under ``/etc/rabbitmq`` is read.

Cleanup: nodes stop and their directories are removed by fixture teardown, and also by an
``atexit`` hook (a failing test, Ctrl-C, or SIGTERM of the test process). Nodes left by a
test process that died without cleanup (SIGKILL) are killed by the next one that starts
a node.

Threading: a node object is driven by one thread at a time (the test's); the commands
block until RabbitMQ has done what they ask, each with a timeout.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

import psutil
import pytest

__all__ = [
    "RabbitCluster",
    "RabbitNode",
    "RabbitNodeError",
    "own_broker",
    "rabbit_cluster",
]

RABBIT_BIN = Path(os.environ.get("RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
HOST = "localhost"  # the name part after "@"; the default node also uses it
BOOT_TIMEOUT = 90.0  # seconds: a node boots in 6-9 s on an idle machine; two cores are shared
CTL_TIMEOUT = 60.0  # seconds for one rabbitmqctl command
_OWNER_ENV = "DRAINER_TEST_OWNER_PID"  # marks node processes with the test process's pid
_TMP_PREFIX = "drainer-rabbit-"

_counter = itertools.count(1)
_registry_lock = threading.Lock()
_live: set[RabbitNode] = set()  # nodes whose process may be running or dirs still exist
_hooks_installed = False


class RabbitNodeError(RuntimeError):
    """A node did not start, or a ``rabbitmqctl`` command failed."""


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(taken: set[int]) -> int:
    """A free loopback port in 20000-29999.

    Not an ephemeral one: RabbitMQ's CLI derives its own port range from the
    distribution port (+10000), which must stay below 65536, and the kernel hands out
    ephemeral ports to client sockets, which could take a stopped node's port."""
    for _ in range(1000):
        port = random.randrange(20000, 30000)
        if port not in taken and _port_is_free(port):
            taken.add(port)
            return port
    raise RabbitNodeError("no free port in 20000-29999")


class RabbitNode:
    """One RabbitMQ node run as a child process group of the test process.

    ``start()`` boots it and waits until it accepts AMQP; ``stop_app()`` /
    ``start_app()`` stop and restart the RabbitMQ application in a running Erlang VM
    (``rabbitmqctl stop_app``); ``kill()`` SIGKILLs the whole Erlang process group
    (a crash: no goodbye to clients or peers); ``stop()`` shuts the node down cleanly;
    ``cleanup()`` stops it (killing if needed) and removes its directories.
    """

    def __init__(
        self,
        *,
        nofile: int | None = None,
        cookie: str | None = None,
        base_dir: Path | None = None,
        extra_config: Sequence[str] = (),
    ) -> None:
        self.index = next(_counter)
        self.short_name = f"drainer-test-{os.getpid()}-{self.index}"
        self.name = f"{self.short_name}@{HOST}"
        taken: set[int] = set()
        self.port = free_port(taken)
        self.dist_port = free_port(taken)
        self.nofile = nofile
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-"))
        self.dir = self.base_dir / self.short_name
        self.home = self.base_dir / "home"  # shared by a cluster's nodes: one cookie
        self.mnesia_dir = self.dir / "mnesia"
        self.log_dir = self.dir / "log"
        self.config_file = self.dir / "rabbitmq.conf"
        self.pid_file = self.dir / "node.pid"
        self._process: subprocess.Popen[bytes] | None = None
        for path in (self.home, self.mnesia_dir, self.log_dir):
            path.mkdir(parents=True, exist_ok=True)
        cookie_file = self.home / ".erlang.cookie"
        if not cookie_file.exists():
            cookie_file.write_text(cookie or f"DRAINERTEST{random.getrandbits(64):016X}")
            cookie_file.chmod(0o400)
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")
        (self.dir / "advanced.config").write_text("[].\n")
        self.config_file.write_text(
            "\n".join(
                [
                    f"listeners.tcp.1 = 127.0.0.1:{self.port}",
                    "loopback_users.guest = true",
                    "log.console = false",
                    "log.file.level = info",
                    *extra_config,
                ]
            )
            + "\n"
        )
        with _registry_lock:
            _live.add(self)
        _install_hooks()

    def __repr__(self) -> str:
        return f"RabbitNode({self.name}, port={self.port})"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def env(self) -> dict[str, str]:
        """The environment of this node's server and of ``rabbitmqctl`` calls to it."""
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_"))
        }
        env.update(
            {
                "HOME": str(self.home),
                "RABBITMQ_NODENAME": self.name,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_CONFIG_FILE": str(self.config_file),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
                "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(self.mnesia_dir),
                "RABBITMQ_MNESIA_DIR": str(self.mnesia_dir / self.name),
                "RABBITMQ_LOG_BASE": str(self.log_dir),
                "RABBITMQ_PID_FILE": str(self.pid_file),
                "ERL_EPMD_ADDRESS": "127.0.0.1",
                "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
                _OWNER_ENV: str(os.getpid()),
            }
        )
        return env

    # -- process control -------------------------------------------------------------

    @property
    def running(self) -> bool:
        """The Erlang VM is running (the RabbitMQ app may be stopped)."""
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = BOOT_TIMEOUT) -> None:
        """Boot the node and wait until it accepts AMQP connections."""
        self.launch()
        self.await_boot(timeout)

    def launch(self) -> None:
        """Start the Erlang VM without waiting for it (see :meth:`await_boot`)."""
        if self.running:
            return
        _kill_orphans()
        self.pid_file.unlink(missing_ok=True)
        server = str(RABBIT_BIN / "rabbitmq-server")
        command = [server]
        if self.nofile is not None:
            command = ["sh", "-c", f'ulimit -n {int(self.nofile)} && exec "$0"', server]
        output = open(self.log_dir / "server.out", "ab")  # noqa: SIM115 - kept with the process
        self._process = subprocess.Popen(
            command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill() takes the whole VM
        )
        output.close()

    def await_boot(self, timeout: float = BOOT_TIMEOUT) -> None:
        """Wait until the launched node runs RabbitMQ and listens on its AMQP port."""
        deadline = time.monotonic() + timeout
        while not self.pid_file.exists():
            if not self.running:
                raise RabbitNodeError(f"{self.name} exited at boot; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise RabbitNodeError(f"{self.name}: no pid file after {timeout:g}s")
            time.sleep(0.1)  # another process: no event to wait on
        left = max(1.0, deadline - time.monotonic())
        self.ctl("wait", str(self.pid_file), "--timeout", str(int(left)), timeout=left + 15)
        self.await_port(max(1.0, deadline - time.monotonic()))

    def await_port(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RabbitNodeError(f"{self.name}: port {self.port} not open") from None
                time.sleep(0.1)

    def stop_app(self) -> None:
        """``rabbitmqctl stop_app``: RabbitMQ closes its clients' connections; the VM stays."""
        self.ctl("stop_app")

    def start_app(self) -> None:
        """``rabbitmqctl start_app`` after :meth:`stop_app`; returns when it listens."""
        self.ctl("start_app")
        self.await_port(BOOT_TIMEOUT)

    def kill(self) -> None:
        """SIGKILL the node's whole process group: sockets drop without a close frame."""
        process = self._process
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(30)
        self._process = None

    def stop(self, timeout: float = CTL_TIMEOUT) -> None:
        """Shut the node down cleanly (``rabbitmqctl stop``); kill it if that fails."""
        process = self._process
        if process is None or process.poll() is not None:
            self._process = None
            return
        try:
            self.ctl("stop", timeout=timeout)
            process.wait(timeout)
        except (RabbitNodeError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def restart(self) -> None:
        """Bring a stopped app or killed/stopped node back (it rejoins its cluster)."""
        if self.running:
            if not self.app_running():
                self.start_app()
        else:
            self.start()

    def cleanup(self) -> None:
        """Stop the node (kill if needed) and remove its directories."""
        try:
            self.kill()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            if self._own_base:
                shutil.rmtree(self.base_dir, ignore_errors=True)
            with _registry_lock:
                _live.discard(self)

    # -- rabbitmqctl -----------------------------------------------------------------

    def ctl(self, *args: str, timeout: float = CTL_TIMEOUT, check: bool = True) -> str:
        """Run ``rabbitmqctl -n NODE ARGS``; return its stdout."""
        try:
            result = subprocess.run(
                [str(RABBIT_BIN / "rabbitmqctl"), "-q", "-n", self.name, *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise RabbitNodeError(f"rabbitmqctl {' '.join(args)} on {self.name}: timeout") from exc
        if check and result.returncode != 0:
            raise RabbitNodeError(
                f"rabbitmqctl {' '.join(args)} on {self.name} failed "
                f"({result.returncode}): {result.stdout.strip()} {result.stderr.strip()}"
            )
        return result.stdout

    def app_running(self) -> bool:
        if not self.running:
            return False
        out = self.ctl("eval", "rabbit:is_running().", check=False, timeout=30)
        return out.strip() == "true"

    def set_vm_memory_high_watermark(self, fraction: float) -> None:
        """``rabbitmqctl set_vm_memory_high_watermark``: a low value raises the memory
        alarm, which blocks publishing connections (``connection.blocked``)."""
        self.ctl("set_vm_memory_high_watermark", repr(float(fraction)))

    def connection_ports(self) -> list[int]:
        """Client (peer) ports of this node's AMQP connections."""
        out = self.ctl("list_connections", "peer_port")
        return [int(line) for line in out.split() if line.strip().isdigit()]


class RabbitCluster:
    """Three :class:`RabbitNode`\\ s joined with ``rabbitmqctl join_cluster``.

    They share one base directory and so one Erlang cookie. ``urls`` lists each node's
    AMQP URL in order; ``node_on_port(port)`` finds the node a client talks to.
    """

    def __init__(self, size: int = 3, **node_kwargs: object) -> None:
        first = RabbitNode(**node_kwargs)  # type: ignore[arg-type]
        self.base_dir = first.base_dir
        self.nodes = [first] + [
            RabbitNode(base_dir=self.base_dir, **node_kwargs)  # type: ignore[arg-type]
            for _ in range(size - 1)
        ]

    def start(self) -> None:
        """Boot every node (in parallel) and join the others to the first one."""
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.await_boot()
            seed = self.nodes[0]
            for node in self.nodes[1:]:
                node.ctl("stop_app")
                node.ctl("reset")
                node.ctl("join_cluster", seed.name)
                node.start_app()
            members = seed.ctl("eval", "rabbit_nodes:all_running().")
            for node in self.nodes:
                if node.name not in members:
                    raise RabbitNodeError(f"{node.name} is not running in {members}")
        except BaseException:
            self.cleanup()
            raise

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def failover_url(self, scheme: str = "amqp") -> str:
        """kombu's failover form: ``scheme://...P1//;scheme://...P2//;...``."""
        return ";".join(f"{scheme}://guest:guest@127.0.0.1:{node.port}//" for node in self.nodes)

    def node_on_port(self, port: int) -> RabbitNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise LookupError(f"no node of this cluster listens on {port}")

    def stop_node(self, node: RabbitNode) -> None:
        node.stop_app()

    def kill_node(self, node: RabbitNode) -> None:
        node.kill()

    def ensure_running(self) -> None:
        """Restart any node a previous case stopped or killed, and wait until the
        cluster has all its members running again."""
        for node in self.nodes:
            node.restart()
        seed = next(node for node in self.nodes if node.running)
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:
            members = seed.ctl("eval", "rabbit_nodes:all_running().")
            if all(node.name in members for node in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RabbitNodeError(f"cluster members not all running: {members}")
            time.sleep(0.5)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        shutil.rmtree(self.base_dir, ignore_errors=True)


# -- cleanup on exit --------------------------------------------------------------------


def cleanup_all() -> None:
    """Kill every node this process started and remove its directories."""
    with _registry_lock:
        nodes = list(_live)
    for node in nodes:
        node.cleanup()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds fixtures, then atexit runs cleanup_all


def _install_hooks() -> None:
    global _hooks_installed
    with _registry_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(cleanup_all)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _kill_orphans() -> None:
    """Kill node process groups whose test process is gone (it was SIGKILLed), and remove
    their directories."""
    for process in psutil.process_iter(["name"]):
        if process.info["name"] not in ("beam.smp", "rabbitmq-server", "sh"):
            continue
        try:
            env = process.environ()
            owner = env.get(_OWNER_ENV)
            if owner is None or psutil.pid_exists(int(owner)):
                continue
            os.killpg(os.getpgid(process.pid), signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError, ValueError):
            continue
        base = Path(env.get("HOME", "")).parent  # HOME is <base>/home
        if base.name.startswith(f"{_TMP_PREFIX}{owner}-"):
            shutil.rmtree(base, ignore_errors=True)


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rabbit_cluster() -> Iterator[RabbitCluster]:
    """A three-node cluster for the module; stopped and removed at its end.

    Cases that stop or kill a node should call ``ensure_running()`` first (or use an
    autouse fixture that does), so each one starts with three running members."""
    cluster = RabbitCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture(scope="module")
def own_broker() -> Iterator[RabbitNode]:
    """One extra single node for the module (settings may be changed on it, e.g. the
    memory watermark; restore them anyway, the module's other tests share it)."""
    node = RabbitNode()
    try:
        node.start()
        yield node
    finally:
        node.cleanup()
