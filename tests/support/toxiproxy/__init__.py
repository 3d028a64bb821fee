"""Pure-Python, in-process Toxiproxy 2.5-compatible server for the test suite.

Drive it with the ``toxiproxy-python`` client or plain HTTP; see ``server.py``
for the API, ``toxics.py`` for toxic semantics and ``fixtures.py`` for pytest
fixtures.  Test support only: not part of the installed library.
"""

from .server import VERSION, ToxiproxyServer

__all__ = ["VERSION", "ToxiproxyServer"]
