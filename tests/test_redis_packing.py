"""``fleet.store.redis_packing``: commands packed by hiredis are byte for byte what redis-py's own packer sends,
inputs hiredis refuses get redis-py's own error, and the store's connections use it against a real Redis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.redis import RedisStore
from fleet.store.redis_packing import HiredisPacking, with_hiredis_packing

PLAIN = Connection()
FAST = with_hiredis_packing(Connection)()
# redis-py's own packer in Python: from redis-py 8 on, ``pack_command`` itself packs with hiredis when it is
# installed, so the Python loop the bytes are held to is the private ``_pack_command_python``
PYTHON_PACK = getattr(PLAIN, "_pack_command_python", PLAIN.pack_command)

arguments = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100),  # any code point hypothesis draws; lone surrogates are refused below
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False),
    st.binary(min_size=7000, max_size=9000),  # past redis-py's buffer cut-off: it sends these as chunks of their own
)


def packed(connection: Connection, *args: object) -> bytes:
    return b"".join(connection.pack_command(*args))


def python_packed(*args: object) -> bytes:
    return b"".join(PYTHON_PACK(*args))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["EVALSHA", "SET", b"MGET", "SCRIPT LOAD", "CLIENT SETINFO"]), st.lists(arguments, max_size=40))
def test_hiredis_packs_the_bytes_redis_py_packs(command: str | bytes, args: list[object]) -> None:
    try:
        expected = python_packed(command, *args)
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            packed(FAST, command, *args)
        return
    assert packed(FAST, command, *args) == expected


@pytest.mark.parametrize("bad", [True, None, object(), [1, 2]])
def test_what_hiredis_refuses_gets_redis_pys_own_error(bad: object) -> None:
    with pytest.raises(DataError) as plain:
        packed(PLAIN, "SET", "k", bad)
    with pytest.raises(DataError) as fast:
        packed(FAST, "SET", "k", bad)
    assert str(fast.value) == str(plain.value)


def test_another_encoding_is_left_to_redis_py() -> None:
    latin = with_hiredis_packing(Connection)(encoding="latin-1")
    assert packed(latin, "SET", "k", "café") == packed(Connection(encoding="latin-1"), "SET", "k", "café")
    assert packed(latin, "SET", "k", "café") != packed(FAST, "SET", "k", "café")  # UTF-8 there: two bytes for é


def test_each_connection_kind_gets_its_own_packing_subclass() -> None:
    big = b"x" * 7000
    assert len(PYTHON_PACK("SET", "k", big)) > 1  # redis-py's Python loop sends a big value as a chunk of its own
    assert FAST.pack_command("SET", "k", big) == [python_packed("SET", "k", big)]  # hiredis packed it whole
    for kind in (Connection, SSLConnection, UnixDomainSocketConnection):
        fast = with_hiredis_packing(kind)
        assert issubclass(fast, kind) and issubclass(fast, HiredisPacking)
        assert with_hiredis_packing(fast) is fast and with_hiredis_packing(kind) is fast


async def test_the_store_talks_to_a_real_redis_through_hiredis_packing(redis_url: str) -> None:
    store = make_store(FleetSettings(store_url=redis_url))
    assert isinstance(store, RedisStore)
    assert issubclass(store.redis.connection_pool.connection_class, HiredisPacking)
    await store.connect()
    try:
        key = "fleet:test:packing:é"
        assert await store.redis.set(key, "ünïcode", ex=30)
        assert await store.redis.get(key) == "ünïcode".encode()
        assert await store.redis.execute_command("SCRIPT EXISTS", "0" * 40) == [0]  # a two-word command name
    finally:
        await store.redis.delete("fleet:test:packing:é")
        await store.close()
