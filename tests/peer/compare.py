"""Compare a stock and a drainer run of a peer suite (JUnit XML): every test that passed
on stock must pass with the drainer, and the drainer run must have used drainer
connections. Prints one row per run; exits 1 when the rule is broken.

Usage: python tests/peer/compare.py SUITE STOCK.xml DRAINER.xml DRAINER-REPORT.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

#: Tests whose stock result depends on the broker's state, not on the client: named
#: here with what stock did on this machine, run and reported like every other test.
#: None today: kombu's test_publish_requeue_consume (flaky upstream) failed on stock only
#: when an earlier run had left messages in its queue, which the script now deletes first.
KNOWN_STOCK_FLAKY: dict[str, str] = {}


def outcomes(path: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            result[name] = "failed"
        elif "error" in kinds:
            result[name] = "error"
        elif "skipped" in kinds:
            result[name] = "skipped"
        else:
            result[name] = "passed"
    return result


def main(suite: str, stock_xml: str, drainer_xml: str, report: str) -> int:
    stock, drainer = outcomes(stock_xml), outcomes(drainer_xml)
    with open(report) as f:
        connections = int(json.load(f)["drainer_connections"])
    for mode, runs in (("stock", stock), ("drainer", drainer)):
        counts = {
            k: sum(1 for v in runs.values() if v == k)
            for k in ("passed", "failed", "error", "skipped")
        }
        extra = f" drainer connections {connections}" if mode == "drainer" else ""
        print(
            f"{suite:8} {mode:8} passed {counts['passed']:3} failed {counts['failed']:2} "
            f"errors {counts['error']:2} skipped {counts['skipped']:2}{extra}"
        )
    differs = [n for n, v in stock.items() if v == "passed" and drainer.get(n) != "passed"]
    for name in differs:
        print(f"  passes on stock, {drainer.get(name, 'missing')} with the drainer: {name}")
    for name, v in stock.items():
        if v != "passed":
            note = KNOWN_STOCK_FLAKY.get(name, "NOT a known stock failure")
            print(f"  stock {v}: {name} ({note}); with the drainer: {drainer.get(name)}")
    if connections == 0:
        print("  no connection ran a drainer thread: the plugin did not take effect")
    return 1 if differs or connections == 0 else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
