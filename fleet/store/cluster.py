"""Redis Cluster support for the result store: the URL form, the client and the per-node grouping of a batch.

A store URL ``redis+cluster://host:port`` (``rediss+cluster://`` for TLS) names one or more seed nodes of a Redis
Cluster (``redis+cluster://h1:7000,h2:7000``); the client discovers the others. The ACL user and TLS options of
``fleet.links.redis_options`` apply to every node.

What changes on a cluster (``fleet.store.redis`` reads ``cluster_mode``):

* Job records keep their single-Redis key names (``fleet:job:<id>``): every script that touches a job touches its
  record alone, so no hash tag is needed and records written by a single Redis stay readable after a migration.
* A micro-batch's compare-and-set runs as one script per primary node (the keys are grouped by the node that
  serves their slot), the groups concurrently. The cluster scripts declare ``allow-cross-slot-keys`` (Redis 7):
  one script may then touch keys of several slots, provided one node serves them all, which the grouping ensures.
  A batch that meets a slot being migrated fails with ``StoreError`` and is redelivered (nothing was acked).
* Completion notices are sharded pub/sub: the scripts ``SPUBLISH`` on ``fleet:done:{fleet:job:<id>}``
  (``done_channel_cluster``), whose hash tag is the record's key, so the notice stays on the shard that wrote the
  record. Waiters ``SSUBSCRIBE`` through ``ShardedMux``: one pub/sub connection per primary, each channel on the
  node serving its slot. Plain ``PUBLISH`` is copied to every node of a cluster; measured on three primaries, it
  cost each node more per result (about 38 us inside the script) than a whole result costs one Redis, so writes
  could not scale with the nodes. When a slot moves, its subscriptions end; the periodic re-read
  (``fleet.store.recheck``) hands those waiters their terminal record.
* The unpublished marks (``create(record, message)``) live in one slot: ``fleet:{pending}`` and
  ``fleet:{pending}:<id>`` (``PENDING_KEY_CLUSTER``). They are short-lived (cleared once the broker acknowledged).
  The mark is written first and the record second: a gateway that dies between the two leaves a mark without a
  record, which the reconcile sweep clears (``producers/gateway/jobs/reconcile.py``); the client never had an answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from fleet import constants as c

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# Prepended to a script that a cluster store runs on one node for keys of several slots. A cluster refuses a command
# whose declared keys are in different slots before any script runs, so the key names travel in ARGV instead
# (ARGV[1] their number, then the names, then the script's own arguments), which ``allow-cross-slot-keys`` permits
# as long as this node serves every one of them (``group_by_node``). The script then sees KEYS and ARGV as usual.
CROSS_SLOT = """#!lua flags=allow-cross-slot-keys
local n = tonumber(ARGV[1])
local KEYS, rest = {}, {}
for i = 1, n do KEYS[i] = ARGV[i + 1] end
for i = n + 2, #ARGV do rest[#rest + 1] = ARGV[i] end
local ARGV = rest
"""

# The unpublished marks on a cluster: one hash tag, so a claim script sees the set and the messages together.
PENDING_KEY_CLUSTER = c.PENDING_KEY_CLUSTER


def pending_message_key_cluster(job_id: str) -> str:
    """The request message of an unpublished job on a cluster: in the slot of ``PENDING_KEY_CLUSTER``."""
    return f"{PENDING_KEY_CLUSTER}:{job_id}"


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://``."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def seed_nodes(url: str) -> tuple[list[ClusterNode], bool, dict[str, Any]]:
    """The seed nodes of a cluster URL, whether it asks for TLS, and the user and password it carries."""
    parts = urlsplit(url)
    netloc = parts.netloc
    auth: dict[str, Any] = {}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            auth["username"] = user
        if password:
            auth["password"] = password
    nodes = []
    for hostport in netloc.split(","):
        parsed = urlsplit(urlunsplit(("redis", hostport.strip(), "", "", "")))
        if not parsed.hostname:
            raise ValueError(f"store URL {url!r}: a cluster seed needs host:port")
        nodes.append(ClusterNode(parsed.hostname, parsed.port or 6379))
    return nodes, CLUSTER_SCHEMES[parts.scheme] == "rediss", auth


def cluster_client(
    url: str, socket_timeout_s: float, connect_timeout_s: float, max_connections: int, link_options: dict[str, Any]
) -> RedisCluster:
    """A ``RedisCluster`` client for a ``redis+cluster://`` URL (not yet initialised: ``await client.initialize()``)."""
    nodes, tls, auth = seed_nodes(url)
    options: dict[str, Any] = {**auth, **link_options}
    if tls:
        options["ssl"] = True
    return BoundedCluster(
        max_connections,
        startup_nodes=nodes,
        max_connections=max_connections,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1),
        **options,
    )


def sharded(lua: str) -> str:
    """A store script for a cluster: its completion notice by ``SPUBLISH`` on the record's own shard (the channel
    ``done_channel_cluster``, in the record's slot), where plain ``PUBLISH`` would be copied to every node."""
    lua = lua.replace(
        "redis.call('PUBLISH', ARGV[4] .. string.sub(KEYS[i], cut), value)",
        "redis.call('SPUBLISH', ARGV[4] .. KEYS[i] .. '}', value)",
    )
    return lua.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")


class BoundedCluster(RedisCluster):
    """``RedisCluster`` whose commands queue for a free connection, as the single-Redis client's blocking pool does.

    A cluster client's per-node pool raises ``MaxConnectionsError`` once ``max_connections`` commands are in flight
    to one node; a burst of waiters (thousands of WebSocket clients) would fail instead of waiting. At most
    ``bound`` commands run at once here, so no node's pool is ever exhausted.
    """

    def __init__(self, bound: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._bound = asyncio.Semaphore(bound)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._bound:
            return await super().execute_command(*args, **kwargs)

    async def mget_nonatomic(self, keys: Any, *args: Any) -> Any:  # type: ignore[override]
        # A pipeline holding at most one connection per node: one permit keeps every node within the bound.
        async with self._bound:
            return await super().mget_nonatomic(keys, *args)


def group_by_node(cluster: RedisCluster, keys: Sequence[bytes]) -> dict[str, tuple[ClusterNode, list[int]]]:
    """The indexes of ``keys`` per node that serves their slot (node name -> (node, indexes)), in order."""
    groups: dict[str, tuple[ClusterNode, list[int]]] = {}
    node_of = cluster.get_node_from_key
    for i, key in enumerate(keys):
        node = node_of(key)  # type: ignore[arg-type]  # it hashes bytes as well
        if node is None:
            raise LookupError(f"no node of the cluster serves the slot of {key!r}")
        entry = groups.get(node.name)
        if entry is None:
            groups[node.name] = (node, [i])
        else:
            entry[1].append(i)
    return groups


DONE_PREFIX_CLUSTER = c.DONE_PREFIX_CLUSTER


def done_channel_cluster(job_id: str) -> str:
    """A job's completion channel on a cluster, ``fleet:done:{fleet:job:<id>}``: its hash tag is the record's
    key, so the channel is in the record's slot and the script that writes the record can ``SPUBLISH`` on it."""
    return f"{DONE_PREFIX_CLUSTER}{c.job_key(job_id)}}}"


def job_of_channel_cluster(channel: str) -> str | None:
    """The job id of a cluster completion channel (None for any other channel)."""
    inner = channel.removeprefix(DONE_PREFIX_CLUSTER)
    if inner == channel or not inner.endswith("}"):
        return None
    return inner[:-1].removeprefix("fleet:job:")


class _OneNode:
    """``make_connection()`` to one given node."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    def make_connection(self) -> AbstractConnection:
        node = self._node
        connection: AbstractConnection = node.connection_class(
            **{**node.connection_kwargs, "host": node.host, "port": node.port}
        )
        return connection


class ShardedMux:
    """``PubSubMux``'s interface on a cluster with sharded pub/sub: one mux (one connection, ``SSUBSCRIBE``) per
    primary, each channel watched on the node that serves its slot.

    A waiter's channel stays on the mux it was first watched on until its last waiter leaves. When a slot moves,
    the old node ends those subscriptions; their waiters get the terminal record from the periodic re-read
    (``fleet.store.recheck``) within its interval, and the next watch of the channel goes to the new owner.
    """

    def __init__(self, cluster: RedisCluster, *, display_url: str) -> None:
        from fleet.store.pubsub import PubSubMux

        self._cluster = cluster
        self._display_url = display_url
        self._make = PubSubMux
        self._muxes: dict[str, Any] = {}
        self._routes: dict[str, Any] = {}  # channel -> the mux it is watched on
        self._closed = False

    def _mux_for(self, channel: str) -> Any:
        mux = self._routes.get(channel)
        if mux is not None:
            return mux
        node = self._cluster.get_node_from_key(channel)
        if node is None:
            raise LookupError(f"no node of the cluster serves the slot of {channel!r}")
        mux = self._muxes.get(node.name)
        if mux is None:
            mux = self._muxes[node.name] = self._make(_OneNode(node), display_url=self._display_url, sharded=True)
            if self._closed:
                mux._closed = True
        return mux

    async def watch(self, channel: str, timeout_s: float) -> asyncio.Future[bytes | str | None]:
        mux = self._mux_for(channel)
        self._routes[channel] = mux
        try:
            future: asyncio.Future[bytes | str | None] = await mux.watch(channel, timeout_s)
        except BaseException:
            if channel not in mux._waiters:
                self._routes.pop(channel, None)
            raise
        return future

    def release(self, channel: str, future: asyncio.Future[bytes | str | None]) -> None:
        mux = self._routes.get(channel)
        if mux is None:
            return
        mux.release(channel, future)
        if channel not in mux._waiters:
            del self._routes[channel]

    def deliver(self, channel: str, data: bytes | str) -> None:
        mux = self._routes.get(channel)
        if mux is not None:
            mux.deliver(channel, data)

    def last_message(self, channel: str) -> bytes | str | None:
        mux = self._routes.get(channel)
        return None if mux is None else mux.last_message(channel)

    def watched(self) -> list[str]:
        return list(self._routes)

    @property
    def watched_channels(self) -> int:
        return len(self._routes)

    @property
    def connected(self) -> bool:
        return bool(self._muxes) and all(mux.connected for mux in self._muxes.values())

    @property
    def connects(self) -> int:
        return sum(mux.connects for mux in self._muxes.values())

    async def close(self) -> None:
        self._closed = True
        for mux in list(self._muxes.values()):
            await mux.close()
