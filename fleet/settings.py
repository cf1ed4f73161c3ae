"""Typed settings, read once at the edge (the CLI or an app's lifespan) and passed in.

Every field can be set by an environment variable with the ``FLEET_`` prefix (``FLEET_BROKER_URL``,
``FLEET_MAX_BATCH``...) or by the matching CLI flag. Library code never reads the environment itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from fleet import constants as c
from fleet.errors import ConfigError
from fleet.lifecycle.breaker import BreakerConfig
from fleet.limit_policy import LimitPolicy, build_policy, parse_rate, parse_tenant_limits
from fleet.pools import check_pools
from fleet.priorities import check_weights
from fleet.redaction import redact

BROKER_SCHEMES = ("memory", "nats", "tls", "kafka")  # tls:// is NATS over TLS
DEVICE_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # what a worker's device is before its ':' (cuda:0 -> cuda)
STORE_SCHEMES = ("memory", "redis", "rediss", "redis+cluster", "rediss+cluster")


def url_scheme(url: str, allowed: tuple[str, ...], what: str) -> str:
    scheme = urlsplit(url).scheme
    if scheme not in allowed:
        raise ConfigError(
            f"{what} URL {redact(url)!r} has scheme {scheme or '(none)'!r}; expected one of "
            + ", ".join(f"{s}://" for s in allowed)
        )
    return scheme


PAIR_FORMS = {  # the settings written as KEY=VALUE pairs (or a JSON object), and the form their errors show
    "routing": "MODEL=pull|dispatch",
    "max_queued_per_model": "MODEL=COUNT",
    "p99_target_ms": "MODEL=MILLISECONDS",
    "max_batch_cost": "MODEL=COST",
    "autoscale_max_queue_age_s": "MODEL=SECONDS",
    "price_per_device_hour": "DEVICE=PRICE",
}


def parse_pairs(value: object, name: str, form: str) -> object:
    """``'a=1,b=2'`` or a JSON object as a dict (values still strings or as given; the field's type checks them)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} {value!r} is not a JSON object: {exc}") from None
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
        raise ValueError(
            f"{name} {value!r}: write {form} pairs separated by commas (each with its {form.split('=')[0].lower()}), "
            "or a JSON object"
        )
    return {key.strip(): item.strip() for key, item in pairs}


def parse_cache(value: object) -> object:
    """``FLEET_CACHE``: ``'embed'``, ``'embed=l1+l2+l3,echo=l1'`` or a JSON object ``{"embed": ["l1", "l2"]}``.

    A model named without levels gets ``("all",)``: every level its spec supports (the gateway resolves it).
    """
    if isinstance(value, str) and not value.strip().startswith("{"):
        items = [item.strip() for item in value.split(",") if item.strip()]
        value = ",".join(item if "=" in item else f"{item}=all" for item in items)
    pairs = parse_pairs(value, "cache", "MODEL or MODEL=l1+l2+l3")
    if not isinstance(pairs, dict):
        return pairs
    out: dict[str, object] = {}
    for model, levels in pairs.items():
        if isinstance(levels, str):
            levels = [level.strip() for level in levels.split("+") if level.strip()]
        if levels in (["all"], ("all",)):
            out[model] = ("all",)
            continue
        if not isinstance(levels, list | tuple) or not levels:
            raise ValueError(f"cache: model {model!r} needs levels like 'l1+l2+l3', got {levels!r}")
        unknown = [level for level in levels if level not in c.CACHE_LEVELS]
        if unknown:
            raise ValueError(f"cache: unknown level(s) {', '.join(map(str, unknown))} for {model!r}; known: l1, l2, l3")
        out[model] = tuple(level for level in c.CACHE_LEVELS if level in levels)
    return out


def parse_pools(value: object) -> object:
    """``FLEET_POOLS``: ``'nlp=sentiment+ner@2+embed,vision=clip'`` or a JSON object
    ``{"nlp": ["sentiment", "ner@2"]}``; checked by ``fleet.pools.check_pools``."""
    pairs = parse_pairs(value, "pools", "POOL=model+model@version")
    if not isinstance(pairs, dict):
        return pairs
    return {
        name: [ref.strip() for ref in refs.split("+") if ref.strip()] if isinstance(refs, str) else refs
        for name, refs in pairs.items()
    }


class FleetSettings(BaseSettings):
    """Settings shared by every Fleet process. Defaults run everything embedded in one process."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", extra="ignore", validate_default=True)

    broker_url: str = Field("memory://", description="memory://, nats://host:4222 or kafka://host:9092")
    store_url: str = Field(
        "memory://", description="memory://, redis://host:6379/0 or redis+cluster://host:7000 (a Redis Cluster)"
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["echo", "sleep", "embed"],
        description="models to serve: built-in names, model repository entries 'name' or 'name@version', or import "
        "paths 'package.module:Handler' (comma-separated)",
    )
    pools: Annotated[dict[str, list[str]], NoDecode] = Field(
        default_factory=dict,
        description="named sets of models served by the same multi-model workers ('fleet worker --pool NAME', the "
        "same as '--models a,b@2'), which the autoscaler scales as one on the sum of their demand; a model is in "
        "one pool at most; e.g. 'nlp=sentiment+ner@2,vision=clip' or a JSON object",
    )
    model_repository: Path = Field(
        Path("models"),
        description="the model repository folder (models/<name>/<version>/model.yaml); a relative path is taken "
        "from the app folder (--app-dir, FLEET_APP_DIR; default: the current folder)",
    )
    model_public_key: Path | None = Field(
        None,
        description="a PEM file of an ed25519 public key: when set, every repository model must carry a valid "
        "model.yaml.sig (fleet models sign)",
    )

    # worker
    max_batch: int = Field(c.DEFAULT_MAX_BATCH, ge=1, le=4096, description="largest micro-batch a worker runs")
    max_wait_ms: float = Field(
        c.DEFAULT_MAX_WAIT_MS, ge=0, le=60_000, description="longest wait for a micro-batch to fill"
    )
    ack_wait_s: float = Field(c.DEFAULT_ACK_WAIT_S, gt=0, description="redeliver a message unacked this long")
    max_deliveries: int = Field(
        c.DEFAULT_MAX_DELIVERIES,
        ge=1,
        le=1000,
        description="runs that count against a job (it failed retriably, or its worker died while it ran alone) "
        "before it is dead-lettered; 10x as many runs whatever ended them (fleet.consumers.crashes)",
    )
    heartbeat_interval_s: float = Field(c.DEFAULT_HEARTBEAT_INTERVAL_S, gt=0, description="worker heartbeat period")
    drain_timeout_s: float = Field(c.DEFAULT_DRAIN_TIMEOUT_S, ge=0, description="SIGTERM: finish in-flight work")
    adaptive_batching: bool = Field(
        True, description="size micro-batches from the model's p99 target (false: use the batch limits as they are)"
    )
    p99_target_ms: Annotated[dict[str, Annotated[float, Field(ge=0, le=600_000)]], NoDecode] = Field(
        default_factory=dict,
        description="per model: the p99 latency (queue wait + compute) its batches are sized for, overriding the "
        "model's declaration; 0 turns the controller off for that model; e.g. 'embed=50,echo=20' or a JSON object",
    )
    max_batch_cost: Annotated[dict[str, Annotated[int, Field(ge=1)]], NoDecode] = Field(
        default_factory=dict,
        description="per model: the most summed item cost (embed: estimated tokens) one batch may hold, overriding "
        "the model's declaration; e.g. 'embed=8192' or a JSON object",
    )
    price_per_device_hour: Annotated[dict[str, Annotated[float, Field(ge=0, le=1_000_000)]], NoDecode] = Field(
        default_factory=dict,
        description="per device kind (cpu, cuda, ...): the price of one device-hour, which turns usage into cost "
        "(GET /v1/usage); e.g. 'cpu=0.05,cuda=2.5' or a JSON object; a kind without a price costs nothing",
    )
    price_currency: str = Field("USD", pattern=r"^[A-Za-z]{1,8}$", description="the currency of the prices")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="batches a worker computes at once on one copy of its model's weights (threads; "
        "fleet.consumers.replicas)",
    )
    worker_breaker: BreakerConfig | None = Field(
        None,
        description="a worker's circuit breaker (fleet.consumers.breaker): when its batches keep failing with model "
        "errors it stops taking work until a probe succeeds; a JSON object of BreakerConfig's fields, e.g. "
        "'{\"consecutive_failures\": 3}' ('{}': the defaults); unset: no breaker",
    )
    slowness: float = Field(1.0, gt=0, description="per-worker service-time factor of the sleep model")
    slo_latency_s: float = Field(
        1.0,
        description="the latency SLO's threshold: a job slower than this (creation to result) counts against the "
        "budget; one of fleet_job_latency_seconds' buckets (fleet.constants.JOB_LATENCY_BUCKETS_S); workers export "
        "it for the shipped alert rules (docs/guides/alerts.md)",
    )
    slo_latency_target: float = Field(
        0.99, gt=0, lt=1, description="the share of jobs that must finish within slo_latency_s (0.99: 1% may not)"
    )
    slo_error_target: float = Field(
        0.999, gt=0, lt=1, description="the share of terminal jobs that must not fail (0.999: 0.1% may fail)"
    )

    # broker
    dedup_window_s: float = Field(c.DEFAULT_DEDUP_WINDOW_S, gt=0, description="JetStream duplicate window")
    max_message_bytes: int = Field(c.DEFAULT_MAX_MESSAGE_BYTES, ge=1024, description="largest message a broker accepts")
    kafka_partitions: int = Field(4, ge=1, le=1024, description="partitions of a request topic Fleet creates")
    kafka_auto_create: bool = Field(True, description="create missing request topics at start-up")

    # priorities (fleet.priorities)
    priority_weights: Annotated[tuple[int, int, int], NoDecode] = Field(
        c.DEFAULT_PRIORITY_WEIGHTS,
        description="how many rounds of each cycle high, normal and low lead, e.g. '6,3,1' (each at least 1, so no "
        "level starves)",
    )

    # multi-model workers (fleet.consumers.pool)
    memory_budget: str | None = Field(
        None,
        description="what a multi-model worker's loaded models may take in all: bytes, a size (2GiB, 500MB) or a "
        "fraction of the device's memory (0.5); unset: no budget",
    )
    model_retry_after_s: float = Field(
        30.0, gt=0, le=86_400, description="a multi-model worker's back-off after a model failed to load"
    )

    # direct assignment (dispatcher)
    routing: Annotated[dict[str, Literal["pull", "dispatch"]], NoDecode] = Field(
        default_factory=dict,
        description="per model: 'pull' (workers compete on the request subject, the default) or 'dispatch' "
        "(dispatchers assign requests to worker inboxes); e.g. 'sleep=dispatch,embed=pull' or a JSON object",
    )
    dispatch_policy: str = Field("jiq-amnesia", description="the dispatcher's load-balancing policy")
    dispatch_d: int = Field(2, ge=1, le=64, description="sample size d of power-of-d, peak-ewma, SQ(d), amnesia")
    amnesia_window_s: float = Field(10.0, gt=0, description="how long a recently active worker stays on the list")
    affinity_wait_s: float = Field(
        2.0,
        ge=0,
        le=3600,
        description="how long a request may wait for a worker that has its model version loaded before the "
        "dispatcher sends it to a cold worker, which loads it (never past the request's deadline; 0: take an idle "
        "warm worker, else any idle one); about one model load's time",
    )
    dispatch_max_outstanding: int = Field(
        1024, ge=1, description="requests one dispatcher holds (assigned, awaiting their result) at most"
    )

    # store
    job_ttl_s: int = Field(c.DEFAULT_JOB_TTL_S, ge=1, description="how long job records live")

    # gateway
    host: str = Field("127.0.0.1", description="address the gateway listens on")
    port: int = Field(8000, ge=0, le=65535, description="port the gateway listens on")
    max_body_bytes: int = Field(c.DEFAULT_MAX_BODY_BYTES, ge=1024, description="largest REST body (413 above)")
    max_long_poll_s: float = Field(c.DEFAULT_MAX_LONG_POLL_S, gt=0, description="longest ?wait= of a long-poll")
    lag_interval_s: float = Field(5.0, gt=0, description="how often the gateway refreshes the fleet_queue_lag gauge")
    max_queued: int = Field(
        c.DEFAULT_MAX_QUEUED,
        ge=0,
        description="per model: requests waiting or in flight beyond which POST /v1/jobs answers 429 queue_full "
        "(0: unbounded); on NATS the request stream also refuses direct publishes beyond the largest bound",
    )
    max_queued_per_model: Annotated[dict[str, Annotated[int, Field(ge=0)]], NoDecode] = Field(
        default_factory=dict,
        description="per-model overrides of max_queued, e.g. 'sleep=50,embed=1000' or a JSON object",
    )
    rate_limit: str | None = Field(
        None,
        description="per-tenant submit rate with a burst, e.g. '20/s burst 40' or '600/m' (unset: no rate limit); "
        "held across every gateway on one Redis",
    )
    tenant_max_queued: int = Field(
        0, ge=0, description="per tenant: jobs queued or running beyond which a submit is refused (0: no bound)"
    )
    tenant_limits: Annotated[dict[str, dict[str, Any]], NoDecode] = Field(
        default_factory=dict,
        description='per-tenant overrides, a JSON object: {"teamA": {"rate": 100, "burst": 200, "max_queued": 5000}}',
    )
    operator_token: SecretStr | None = Field(
        None,
        description="bearer token the operator dashboard and API require; unset: open on a loopback host only",
    )
    auth: Literal["off", "keys"] | None = Field(
        None,
        description="off: no API keys; keys: every request but health, readiness, metrics and docs needs "
        "'Authorization: Bearer <API key>'. Unset: off on a loopback host, and a gateway bound to any other "
        "address refuses to start until it is set",
    )
    operator_interval_s: float = Field(
        1.0, gt=0, le=60, description="how often the operator feed samples (one point per model in its 15-minute ring)"
    )
    reconcile_after_s: float = Field(
        c.DEFAULT_RECONCILE_AFTER_S,
        gt=0,
        description="a job still unpublished this long after its record was written is republished by a gateway's "
        "reconcile sweep (the gateway that accepted it died in between)",
    )

    # result caches (gateway)
    cache: Annotated[dict[str, tuple[str, ...]], NoDecode] = Field(
        default_factory=dict,
        description="per model: the result-cache levels it uses, e.g. 'embed' (every level the model supports: "
        "l1+l2, and l3 when its spec names a text to embed), 'embed=l1+l2+l3,echo=l1' or a JSON object",
    )
    cache_shared: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="models whose cache entries every tenant shares, e.g. 'embed' (comma-separated); any other "
        "model's L1, L2 and L3 entries answer only the tenant whose job filled them",
    )
    cache_l1_max_entries: int = Field(
        c.DEFAULT_CACHE_L1_MAX_ENTRIES, ge=1, description="L1 (in-process LRU) entries per gateway, all models"
    )
    cache_l1_ttl_s: float = Field(c.DEFAULT_CACHE_L1_TTL_S, gt=0, description="how long an L1 entry lives")
    cache_l2_ttl_s: int = Field(c.DEFAULT_CACHE_L2_TTL_S, ge=1, description="how long an L2 (store) entry lives")
    cache_l3_max_entries: int = Field(
        c.DEFAULT_CACHE_L3_MAX_ENTRIES,
        ge=16,
        description="L3 (semantic) entries per model version and tenant (the shared log: per model version); "
        "oldest go first",
    )
    cache_l3_threshold: float | None = Field(
        None, gt=0, le=1, description="cosine similarity of an L3 hit for every model (default: each model's own)"
    )
    cache_l3_nprobe: int = Field(8, ge=1, le=1024, description="IVF lists the L3 index searches per query")
    cache_l3_sync_interval_s: float = Field(
        0.5, gt=0, description="how often a gateway reads the L3 entries other gateways added"
    )
    cache_embedder_threads: int = Field(
        1,
        ge=1,
        le=1024,
        description="torch threads of each L3 embedder on a CPU. Lookups that arrive together are embedded "
        "together, usually one to a few texts: a second thread then saves little time and nearly doubles the CPU "
        "a lookup costs, which a worker on the same machine loses",
    )
    cache_timeout_ms: float = Field(
        100.0, gt=0, description="longest wait for one L2 read or write; slower is a miss (counted as an error)"
    )
    cache_fill_wait_s: float = Field(
        300.0, gt=0, description="how long a gateway waits for a missed job's result to fill the caches with it"
    )

    # autoscaler (`fleet up` and `fleet autoscaler`)
    autoscale: bool = Field(True, description="fleet up: scale workers on lag (false: one worker per model)")
    autoscale_interval_s: float = Field(
        c.DEFAULT_AUTOSCALER_INTERVAL_S, gt=0, description="how often the autoscaler reads signals and decides"
    )
    autoscale_min_replicas: int = Field(1, ge=0, description="fewest workers per model (0 allows scale to zero)")
    autoscale_max_replicas: int = Field(4, ge=1, description="most workers per model")
    autoscale_stabilization_s: float = Field(
        60.0, ge=0, description="fleet up: scale in only after the load stayed low this long"
    )
    autoscale_target_drain_s: float = Field(
        30.0, gt=0, description="rate mode: run enough workers to drain the current backlog within this many seconds"
    )
    autoscale_max_queue_age_s: Annotated[dict[str, Annotated[float, Field(gt=0, le=86_400)]], NoDecode] = Field(
        default_factory=dict,
        description="per model (or pool): the longest a request may wait before the autoscaler adds workers, "
        "whatever the lag says (fleet.autoscaler.config.ScalingConfig.max_queue_age_s); e.g. 'embed=2,echo=0.5' "
        "or a JSON object",
    )

    # rollout controller (`fleet up` and `fleet autoscaler`: fleet.lifecycle.service)
    rollout_interval_s: float = Field(
        c.DEFAULT_ROLLOUT_INTERVAL_S,
        gt=0,
        le=3600,
        description="how often the rollout controller judges each model's canary and breakers",
    )
    rollout_window_s: float = Field(
        c.DEFAULT_ROLLOUT_WINDOW_S,
        ge=10,
        le=3600,
        description="the window of outcomes, latencies and agreement a canary is judged on (at least one 10 s bucket)",
    )

    # start-up (every process)
    startup_timeout_s: float = Field(
        60.0,
        ge=0,
        description="how long a starting process retries a broker or store it cannot reach before it exits "
        "(0: try once)",
    )

    # authenticated, encrypted links (fleet.links): paths to files, never a secret itself
    nats_creds_file: Path | None = Field(None, description="NATS: a .creds file (user JWT + NKey seed)")
    nats_nkey_seed_file: Path | None = Field(None, description="NATS: a file holding a user NKey seed (SU...)")
    nats_user: str | None = Field(None, description="NATS: user name (with nats_password_file)")
    nats_password_file: Path | None = Field(None, description="NATS: a file holding nats_user's password")
    nats_tls_ca_file: Path | None = Field(None, description="NATS (tls://): CA file that verifies the server")
    nats_tls_cert_file: Path | None = Field(None, description="NATS (tls://): client certificate (mutual TLS)")
    nats_tls_key_file: Path | None = Field(None, description="NATS (tls://): the client certificate's key")
    kafka_sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] | None = Field(
        None, description="Kafka SASL mechanism (with kafka_user and kafka_password_file)"
    )
    kafka_user: str | None = Field(None, description="Kafka SASL user")
    kafka_password_file: Path | None = Field(None, description="Kafka: a file holding kafka_user's password")
    kafka_tls: bool = Field(False, description="Kafka over SSL (implied by kafka_tls_ca_file)")
    kafka_tls_ca_file: Path | None = Field(None, description="Kafka SSL: CA file that verifies the brokers")
    kafka_tls_cert_file: Path | None = Field(None, description="Kafka SSL: client certificate (mutual TLS)")
    kafka_tls_key_file: Path | None = Field(None, description="Kafka SSL: the client certificate's key")
    redis_user: str | None = Field(None, description="Redis ACL user (default: the default user)")
    redis_password_file: Path | None = Field(None, description="Redis: a file holding the (ACL user's) password")
    redis_tls_ca_file: Path | None = Field(None, description="Redis (rediss://): CA file that verifies the server")
    redis_tls_cert_file: Path | None = Field(None, description="Redis (rediss://): client certificate (mutual TLS)")
    redis_tls_key_file: Path | None = Field(None, description="Redis (rediss://): the client certificate's key")

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log level of the CLI's processes"
    )

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_validator("pools", mode="before")
    @classmethod
    def _parse_pools(cls, value: object) -> object:
        return parse_pools(value)

    @field_validator("pools")
    @classmethod
    def _check_pools(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        check_pools(value)
        return value

    @field_validator("cache_shared", mode="before")
    @classmethod
    def _split_cache_shared(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_validator(*PAIR_FORMS, mode="before")
    @classmethod
    def _parse_pair_fields(cls, value: object, info: ValidationInfo) -> object:
        name = info.field_name or ""
        return parse_pairs(value, name, PAIR_FORMS[name])

    @field_validator("slo_latency_s")
    @classmethod
    def _check_slo_latency(cls, value: float) -> float:
        if value not in c.JOB_LATENCY_BUCKETS_S:
            bounds = ", ".join(f"{b:g}" for b in c.JOB_LATENCY_BUCKETS_S)
            raise ConfigError(
                f"FLEET_SLO_LATENCY_S={value:g} is not a bucket of fleet_job_latency_seconds; use one of {bounds}"
            )
        return value

    @field_validator("priority_weights", mode="before")
    @classmethod
    def _parse_weights(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value

    @field_validator("priority_weights")
    @classmethod
    def _check_weights(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        return check_weights(value)

    @field_validator("cache", mode="before")
    @classmethod
    def _parse_cache(cls, value: object) -> object:
        return parse_cache(value)

    def cache_levels(self, model: str) -> tuple[str, ...]:
        """The cache levels ``model`` uses (empty: not cached); ``("all",)`` means every level its spec supports
        (resolved by the gateway, which knows the spec)."""
        return self.cache.get(model, ())

    @field_validator("rate_limit")
    @classmethod
    def _check_rate_limit(cls, value: str | None) -> str | None:
        if value is not None and value.strip():
            parse_rate(value)
        return value

    @field_validator("tenant_limits", mode="before")
    @classmethod
    def _parse_tenant_limits(cls, value: object) -> object:
        return parse_tenant_limits(value)

    def limit_policy(self) -> LimitPolicy:
        """The per-tenant rate limits and quotas (``fleet.limit_policy``, enforced by ``fleet.store.quotas``);
        ``.enabled`` is False by default."""
        return build_policy(self.rate_limit, self.tenant_max_queued, self.tenant_limits)

    @field_validator("price_per_device_hour")
    @classmethod
    def _check_price_kinds(cls, value: dict[str, float]) -> dict[str, float]:
        for kind in value:
            if not DEVICE_KIND_RE.match(kind):
                raise ValueError(
                    f"price_per_device_hour: {kind!r} is not a device kind (cpu, cuda, ...: a lower-case name)"
                )
        return value

    def p99_target_for(self, model: str, declared: float | None) -> float | None:
        """The p99 target that sizes ``model``'s batches, or ``None`` when its batches are not adapted."""
        if not self.adaptive_batching:
            return None
        target = self.p99_target_ms.get(model, declared)
        return target if target else None

    def max_batch_cost_for(self, model: str, declared: int | None) -> int | None:
        """The cost budget of one of ``model``'s batches (``None``: bounded by count only)."""
        return self.max_batch_cost.get(model, declared)

    def max_queued_for(self, model: str) -> int:
        """The bound on ``model``'s queued requests (0: unbounded)."""
        return self.max_queued_per_model.get(model, self.max_queued)

    @property
    def broker_max_queued(self) -> int:
        """The per-subject limit of the NATS request stream: the largest bound, or 0 (none) when any is unbounded.

        One stream holds every model's subject and JetStream has one per-subject limit per stream, so the broker
        cannot hold each model to its own bound; the gateway does.
        """
        bounds = [self.max_queued, *self.max_queued_per_model.values()]
        return 0 if 0 in bounds else max(bounds)

    @field_validator("dispatch_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in c.DISPATCH_POLICIES:
            raise ValueError(f"unknown dispatch policy {value!r}; known: {', '.join(c.DISPATCH_POLICIES)}")
        return value

    def routing_for(self, model: str) -> Literal["pull", "dispatch"]:
        return self.routing.get(model, "pull")

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, value: str) -> str:
        url_scheme(value, BROKER_SCHEMES, "broker")
        return value

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, value: str) -> str:
        url_scheme(value, STORE_SCHEMES, "store")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> FleetSettings:
        if not self.models:
            raise ValueError("models: at least one model must be served")
        _pools_apart_from_models(self.pools, self.models)
        if self.autoscale_min_replicas > self.autoscale_max_replicas:
            raise ValueError(
                f"autoscale_min_replicas ({self.autoscale_min_replicas}) is above autoscale_max_replicas "
                f"({self.autoscale_max_replicas})"
            )
        if self.max_wait_ms / 1000 >= self.ack_wait_s:
            raise ValueError(
                f"max_wait_ms ({self.max_wait_ms}) must be well below ack_wait_s ({self.ack_wait_s}s), "
                "or messages are redelivered while a batch is still filling"
            )
        _check_link_settings(self)
        return self

    @property
    def broker_scheme(self) -> str:
        return urlsplit(self.broker_url).scheme

    @property
    def store_scheme(self) -> str:
        return urlsplit(self.store_url).scheme


# -- the link settings (fleet.links builds the clients' options from them) ------------------------------
def _pools_apart_from_models(pools: dict[str, list[str]], models: list[str]) -> None:
    """A pool is a scaling target named like a model: it must not be named like a model served alone."""
    served = {ref.partition("@")[0] for ref in models if ":" not in ref}
    clash = sorted(set(pools) & served)
    if clash:
        raise ValueError(f"pools: pool {clash[0]!r} is named like a served model; name the pool differently")


def _check_link_settings(settings: FleetSettings) -> None:
    """Refuse link settings that contradict each other (``ValueError`` naming them); files are read later."""
    nats_ways = [settings.nats_creds_file, settings.nats_nkey_seed_file, settings.nats_password_file]
    if sum(way is not None for way in nats_ways) > 1:
        raise ValueError("nats_creds_file, nats_nkey_seed_file and nats_password_file: set at most one of them")
    _paired(settings.nats_user, settings.nats_password_file, "nats_user", "nats_password_file")
    _paired(settings.kafka_user, settings.kafka_password_file, "kafka_user", "kafka_password_file")
    if (settings.kafka_sasl_mechanism is None) != (settings.kafka_user is None):
        raise ValueError("kafka_sasl_mechanism and kafka_user: set both (with kafka_password_file) or neither")
    if settings.redis_user is not None and settings.redis_password_file is None:
        raise ValueError("redis_user needs redis_password_file (the ACL user's password)")
    for kind in ("nats", "kafka", "redis"):
        cert, key = getattr(settings, f"{kind}_tls_cert_file"), getattr(settings, f"{kind}_tls_key_file")
        if key is not None and cert is None:
            raise ValueError(f"{kind}_tls_key_file needs {kind}_tls_cert_file (the client certificate)")
    _tls_needs_scheme(settings)


def _tls_needs_scheme(settings: FleetSettings) -> None:
    nats_files = (settings.nats_tls_ca_file, settings.nats_tls_cert_file)
    schemes = {urlsplit(part.strip()).scheme for part in settings.broker_url.split(",") if part.strip()}
    if "tls" in schemes and len(schemes) > 1:
        raise ValueError("broker_url: write every NATS server with tls:// or none of them")
    if any(f is not None for f in nats_files) and schemes == {"nats"}:
        raise ValueError("nats_tls_* files are set but broker_url is nats://...: write tls://host:4222 to use TLS")
    redis_files = (settings.redis_tls_ca_file, settings.redis_tls_cert_file)
    if any(f is not None for f in redis_files) and settings.store_scheme in ("redis", "redis+cluster"):
        raise ValueError("redis_tls_* files are set but store_url is redis://...: write rediss://host:6379/0")


def _paired(first: object, second: object, first_name: str, second_name: str) -> None:
    if (first is None) != (second is None):
        raise ValueError(f"{first_name} and {second_name}: set both or neither")
