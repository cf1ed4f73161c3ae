"""Every name Fleet puts on the wire or in Redis, and the defaults that go with them.

Subjects use NATS dot notation; the Kafka broker maps them to topic names (see ``fleet.brokers.kafka``).
"""

from __future__ import annotations

import re

# -- subjects -------------------------------------------------------------------------------------------------
SUBJECT_PREFIX = "fleet"
REQ_PREFIX = f"{SUBJECT_PREFIX}.req"
DLQ_PREFIX = f"{SUBJECT_PREFIX}.dlq"
INBOX_PREFIX = f"{SUBJECT_PREFIX}.inbox"
CTL_PREFIX = f"{SUBJECT_PREFIX}.ctl"
HEARTBEAT_PREFIX = f"{CTL_PREFIX}.heartbeat"
IDLE_PREFIX = f"{CTL_PREFIX}.idle"
DISPATCHER_PREFIX = f"{CTL_PREFIX}.dispatcher"
DRAIN_PREFIX = f"{CTL_PREFIX}.drain"

# JetStream streams: one for requests, one for dead letters.
REQ_STREAM = "FLEET_REQ"
DLQ_STREAM = "FLEET_DLQ"

# Model names become subject tokens, topic names and Redis keys, so they are restricted.
MODEL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")

# Message headers.
HEADER_MSG_ID = "Nats-Msg-Id"  # JetStream de-duplication header; Kafka uses the message key
HEADER_JOB_ID = "fleet-job-id"
HEADER_MODEL = "fleet-model"
HEADER_TRACEPARENT = "traceparent"  # W3C trace context of the request (RequestMessage.traceparent)
HEADER_TRACESTATE = "tracestate"
HEADER_VERSION = "fleet-version"  # on a request: the model version it is for (RequestMessage.version)
SHADOW_JOB_SUFFIX = ".shadow"  # a shadow copy's job id: the mirrored job's id and this (no client may choose one)
HEADER_ERROR = "fleet-error"
HEADER_DELIVERIES = "fleet-deliveries"
HEADER_DISPATCHER = "fleet-dispatcher"  # on an inbox message: the dispatcher that assigned it
HEADER_CACHE_CONTROL = "X-Cache-Control"  # on POST /v1/jobs: 'bypass' skips the result caches
HEADER_TOKEN = "fleet-idle-token"  # on an inbox message: the worker's idle token it used, when it used one
# On a request: what its producer knows of its record. RECORD_NONE (``fleet publish``, ``publish_all``): the producer
# made none, so the worker's start creates it without reading first (a copy finds the record all the same).
HEADER_RECORD = "fleet-record"
RECORD_NONE = "none"


# Priority levels, highest first. Each has its own request subject (topic on Kafka) and group, so that a worker can
# take higher levels first (``fleet.brokers.prioritized``); "normal" keeps the plain subject and group names, so
# producers and consumers that know nothing of priorities keep working.
PRIORITIES = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"
# How often each level leads a fetch round, in that order (``fleet.priorities``): low leads 1 round in 10.
DEFAULT_PRIORITY_WEIGHTS = (6, 3, 1)


def request_subject(model: str, priority: str = DEFAULT_PRIORITY) -> str:
    """``fleet.req.<model>`` for normal priority, ``fleet.req.<model>.high`` / ``.low`` for the others."""
    return f"{REQ_PREFIX}.{model}{_level_suffix(priority, '.')}"


def dlq_subject(model: str) -> str:
    return f"{DLQ_PREFIX}.{model}"


def _level_suffix(priority: str, sep: str) -> str:
    if priority == DEFAULT_PRIORITY:
        return ""
    if priority not in PRIORITIES:
        raise ValueError(f"priority {priority!r} is not one of {', '.join(PRIORITIES)}")
    return f"{sep}{priority}"


def inbox_subject(worker_id: str, priority: str = DEFAULT_PRIORITY) -> str:
    """A worker's inbox (direct assignment), one per priority level like the request subjects:
    ``fleet.inbox.<worker>`` for normal, ``fleet.inbox.<worker>.high`` / ``.low``."""
    return f"{INBOX_PREFIX}.{worker_id}{_level_suffix(priority, '.')}"


def heartbeat_subject(model: str) -> str:
    return f"{HEARTBEAT_PREFIX}.{model}"


def idle_subject(model: str, dispatcher_id: str) -> str:
    """Where a worker announces itself idle to one dispatcher (and retracts the announcement)."""
    return f"{IDLE_PREFIX}.{model}.{dispatcher_id}"


def dispatcher_subject(model: str) -> str:
    """Dispatcher heartbeats: id, policy, idle-queue length; workers read them to pick where to announce."""
    return f"{DISPATCHER_PREFIX}.{model}"


def drain_subject(worker_id: str) -> str:
    """An operator's request that one worker drain and stop (``POST /v1/workers/{worker_id}/drain``)."""
    return f"{DRAIN_PREFIX}.{worker_id}"


def inbox_group(worker_id: str, priority: str = DEFAULT_PRIORITY) -> str:
    """The one group on a worker's inbox (of one priority level): the worker itself."""
    return f"fleet-inbox-{worker_id}{_level_suffix(priority, '-')}"


def consumer_name(model: str, priority: str = DEFAULT_PRIORITY) -> str:
    """Durable consumer (NATS) or consumer group (Kafka) shared by all workers of a model, one per priority level:
    ``fleet-<model>`` for normal, ``fleet-<model>-high`` / ``-low`` (a group of its own, so that on Kafka a member
    joining one level does not rebalance the others)."""
    return f"fleet-{model}{_level_suffix(priority, '-')}"


# -- Redis keys -----------------------------------------------------------------------------------------------
KEY_PREFIX = "fleet"


# On a Redis Cluster (fleet.store.cluster): the unpublished marks in one slot, and completion channels
# fleet:done:{<job key>} that hash to their record's slot (sharded pub/sub).
PENDING_KEY_CLUSTER = "fleet:{pending}"
DONE_PREFIX_CLUSTER = "fleet:done:{"


def job_key(job_id: str) -> str:
    return f"{KEY_PREFIX}:job:{job_id}"


def done_channel(job_id: str) -> str:
    """Pub/sub channel on which the terminal record of one job is announced."""
    return f"{KEY_PREFIX}:done:{job_id}"


# Jobs the gateway wrote ``queued`` but has not yet seen the broker acknowledge: a sorted set of job ids scored by
# the (Redis) time they were written or last claimed by a reconcile sweep, and each one's request message.
PENDING_KEY = f"{KEY_PREFIX}:pending"


def pending_message_key(job_id: str) -> str:
    """The request message of a job in ``PENDING_KEY``, kept so that a reconcile sweep can publish it."""
    return f"{PENDING_KEY}:{job_id}"


# The job index (``fleet.store.jobindex``): sorted sets of job ids scored by ``created_at`` (unix seconds), one per
# tenant and one per tenant and model, plus the same two for every tenant together (the operator's listing). A
# tenant's keys carry the hash tag ``{<tenant>}`` and the all-tenant keys ``{_all}`` (no tenant name starts with
# ``_``), so each group shares a Redis Cluster slot. Entries live as long as the record TTL (trimmed by age on write
# and lazily when a page meets an expired record).
JOB_INDEX_ALL = "_all"


def job_index_key(tenant: str | None, model: str | None = None) -> str:
    """The index of ``tenant``'s jobs (None: every tenant's), of one ``model`` or of all (None)."""
    tag = JOB_INDEX_ALL if tenant is None else tenant
    base = f"{KEY_PREFIX}:jobindex:{{{tag}}}"
    return base if model is None else f"{base}:m:{model}"


JOB_LIST_DEFAULT_LIMIT = 50  # GET /v1/jobs: jobs per page unless ?limit says otherwise
JOB_LIST_MAX_LIMIT = 500
JOB_LIST_SCAN_MAX = 2_000  # index entries (and records) one listing request reads at most (a state filter skips)
JOB_BATCH_MAX_ITEMS = 1_000  # POST /v1/jobs:batch: items per request


def dag_key(run_id: str) -> str:
    """A DAG run's document: its state (every step, item and output), version, key, times (``fleet.dagstore``);
    ``run_id`` is ``<tenant>:<run>`` for a tenant other than the default (``fleet.dags.runner.store_id``)."""
    return f"{KEY_PREFIX}:dag:{run_id}"


DAG_SPECS_KEY = f"{KEY_PREFIX}:dagspecs"  # set of registered DAG names (``<tenant>:<name>``, bare for the default)


def dag_spec_key(name: str) -> str:
    """Hash of a DAG's registered versions: field ``<n>`` the spec as JSON, ``latest`` the newest n. A tenant's DAG
    is ``<tenant>:<name>`` (``fleet.dags.state.scoped``; the default tenant's is the bare name)."""
    return f"{KEY_PREFIX}:dagspec:{name}"


def dag_events_channel(run_id: str) -> str:
    """Pub/sub channel that carries a run's document after each change (WebSocket and SSE followers)."""
    return f"{KEY_PREFIX}:dagevents:{run_id}"


DAG_RECENT_RUNS_KEY = f"{KEY_PREFIX}:dagruns:recent"  # sorted set: run id scored by its start (unix seconds)
DEFAULT_RECENT_RUNS_KEPT = 200  # runs the recent-runs index keeps (the dashboard shows the newest 20)

DAG_START_SUBJECT = "fleet.req._dagrun"  # publish {"dag", "input", "run_id"?} here to start a run (no gateway)


def scale_key(model: str) -> str:
    """The autoscaler's latest status of one model (JSON of ``fleet.schemas.scaling.ScalingStatus``)."""
    return f"{KEY_PREFIX}:scale:{model}"


def scale_decisions_key(model: str) -> str:
    """Recent scaling decisions of one model, newest first (a capped list)."""
    return f"{scale_key(model)}:decisions"


def scale_overrides_key(model: str) -> str:
    """Operator overrides of one model's min/max replicas and pause (a hash set by ``PUT /v1/scaling/{model}``)."""
    return f"{scale_key(model)}:overrides"


def dead_letter_key(letter_id: str) -> str:
    """One recorded dead letter: JSON ``{"model", "letter"}`` (``fleet.store.deadletters``), with a TTL."""
    return f"{KEY_PREFIX}:dlqletter:{letter_id}"


def dead_letter_index_key(model: str) -> str:
    """A model's recorded dead letters: a sorted set of letter ids scored by the time the job failed."""
    return f"{KEY_PREFIX}:dlqindex:{model}"


DEAD_LETTER_MODELS_KEY = f"{KEY_PREFIX}:dlqmodels"  # set of models with recorded dead letters
DEAD_LETTER_GROUP = "fleet-dlq-recorder"  # the one consumer group of every gateway's dead-letter recorder
DEAD_LETTER_TTL_S = 7 * 24 * 3600  # as long as the NATS dead-letter stream keeps a letter


def cache_entry_key(model: str, version: str, digest: str) -> str:
    """An L2 result-cache entry: the output of a succeeded job of ``model`` at ``version`` whose key digest
    (model, version, canonical input) is ``digest``; JSON ``{"output", "text"}`` with a TTL."""
    return f"{KEY_PREFIX}:cache:{model}:{version}:{digest}"


def cache_vectors_key(model: str, version: str) -> str:
    """The L3 (semantic) entries of ``model`` at ``version``: a capped stream of ``{key, text, vector}`` that every
    gateway tails into its FAISS index and replays after a restart."""
    return f"{KEY_PREFIX}:cachevec:{model}:{version}"


CACHE_LEVELS = ("l1", "l2", "l3")  # the result-cache levels, in lookup order (FLEET_CACHE)


# -- API keys and the audit log (``fleet.store.keys``, ``fleet.store.audit``) ---------------------------------
API_KEY_PREFIX = "fleet"  # a key reads ``fleet_<key id>_<secret>``: the id finds its record, the secret proves it
API_KEY_ID_BYTES = 6  # 12 hex digits
API_KEY_SECRET_BYTES = 32  # 256 random bits from ``secrets``, URL-safe base64
API_KEYS_KEY = f"{KEY_PREFIX}:apikeys"  # set of every key id, for ``fleet keys list``
AUDIT_STREAM_KEY = f"{KEY_PREFIX}:audit"  # the audit log of operator actions: a capped stream
# The manifests of the repository models workers serve: a hash, model name -> {"version", "manifest"} (JSON), so a
# gateway without the repository folder validates their inputs (fleet.store.manifests).
MODEL_MANIFESTS_KEY = f"{KEY_PREFIX}:models:manifest"


def model_manifest_versions_key(name: str) -> str:
    """A hash per model, version -> manifest (JSON): every version its workers published, for traffic policies."""
    return f"{KEY_PREFIX}:models:manifest:{name}"


AUDIT_MAX_ENTRIES = 10_000  # the audit stream keeps about this many of the newest entries
ROLES = ("submitter", "operator", "admin")  # each role holds the ones before it
DEFAULT_TENANT = "default"  # the tenant of every request when FLEET_AUTH=off


# -- traffic policies, rollouts and their measurements (fleet.store.rollouts) -----------------------------------
# A model's keys carry the hash tag ``{<model>}``, so its document and counts share one Redis Cluster slot.
ROLLOUT_MODELS_KEY = f"{KEY_PREFIX}:rollouts"  # set of the models that have a traffic policy


def rollout_key(model: str) -> str:
    """The model's ``RolloutDoc``: traffic policy, controller and breaker state (JSON, compare-and-set)."""
    return f"{KEY_PREFIX}:rollout:{{{model}}}"


def rollout_decisions_key(model: str) -> str:
    return f"{KEY_PREFIX}:rollout:{{{model}}}:decisions"


def rollout_stats_key(model: str, version: str, bucket: int) -> str:
    return f"{KEY_PREFIX}:rollout:{{{model}}}:stats:{version}:{bucket}"


def rollout_compared_key(model: str, job_id: str) -> str:
    return f"{KEY_PREFIX}:rollout:{{{model}}}:compared:{job_id}"


def rollout_tally_key(model: str, version: str) -> str:
    """A version's running tally for its breaker: failures in a row, outcomes and failures in all, and the times of
    the latest success and failure (a hash, ``fleet.store.rollouts.Tally``)."""
    return f"{KEY_PREFIX}:rollout:{{{model}}}:tally:{version}"


ROLLOUT_LOCK_KEY = f"{KEY_PREFIX}:rollouts:_lock"  # held by the one rollout controller that acts


def rollout_comparisons_key(model: str) -> str:
    """The model's recent shadow comparisons, newest first (a capped list of JSON ``ComparisonEntry``)."""
    return f"{KEY_PREFIX}:rollout:{{{model}}}:comparisons"


# -- per-tenant rate limits and queued-job quotas (fleet.store.quotas) ----------------------------------------
# Both keys of a tenant carry the hash tag ``{tenant}``, so they share one Redis Cluster slot and one script
# touches both.
def rate_key(tenant: str) -> str:
    """The tenant's GCRA state: its theoretical arrival time in Redis microseconds."""
    return f"{KEY_PREFIX}:rate:{{{tenant}}}"


def queued_key(tenant: str) -> str:
    """The tenant's queued jobs: a sorted set of job ids scored by when their hold ends (Redis seconds)."""
    return f"{KEY_PREFIX}:queued:{{{tenant}}}"


QUOTA_SWEEP_INTERVAL_S = 1.0  # a tenant at its bound: its members' records are re-read at most this often
QUOTA_SWEEP_MAX_IDS = 1000  # the oldest members a sweep re-reads
QUOTA_RELEASE_TIMEOUT_S = 2.0  # the settle path's release of a batch gives up after this (the hold ends anyway)
QUOTA_HOLD_SLACK_S = 60.0  # a job with a deadline is held this long past it (a worker expires it by then)
KEY_CACHE_TTL_S = 1.0  # a gateway trusts a key it read this long: a revocation elsewhere takes effect within it
KEY_CACHE_MAX_ENTRIES = 10_000


def api_key_key(key_id: str) -> str:
    """One API key: a hash of its sha256 digest, tenant, role, created/expires/revoked times (never the key)."""
    return f"{KEY_PREFIX}:apikey:{key_id}"


# A leading underscore cannot start a model name (MODEL_NAME_RE), so these never collide with ``scale_key(model)``.
SCALE_LOCK_KEY = f"{KEY_PREFIX}:scale:_lock"  # held by the one autoscaler that acts
SCALE_MODELS_KEY = f"{KEY_PREFIX}:scale:_models"  # set of models with scaling state


# Load-balancing policies of the dispatcher (``fleet.dispatcher.policies``); named here so settings can check them.
DISPATCH_POLICIES = (
    "random",
    "round-robin",
    "power-of-d",
    "least-outstanding",
    "peak-ewma",
    "jiq-random",
    "jiq-sq",
    "jiq-amnesia",
    "jiq-sed",
)

# -- defaults -------------------------------------------------------------------------------------------------
DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_WAIT_MS = 5
DEFAULT_ACK_WAIT_S = 30.0
DEFAULT_MAX_DELIVERIES = 5
DEFAULT_JOB_TTL_S = 24 * 3600
DEFAULT_DEDUP_WINDOW_S = 120.0
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
# The buckets of fleet_job_latency_seconds (creation to terminal write); a latency SLO's threshold is one of them,
# so that the alert rules read the share of slower jobs from one bucket (deploy/prometheus/fleet-alerts.yaml).
JOB_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_LONG_POLL_S = 60.0
DEFAULT_INFER_WAIT_S = 30.0  # how long POST /v1/infer holds a request when it names no ?wait
DEFAULT_AUTOSCALER_INTERVAL_S = 2.0
DEFAULT_ROLLOUT_INTERVAL_S = 2.0
DEFAULT_ROLLOUT_WINDOW_S = 60.0
DEFAULT_SCALING_DECISIONS_KEPT = 50
DEFAULT_MAX_QUEUED = 100_000  # requests waiting or in flight per model (FLEET_MAX_QUEUED; 0: unbounded)
DEFAULT_RECONCILE_AFTER_S = 30.0
DEFAULT_CACHE_L1_MAX_ENTRIES = 100_000  # per gateway, every cached model together
DEFAULT_CACHE_L1_TTL_S = 300.0
DEFAULT_CACHE_L2_TTL_S = 3600
DEFAULT_CACHE_L3_MAX_ENTRIES = 100_000  # per model and version, in each gateway's index and in the shared stream


# -- usage: device-seconds per tenant, model, version and device kind (fleet.store.usage) -------------------------
# One hash per hour of wall-clock time; its hash tag ``{<bucket>}`` keeps each hour in one Redis Cluster slot, so a
# worker's write of what its settled batches counted (all in the current hour) is one key, one pipeline round trip.
USAGE_BUCKET_S = 3600  # the counts' time resolution: a usage query's range is widened to whole buckets
USAGE_TTL_S = 40 * 86400  # each bucket is kept this long after its last write (retention)
USAGE_MAX_RANGE_S = 31 * 86400  # the longest range one query sums (744 buckets, one pipeline)


def usage_key(bucket: int) -> str:
    """The usage counts of one ``USAGE_BUCKET_S`` bucket (``int(unix seconds // USAGE_BUCKET_S)``): a hash whose
    fields are ``<tenant>|<model>|<version>|<device kind>|<jobs, items or ds>``."""
    return f"{KEY_PREFIX}:usage:{{{bucket}}}"
