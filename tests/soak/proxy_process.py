"""The tests' Toxiproxy-compatible server in a process of its own, for the soak's command
line: its threads, buffers and descriptors then stay out of the soak's own figures
(RSS, threads, descriptors), as a real Toxiproxy's would.

``python -m soak.proxy_process`` prints the server's URL on one line, serves until its
standard input closes, then stops the server (bounded) and exits.
"""

from __future__ import annotations

import sys

from support.toxiproxy.server import ToxiproxyServer


def main() -> None:
    server = ToxiproxyServer("127.0.0.1", 0).start()
    try:
        print(server.url, flush=True)
        sys.stdin.read()  # until the parent closes the pipe (or exits)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
