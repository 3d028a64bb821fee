"""The soak's command line; writes ``bench-results/soak.json``.

``python -m soak --seconds N --runs A/drainer,A/legacy,A/stock,B/drainer [--seed S]
[--own-node] [--faults reset_peer,close_connection,...] [--rate R] [--out PATH]``

The proxy is the tests' own Toxiproxy-compatible server, started in this process,
unless ``TOXIPROXY_URL`` names a real Toxiproxy. The broker is the shared one on
127.0.0.1:5672, unless ``--own-node`` starts a RabbitMQ node for the soak alone (and
only then is the memory alarm among the faults).

Threading: everything here runs in the main thread; each run starts and joins its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from toxiproxy import Toxiproxy

from .faults import KINDS, Broker, default_broker_ctl
from .run import MODES, SCENARIOS, Options, run, summary_line

DEFAULT_RUNS = "A/drainer,A/legacy,A/stock,B/drainer"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=600.0, help="per run (default 600)")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"default {DEFAULT_RUNS}")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--own-node", action="store_true", help="a RabbitMQ node of its own")
    parser.add_argument("--faults", default=",".join(KINDS), help="kinds to draw from")
    parser.add_argument("--rate", type=float, default=50.0, help="publishes/s per publisher")
    parser.add_argument("--out", default="bench-results/soak.json")
    args = parser.parse_args(argv)
    args.runs = [tuple(r.strip().split("/", 1)) for r in args.runs.split(",") if r.strip()]
    for r in args.runs:
        if len(r) != 2 or r[0] not in SCENARIOS or r[1] not in MODES:
            parser.error(f"--runs: {'/'.join(r)} is not one of {SCENARIOS} x {MODES}")
    args.faults = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = set(args.faults) - set(KINDS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; known: {','.join(KINDS)}")
    return args


@contextlib.contextmanager
def toxiproxy_client() -> Iterator[tuple[Any, str]]:
    """A ``toxiproxy-python`` client: of ``TOXIPROXY_URL``, or of the tests' own server
    started in a child process (so that its memory and threads are not the soak's)."""
    url = os.environ.get("TOXIPROXY_URL")
    server = None
    if not url:
        server = subprocess.Popen(
            [sys.executable, "-m", "soak.proxy_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        url = server.stdout.readline().strip()
    try:
        if not url:
            raise RuntimeError("the built-in proxy did not start")
        parts = urlsplit(url)
        client = Toxiproxy()
        client.update_api_consumer(parts.hostname or "127.0.0.1", parts.port or 8474)
        yield client, "built-in" if server is not None else url
    finally:
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)


@contextlib.contextmanager
def broker(own_node: bool) -> Iterator[Broker]:
    if not own_node:
        yield Broker("127.0.0.1", 5672, default_broker_ctl, owned=False)
        return
    from support.rabbit_nodes import RabbitNode  # starts nothing until asked

    node = RabbitNode()
    try:
        node.start()
        own = Broker("127.0.0.1", node.port, node.ctl, owned=True)
        own.default_watermark = own.watermark()
        try:
            yield own
        finally:
            own.set_watermark(own.default_watermark)
    finally:
        node.cleanup()


def overall(results: list[dict[str, Any]], seed: int, proxy: str) -> str:
    missed = [
        f"{r['scenario']}/{r['mode']}[{','.join(k for k, ok in r['targets'].items() if not ok)}]"
        for r in results
        if not all(r["targets"].values())
    ]
    return (
        f"soak overall: runs={len(results)} seed={seed} proxy={proxy} "
        f"confirmed={sum(r['confirmed'] for r in results)} "
        f"lost={sum(r['lost'] for r in results)} "
        f"cci={sum(r['connection_closed_intentionally'] for r in results)} "
        f"faults={sum(len(r['faults']) for r in results)} "
        f"threads_leaked={sum(len(r['threads_leaked']) for r in results)} "
        f"fds_leaked={sum(r['fds_leaked'] for r in results)} "
        f"targets met {len(results) - len(missed)}/{len(results)}"
        + (f" (missed: {' '.join(missed)})" if missed else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    kinds = list(args.faults)
    left_out: list[str] = []
    if "memory_alarm" in kinds and not args.own_node:
        kinds.remove("memory_alarm")
        left_out.append("memory_alarm (needs --own-node: never on the shared broker)")
    print(
        f"soak: seed={seed} seconds={args.seconds:g} runs="
        f"{','.join('/'.join(r) for r in args.runs)} faults={','.join(kinds)}"
        + (f" left out: {'; '.join(left_out)}" if left_out else ""),
        flush=True,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    report: dict[str, Any] = {"seed": seed, "seconds": args.seconds, "runs": results}
    with toxiproxy_client() as (client, proxy), broker(args.own_node) as target:
        report.update({"proxy": proxy, "broker": target.url, "own_node": args.own_node})
        options = Options(args.seconds, seed, kinds, left_out, rate=args.rate)
        for scenario, mode in args.runs:
            result = run(scenario, mode, target, client, options)
            results.append(result)
            print(summary_line(result), flush=True)
            out.write_text(json.dumps(report, indent=2, sort_keys=True))
    line = overall(results, seed, proxy)
    report["summary"] = line
    out.write_text(json.dumps(report, indent=2, sort_keys=True))
    print(line, flush=True)
    print(
        f"replay: python -m soak --seconds {args.seconds:g} --runs "
        f"{','.join('/'.join(r) for r in args.runs)} --seed {seed}"
        + (" --own-node" if args.own_node else "")
        + (f" --faults {','.join(args.faults)}" if args.faults != list(KINDS) else ""),
        file=sys.stderr,
    )
    # Legacy and stock runs are the baselines the drainer is compared with: only the
    # drainer's runs decide the exit status.
    return 0 if all(all(r["targets"].values()) for r in results if r["mode"] == "drainer") else 1
