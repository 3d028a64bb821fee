"""TLS with certificate verification on, through the py-amqp API and kombu.

The shared broker on 5672 speaks plain AMQP and must not be reconfigured, so a
TLS-terminating relay in the test (``support.relays``) forwards to it; certificates come
from ``trustme``. What users rely on:

* a verified connection round-trips (publish with confirm, consume) in both modes;
* an untrusted CA or a hostname mismatch is refused by ``connect()`` with
  ``ssl.SSLCertVerificationError``, leaving no thread or descriptor behind;
* credentials appear in no log record (everything at DEBUG), no exception text and no
  ``repr()`` of the connection, its transport or kombu's connection.
"""

from __future__ import annotations

import logging
import os
import ssl
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import amqp
import kombu
import pytest
import trustme
from amqp.exceptions import AccessRefused
from support.broker import BROKER_HOST, drainer_threads, unique_name, wait_until
from support.fake_broker import fake_broker, frame
from support.relays import relay

import drainer_amqp

MODES = ["drainer", "legacy"]
HOST = "127.0.0.1"
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


def verified(ca_file: str, server_hostname: str = HOST) -> dict[str, Any]:
    """py-amqp's ``ssl`` options with verification on, as a user would write them."""
    return {
        "ca_certs": ca_file,
        "cert_reqs": ssl.CERT_REQUIRED,
        "server_hostname": server_hostname,
    }


@pytest.fixture
def tls_relay(ca: trustme.CA) -> Iterator[int]:
    """A TLS listener (a certificate for 127.0.0.1) relaying to the shared broker."""
    with relay(server_tls=server_context(ca, HOST)) as link:
        yield link.port


def round_trip(conn: drainer_amqp.Connection) -> None:
    channel = conn.channel()
    name = channel.queue_declare(unique_name(), exclusive=True).queue
    received: list[bytes] = []
    channel.basic_consume(name, no_ack=True, callback=lambda m: received.append(m.body))
    publisher = conn.channel()
    publisher.confirm_select()
    bodies = [b"small", os.urandom(70_000)]  # the large one spans several TLS records
    for body in bodies:
        publisher.basic_publish_confirm(
            amqp.Message(body, content_type="application/octet-stream"), routing_key=name
        )
    while len(received) < len(bodies):
        conn.drain_events(timeout=TIMEOUT)
    assert received == bodies


@pytest.mark.parametrize("mode", MODES)
def test_a_verified_connection_round_trips(
    no_leaks: None, mode: str, tls_relay: int, ca_file: str
) -> None:
    conn = drainer_amqp.Connection(
        host=f"{HOST}:{tls_relay}", ssl=verified(ca_file), dedicated_drainer=mode == "drainer"
    )
    conn.connect()
    try:
        assert isinstance(conn.sock, ssl.SSLSocket)
        assert conn.sock.getpeercert(), "the broker's certificate was not verified"
        round_trip(conn)
    finally:
        conn.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheme", ["drainer-amqp", "drainer-amqps"])
def test_a_verified_kombu_connection_round_trips(
    no_leaks: None, scheme: str, mode: str, tls_relay: int, ca_file: str
) -> None:
    name = unique_name()
    with kombu.Connection(
        f"{scheme}://guest:guest@{HOST}:{tls_relay}//",
        ssl=verified(ca_file),
        transport_options={"dedicated_drainer": mode == "drainer", "confirm_publish": True},
    ) as conn:
        queue = kombu.Queue(name, exclusive=True)
        received: list[Any] = []
        with conn.Consumer(queue, callbacks=[lambda body, message: received.append(body)]):
            assert isinstance(conn.connection.sock, ssl.SSLSocket)
            producer = conn.Producer()
            for n in range(3):
                producer.publish({"n": n}, routing_key=name, serializer="json", retry=False)
            while len(received) < 3:
                conn.drain_events(timeout=TIMEOUT)
        assert received == [{"n": 0}, {"n": 1}, {"n": 2}]


def assert_refused_cleanly(error: BaseException, mentions: str) -> None:
    assert isinstance(error, ssl.SSLCertVerificationError), repr(error)
    assert mentions in str(error), str(error)
    assert not drainer_threads()


@pytest.mark.parametrize("mode", MODES)
def test_an_untrusted_certificate_is_refused(mode: str, ca_file: str, no_leaks: None) -> None:
    with relay(server_tls=server_context(trustme.CA(), HOST)) as link:
        conn = drainer_amqp.Connection(
            host=f"{HOST}:{link.port}", ssl=verified(ca_file), dedicated_drainer=mode == "drainer"
        )
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            conn.connect()
        assert_refused_cleanly(info.value, "certificate verify failed")
        assert not conn.connected


@pytest.mark.parametrize("mode", MODES)
def test_a_hostname_mismatch_is_refused(
    mode: str, ca: trustme.CA, ca_file: str, no_leaks: None
) -> None:
    with relay(server_tls=server_context(ca, "broker.example")) as link:
        conn = drainer_amqp.Connection(
            host=f"{HOST}:{link.port}", ssl=verified(ca_file), dedicated_drainer=mode == "drainer"
        )
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            conn.connect()
        assert_refused_cleanly(info.value, "mismatch")
        assert not conn.connected


def test_kombu_refuses_an_untrusted_certificate(ca_file: str, no_leaks: None) -> None:
    # The fake broker, not a relay: kombu's connect() retries, and a relay serves one client.
    with fake_broker(tls=server_context(trustme.CA(), HOST)) as broker:
        conn = kombu.Connection(
            f"drainer-amqp://guest:guest@{broker.hostport}//",
            ssl=verified(ca_file),
            transport_options={"dedicated_drainer": True},
        )
        try:
            with pytest.raises(ssl.SSLCertVerificationError) as info:
                conn.connect()
            assert_refused_cleanly(info.value, "certificate verify failed")
        finally:
            conn.release()


# -- credentials -------------------------------------------------------------------------
def everything_said(caplog: pytest.LogCaptureFixture, *things: object) -> str:
    """Every log record (message and arguments), and the text, traceback and ``repr``
    of each thing given."""
    said = [caplog.text]
    for record in caplog.records:
        said.append(record.getMessage())
        said.append(repr(record.args))
    for thing in things:
        said.append(repr(thing))
        if isinstance(thing, BaseException):
            said.append(str(thing))
            said.append("".join(traceback.format_exception(thing)))
    return "\n".join(said)


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_login_leaks_neither_the_password_nor_the_socket(
    no_leaks: None, mode: str, tls_relay: int, ca_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = f"pw-{uuid.uuid4().hex}"
    conn = drainer_amqp.Connection(
        host=f"{HOST}:{tls_relay}",
        userid="guest",
        password=secret,
        ssl=verified(ca_file),
        dedicated_drainer=mode == "drainer",
    )
    with pytest.raises(AccessRefused) as info:
        conn.connect()
    assert not conn.connected
    said = everything_said(caplog, info.value, conn, conn._transport)
    assert secret not in said


@pytest.mark.parametrize("mode", MODES)
def test_credentials_appear_in_no_log_error_or_repr(
    mode: str, ca: trustme.CA, ca_file: str, caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    """Over verified TLS to the fake broker, which takes any login: a working
    connection, then a bad frame, with everything logged at DEBUG."""
    caplog.set_level(logging.DEBUG)
    user, secret = f"user-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"
    with fake_broker(tls=server_context(ca, HOST)) as broker:
        conn = kombu.Connection(
            f"drainer-amqp://{user}:{secret}@{broker.hostport}//",
            ssl=verified(ca_file),
            transport_options={"dedicated_drainer": mode == "drainer"},
        )
        try:
            conn.connect()
            assert secret in str(broker.client.login_response)  # the secret really went out
            inner = conn.connection  # (after the failure, reading it would reconnect)
            said = [everything_said(caplog, conn, conn.transport, inner, inner._transport)]
            channel = conn.default_channel
            channel.basic_consume("q", no_ack=True, consumer_tag="ctag-1", callback=print)
            broker.send(frame(8, 0, b"", end=0x00))
            with pytest.raises(conn.connection_errors) as info:
                conn.drain_events(timeout=TIMEOUT)
            # py-amqp's transport repr() races a close of its socket: wait for the drainer.
            assert wait_until(lambda: not inner.drainer_stats()["running"], TIMEOUT)
            things = [info.value, conn, inner, inner._transport, inner.drainer_stats()]
            said.append(everything_said(caplog, *things, conn.as_uri()))
        finally:
            conn.release()
    assert not [text for text in said if secret in text]
    assert caplog.records, "nothing was logged: the capture is not working"


def test_a_refused_plain_login_releases_the_socket(no_leaks: None) -> None:
    """Without TLS too: connect() closes the socket when the broker refuses the login."""
    for mode in MODES:
        conn = drainer_amqp.Connection(
            host=BROKER_HOST, password=f"pw-{uuid.uuid4().hex}", dedicated_drainer=mode == "drainer"
        )
        with pytest.raises(AccessRefused):
            conn.connect()
