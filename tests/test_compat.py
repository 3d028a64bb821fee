"""drainer_amqp.compat: a py-amqp or kombu without an internal the library relies on
fails at import with an ImportError that names it and the installed versions."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import amqp
import kombu
import pytest
from kombu.transport import pyamqp

from drainer_amqp import compat


@pytest.fixture
def reload_after() -> Iterator[None]:
    yield
    importlib.reload(compat)  # after monkeypatch's undo (fixtures finish in reverse order)


def test_the_installed_releases_have_every_internal() -> None:
    assert compat.missing() == []
    compat.check()


@pytest.mark.parametrize(
    ("owner", "name", "shown"),
    [
        (amqp.Connection, "_claim_channel_id", "Connection._claim_channel_id"),
        (pyamqp.Transport, "_collect", "Transport._collect"),
    ],
)
def test_a_missing_internal_fails_the_import_naming_it(
    reload_after: None, monkeypatch: pytest.MonkeyPatch, owner: type, name: str, shown: str
) -> None:
    monkeypatch.delattr(owner, name)
    with pytest.raises(ImportError) as raised:
        importlib.reload(compat)
    message = str(raised.value)
    assert f"missing {shown}" in message
    assert f"amqp {amqp.__version__} with kombu {kombu.__version__}" in message


def test_a_missing_instance_attribute_is_named(
    reload_after: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    init = amqp.Connection.__init__

    def without_channel_ids(self: amqp.Connection, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        del self._used_channel_ids

    monkeypatch.setattr(amqp.Connection, "__init__", without_channel_ids)
    with pytest.raises(ImportError, match=r"Connection\(\)\._used_channel_ids"):
        importlib.reload(compat)
