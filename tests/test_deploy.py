"""The Helm chart in deploy/helm/fleet: rendered with a real helm, every manifest validated offline.

Built-in kinds are validated against the Kubernetes JSON schemas that ``kubernetes-validate`` ships, in strict mode
(unknown fields are errors), for the oldest Kubernetes the chart supports and the newest the schemas cover. KEDA's
ScaledObject is validated against the OpenAPI schema of KEDA's own CRD, made strict the same way, and its trigger
metadata against the keys that KEDA's scalers declare. helm and KEDA are fetched once (see ``tests/deploy_tools.py``).
"""

from __future__ import annotations

import enum
import functools
import json
import os
import re
import subprocess
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import typer
import yaml

from fleet import constants as c
from fleet.brokers.nats import durable_name
from fleet.settings import FleetSettings
from tests import deploy_tools
from tests.services import require_binary

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "fleet"
EXAMPLES = ROOT / "deploy" / "examples"
RENDER_KUBE_VERSION = "1.33.0"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
SCHEMA_KUBE_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
SCENARIOS: dict[str, list[str]] = {
    "defaults": [],
    "nats-fleet": ["-f", str(EXAMPLES / "nats-fleet.yaml")],
    "kafka-keda": ["-f", str(EXAMPLES / "kafka-keda.yaml")],
    "nats-keda": ["--set", "autoscaler.engine=keda", "--set", "autoscaler.scaling.lag_per_replica=50"],
    "grafana-dashboard": ["--set", "grafanaDashboard.enabled=true"],
    "prometheus-rule": ["--set", "prometheusRule.enabled=true", "--set", "prometheusRule.labels.release=kps"],
    "no-autoscaler": [
        "--set",
        "autoscaler.enabled=false",
        "--set",
        "dispatcher.enabled=true",
        "--set",
        "workers.models.embed.routing=dispatch",
    ],
}

Manifest = dict[str, Any]
# On a cold machine the first test builds helm (minutes); every later run finds it cached and keeps the usual limit.
pytestmark = [] if deploy_tools.cached() else [pytest.mark.timeout(deploy_tools.FETCH_TIMEOUT_S)]


# -- rendering --------------------------------------------------------------------------------------------------


@functools.cache
def render(*args: str) -> tuple[Manifest, ...]:
    proc = deploy_tools.helm_template(CHART, *args, kube_version=RENDER_KUBE_VERSION)
    assert proc.returncode == 0, f"helm template {' '.join(args)} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render_error(*args: str) -> str:
    proc = deploy_tools.helm_template(CHART, *args, kube_version=RENDER_KUBE_VERSION)
    assert proc.returncode != 0, f"helm template {' '.join(args)} rendered, but it should have failed"
    return proc.stderr


def of_kind(docs: tuple[Manifest, ...], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: tuple[Manifest, ...], kind: str, component: str) -> list[Manifest]:
    return [d for d in of_kind(docs, kind) if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]


def workers(docs: tuple[Manifest, ...]) -> dict[str, Manifest]:
    """Worker Deployments by model."""
    return {d["metadata"]["labels"]["fleet/model"]: d for d in named(docs, "Deployment", "worker")}


def container(deployment: Manifest) -> Manifest:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Manifest = containers[0]
    return result


def env_of(deployment: Manifest) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(deployment).get("env", [])}


def config_data(docs: tuple[Manifest, ...]) -> dict[str, str]:
    (config,) = named(docs, "ConfigMap", "config")
    data: dict[str, str] = config["data"]
    return data


# -- validation -----------------------------------------------------------------------------------------------


def k8s_errors(doc: Manifest, kube_version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []


def _strict(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema as JSON Schema that, like kubectl's strict field validation, rejects unknown fields."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items() if not key.startswith("x-kubernetes-")}
    if schema.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    elif "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def scaledobject_validator(kube_version: str) -> jsonschema.Draft202012Validator:
    """KEDA's ScaledObject schema, with ``metadata`` checked as a Kubernetes ObjectMeta."""
    crd = deploy_tools.keda().scaledobject_crd
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    objectmeta = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    schema["properties"]["metadata"] = {"$ref": objectmeta}
    schema["properties"]["apiVersion"] = {"const": "keda.sh/v1alpha1"}
    schema["required"] = [*schema.get("required", []), "apiVersion", "kind", "metadata"]
    folder = f"kubernetes-json-schema/v{kube_version}-local-strict/_definitions.json"
    definitions = json.loads(files("kubernetes_validate").joinpath(folder).read_text(encoding="utf-8"))
    registry: referencing.Registry[Any] = referencing.Resource.from_contents(definitions) @ referencing.Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def scaledobject_errors(doc: Manifest, kube_version: str) -> list[str]:
    errors = scaledobject_validator(kube_version).iter_errors(doc)
    return [f"{'.'.join(str(p) for p in e.path)}: {e.message}" for e in errors]


# The Prometheus Operator's PrometheusRule (monitoring.coreos.com/v1), the fields of its CRD that Fleet's rules use
# or may use, strict like the others: an unknown or misspelt field is an error.
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": {
            "type": "string",
            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
        },
        "keep_firing_for": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {
            "$ref": "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string"},
                            "limit": {"type": "integer"},
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "rules": {"type": "array", "items": _RULE},
                        },
                    },
                }
            },
        },
    },
}


def prometheusrule_errors(doc: Manifest, kube_version: str) -> list[str]:
    folder = f"kubernetes-json-schema/v{kube_version}-local-strict/_definitions.json"
    definitions = json.loads(files("kubernetes_validate").joinpath(folder).read_text(encoding="utf-8"))
    registry: referencing.Registry[Any] = referencing.Resource.from_contents(definitions) @ referencing.Registry()
    errors = jsonschema.Draft202012Validator(PROMETHEUS_RULE_SCHEMA, registry=registry).iter_errors(doc)
    return [f"{'.'.join(str(p) for p in e.path)}: {e.message}" for e in errors]


VALIDATORS = {"ScaledObject": scaledobject_errors, "PrometheusRule": prometheusrule_errors}


def name_errors(doc: Manifest) -> list[str]:
    """Names and labels the schemas do not check: DNS labels (they become pod and Service host names), label values."""
    meta = doc["metadata"]
    problems = [] if DNS_LABEL.match(meta["name"]) else [f"name {meta['name']!r} is not a DNS-1123 label"]
    labels = dict(meta.get("labels", {}))
    if doc["kind"] == "Deployment":
        labels |= doc["spec"]["template"]["metadata"]["labels"]
    problems += [f"label {k}={v!r} is not a valid label value" for k, v in labels.items() if not LABEL_VALUE.match(v)]
    missing = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"} - set(labels)
    return problems + [f"missing labels {sorted(missing)}"] * bool(missing)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(scenario: str) -> None:
    docs = render(*SCENARIOS[scenario])
    assert {"ConfigMap", "Deployment", "Service"} <= {d["kind"] for d in docs}
    problems = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        for version in SCHEMA_KUBE_VERSIONS:
            validate = VALIDATORS.get(doc["kind"], k8s_errors)
            problems += [f"{where} (Kubernetes {version}): {e}" for e in validate(doc, version)]
        problems += [f"{where}: {e}" for e in name_errors(doc)]
    assert problems == []


def test_the_validators_reject_what_kubernetes_rejects() -> None:
    """The strict schemas really bite: an unknown field, a wrong type and a missing required field fail."""
    deployment = json.loads(json.dumps(workers(render())["embed"]))
    pod = deployment["spec"]["template"]["spec"]
    pod["containers"][0]["readinessProbe"]["httpGett"] = {}
    assert "httpGett" in k8s_errors(deployment, SCHEMA_KUBE_VERSIONS[0])[0]
    pod["containers"][0]["readinessProbe"].pop("httpGett")
    pod["terminationGracePeriodSeconds"] = "60"
    assert "terminationGracePeriodSeconds" in k8s_errors(deployment, SCHEMA_KUBE_VERSIONS[0])[0]
    scaled = json.loads(json.dumps(of_kind(render(*SCENARIOS["kafka-keda"]), "ScaledObject")[0]))
    scaled["spec"]["minReplicas"] = 0
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 100
    del scaled["spec"]["scaleTargetRef"]["name"]
    errors = "\n".join(scaledobject_errors(scaled, SCHEMA_KUBE_VERSIONS[-1]))
    assert "'minReplicas' was unexpected" in errors
    assert "100 is not of type 'string'" in errors
    assert "'name' is a required property" in errors
    (rule,) = of_kind(render(*SCENARIOS["prometheus-rule"]), "PrometheusRule")
    rule = json.loads(json.dumps(rule))
    rule["spec"]["groups"][0]["rules"][0]["recrod"] = "x"
    rule["spec"]["groups"][1]["rules"][0]["for"] = "two minutes"
    rule["metadata"]["labels"]["release"] = 1
    errors = "\n".join(prometheusrule_errors(rule, SCHEMA_KUBE_VERSIONS[-1]))
    assert "'recrod' was unexpected" in errors
    assert "'two minutes' does not match" in errors
    assert "1 is not of type 'string'" in errors


# -- the processes run real `fleet` commands -------------------------------------------------------------------

AUTOSCALER_FLAGS = {"default_throughput": "default_throughput_per_replica"}  # CLI parameter -> ScalingConfig field


def cli_params(deployment: Manifest) -> dict[str, Any]:
    """Parse the container's args with the real ``fleet`` CLI, as the pod would (``$(VAR)`` expanded), without running
    the command: every flag must exist and every value must convert."""
    from fleet.cli import app

    spec = container(deployment)
    assert spec["command"] == ["fleet"]
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = {"metadata.name": "pod-0", "metadata.namespace": "fleet-ns"}.get(field, var.get("value", ""))
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in spec["args"]]
    commands: dict[str, Any] = getattr(typer.main.get_command(app), "commands", {})
    command = commands.get(argv[0])
    assert command is not None, f"'fleet {argv[0]}' is not a command"
    with command.make_context(f"fleet {argv[0]}", argv[1:]) as ctx:
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in ctx.params.items()}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_container_runs_a_fleet_command_with_flags_the_cli_accepts(scenario: str) -> None:
    commands = {}
    for deployment in of_kind(render(*SCENARIOS[scenario]), "Deployment"):
        params = cli_params(deployment)
        commands[container(deployment)["args"][0]] = params
        assert params.get("broker") is None and params.get("store") is None, "URLs come from the ConfigMap"
    assert {"gateway", "worker"} <= set(commands)
    assert commands["gateway"]["host"] == "0.0.0.0" and commands["gateway"]["port"] == 8000
    if "dispatcher" in commands:
        assert commands["dispatcher"]["host"] == "0.0.0.0" and commands["dispatcher"]["port"] == 9000


# -- workers ----------------------------------------------------------------------------------------------------


def test_one_worker_deployment_per_model_running_fleet_worker() -> None:
    docs = render(*SCENARIOS["nats-fleet"])
    by_model = workers(docs)
    assert sorted(by_model) == ["echo", "embed", "rerank_v2"]
    assert by_model["rerank_v2"]["metadata"]["name"] == "fleet-test-worker-rerank-v2"
    params = cli_params(by_model["rerank_v2"])
    assert (params["model"], params["metrics_port"], params["worker_id"]) == ("mymodels.rerank:Reranker", 9100, "pod-0")
    assert config_data(docs)["FLEET_MODELS"] == "echo,embed,mymodels.rerank:Reranker"
    assert config_data(docs)["FLEET_ROUTING"] == "echo=dispatch"
    (dispatcher,) = named(docs, "Deployment", "dispatcher")
    assert cli_params(dispatcher)["model"] == ["echo"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_worker_grace_period_exceeds_its_drain_deadline(scenario: str) -> None:
    docs = render(*SCENARIOS[scenario])
    for model, deployment in workers(docs).items():
        drain_s = float(env_of(deployment)["FLEET_DRAIN_TIMEOUT_S"])
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s > drain_s, f"{model}: grace {grace_s}s <= drain {drain_s}s"
    if scenario == "nats-fleet":
        drains = {m: env_of(d)["FLEET_DRAIN_TIMEOUT_S"] for m, d in workers(docs).items()}
        assert drains == {"echo": "45", "embed": "45", "rerank_v2": "120"}
        assert config_data(docs)["FLEET_DRAIN_TIMEOUT_S"] == "45"


@pytest.mark.parametrize(
    ("args", "model"),
    [
        (["--set", "workers.defaults.terminationGracePeriodSeconds=30"], "embed"),  # equal to the default 30 s
        (["--set", "drainTimeoutSeconds=90"], "embed"),
        (["--set", "workers.models.big.drainTimeoutSeconds=75", "--set", "workers.models.big.gpu=false"], "big"),
    ],
)
def test_rendering_fails_when_the_grace_period_does_not_exceed_the_drain_deadline(args: list[str], model: str) -> None:
    message = render_error(*args)
    assert f"workers.models.{model}: terminationGracePeriodSeconds" in message
    assert "must be greater than the drain deadline" in message


def test_by_default_every_pod_runs_the_image_make_image_builds_as_a_non_root_user() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == version
    deployments = of_kind(render(), "Deployment")
    assert {container(d)["image"] for d in deployments} == {f"localhost/fleet-inference:{version}"}
    assert all(d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] for d in deployments)
    pushed = render("--set", "image.repository=registry.example.com/ml/fleet-inference", "--set", "image.tag=1.2-cuda")
    assert {container(d)["image"] for d in of_kind(pushed, "Deployment")} == {
        "registry.example.com/ml/fleet-inference:1.2-cuda"
    }


def test_gpu_workers_request_and_limit_nvidia_gpus() -> None:
    by_model = workers(render(*SCENARIOS["nats-fleet"]))
    for model, gpus in (("embed", 1), ("rerank_v2", 2)):
        resources = container(by_model[model])["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["limits"]["memory"] == "16Gi"  # the defaults' other limits are kept
        tolerations = by_model[model]["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    cpu_only = by_model["echo"]
    assert "nvidia.com/gpu" not in json.dumps(cpu_only)
    assert container(cpu_only)["resources"] == {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"memory": "1Gi"},
    }


def test_autoscaled_workers_leave_the_replica_count_to_the_autoscaler() -> None:
    for scenario in ("defaults", "kafka-keda"):
        assert all("replicas" not in d["spec"] for d in workers(render(*SCENARIOS[scenario])).values())
    static = render(*SCENARIOS["no-autoscaler"], "--set", "workers.models.embed.replicas=3")
    assert workers(static)["embed"]["spec"]["replicas"] == 3
    assert not of_kind(static, "Role") and not of_kind(static, "ScaledObject")


# -- probes, config, metrics ------------------------------------------------------------------------------------


def test_probes_hit_each_process_health_endpoints() -> None:
    docs = render(*SCENARIOS["no-autoscaler"])
    (gateway,) = named(docs, "Deployment", "gateway")
    probes = container(gateway)
    assert probes["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert probes["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container(gateway)["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    (dispatcher,) = named(docs, "Deployment", "dispatcher")
    assert container(dispatcher)["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container(dispatcher)["ports"][0]["containerPort"] == 9000
    assert probes["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # the gateway retries its broker and store for FLEET_STARTUP_TIMEOUT_S (60 s) before it listens
    assert probes["startupProbe"]["periodSeconds"] * probes["startupProbe"]["failureThreshold"] >= 90
    worker = container(workers(docs)["embed"])
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}  # 200 once warm
    assert worker["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # generous: a model load takes minutes
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]


def test_a_model_can_give_its_workers_a_longer_start_up() -> None:
    docs = render(*SCENARIOS["no-autoscaler"], "--set", "workers.models.embed.startupProbe.failureThreshold=120")
    startup = container(workers(docs)["embed"])["startupProbe"]
    assert startup == {"httpGet": {"path": "/readyz", "port": "metrics"}, "failureThreshold": 120}
    error = render_error(*SCENARIOS["no-autoscaler"], "--set", "workers.defaults.startupProbe.exec=x")
    assert "startupProbe" in error


def test_pods_that_serve_metrics_carry_prometheus_scrape_annotations() -> None:
    for deployment in of_kind(render(*SCENARIOS["nats-fleet"]), "Deployment"):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        ports = {p["containerPort"] for p in container(deployment)["ports"]}
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) in ports
        assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])


def test_shared_config_is_fleet_settings_that_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConfigMap's keys, set as a pod's environment, are FleetSettings that validate."""
    docs = render(*SCENARIOS["nats-fleet"])
    data = config_data(docs)
    assert {key.removeprefix("FLEET_").lower() for key in data} <= set(FleetSettings.model_fields)
    for key in [k for k in os.environ if k.startswith("FLEET_")]:
        monkeypatch.delenv(key)
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    settings = FleetSettings()
    assert settings.broker_url == "nats://nats.messaging.svc:4222"
    assert settings.store_url == "redis://redis-master.data.svc:6379/0"
    assert settings.max_batch == 64 and settings.drain_timeout_s == 45.0
    assert settings.models == ["echo", "embed", "mymodels.rerank:Reranker"]
    for deployment in of_kind(docs, "Deployment"):
        sources = container(deployment)["envFrom"]
        assert sources == [
            {"configMapRef": {"name": "fleet-test-config"}},
            {"secretRef": {"name": "fleet-secrets"}},
        ], "the Secret must come last so that its keys win"


def test_the_grafana_dashboard_ships_as_a_sidecar_config_map_only_when_enabled() -> None:
    def dashboards(docs: tuple[Manifest, ...]) -> list[Manifest]:
        config_maps = of_kind(docs, "ConfigMap")
        return [d for d in config_maps if d["metadata"]["labels"]["app.kubernetes.io/component"] == "dashboard"]

    assert dashboards(render()) == [], "off by default: not every cluster runs Grafana's sidecar"
    docs = render(*SCENARIOS["grafana-dashboard"], "--set", "grafanaDashboard.annotations.grafana_folder=Fleet")
    (config_map,) = dashboards(docs)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1", "the label kube-prometheus-stack selects"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Fleet"}
    shipped = json.loads(config_map["data"]["fleet.json"])
    assert shipped == json.loads((CHART / "dashboards" / "fleet.json").read_text())


def prometheus_rules(docs: tuple[Manifest, ...]) -> list[Manifest]:
    return of_kind(docs, "PrometheusRule")


def test_the_alert_rules_ship_as_a_prometheus_rule_only_when_enabled_and_equal_to_the_rules_file() -> None:
    assert prometheus_rules(render()) == [], "off by default: the Prometheus Operator's CRDs may not be installed"
    (rule,) = prometheus_rules(render(*SCENARIOS["prometheus-rule"]))
    assert rule["metadata"]["labels"]["release"] == "kps", "the label the operator's ruleSelector picks"
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "fleet-alerts.yaml").read_text())
    assert rule["spec"] == shipped, "the chart renders the one rules file as it is"


def test_the_rendered_prometheus_rule_passes_promtool_with_runbook_links(tmp_path: Path) -> None:
    base = "https://git.example.com/ml/fleet/blob/main/"
    (rule,) = prometheus_rules(render(*SCENARIOS["prometheus-rule"], "--set", f"prometheusRule.runbookBaseUrl={base}"))
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(url.startswith(f"{base}docs/operations/runbooks.md#") for url in urls)
    rendered = tmp_path / "rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    promtool = require_binary("promtool", "prometheus", "promtool (Prometheus)")
    proc = subprocess.run([promtool, "check", "rules", str(rendered)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_secret_can_be_rendered_by_the_chart() -> None:
    docs = render(*SCENARIOS["kafka-keda"])
    (secret,) = of_kind(docs, "Secret")
    assert secret["stringData"] == {"FLEET_STORE_URL": "redis://:change-me@redis:6379/0"}
    assert {"secretRef": {"name": secret["metadata"]["name"]}} in container(workers(docs)["embed"])["envFrom"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "workers.models.Embed.gpu=true"], "'Embed' does not match pattern"),
        (["--set", "autoscaler.engine=hpa"], "autoscaler/engine"),
        (["--set", "broker.url=memory://"], "broker/url"),
        (["--set", "workers.defaults.gpus=1"], "'gpus'"),
        (["--set", "autoscaler.engine=keda"], "autoscaler.engine=keda needs scaling.lag_per_replica"),
        (["--set", "autoscaler.scaling.min_replicas=5"], "min_replicas (5) is above max_replicas (4)"),
        (["--set", "workers.models.embed.scaling.max_replicas=2"], "embed.scaling needs autoscaler.engine=keda"),
        (["--set", "workers.models.embed.routing=dispatch"], "routing is dispatch, but dispatcher.enabled is false"),
        (["--set", "dispatcher.enabled=true"], "no model has routing: dispatch"),
        (["--set", "prometheusRule.runbookBaseUrl=git.example.com/fleet"], "runbookBaseUrl"),
        (["--set", "prometheusRule.enable=true"], "'enable'"),
    ],
)
def test_bad_values_are_rejected_with_a_message_naming_them(args: list[str], expected: str) -> None:
    assert expected in render_error(*args)


# -- the Fleet autoscaler -----------------------------------------------------------------------------------------


def test_the_autoscaler_role_grants_only_the_scale_of_its_worker_deployments() -> None:
    docs = render(*SCENARIOS["nats-fleet"])
    (role,) = of_kind(docs, "Role")
    names = sorted(d["metadata"]["name"] for d in workers(docs).values())
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": names,
            "verbs": ["get", "patch", "update"],
        }
    ]
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    (binding,) = of_kind(docs, "RoleBinding")
    (account,) = of_kind(docs, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    sa = account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "fleet-ns"}]
    for deployment in of_kind(docs, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        is_autoscaler = deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "autoscaler"
        assert pod.get("serviceAccountName") == (sa if is_autoscaler else None)
        assert pod["automountServiceAccountToken"] is is_autoscaler, "only the autoscaler talks to the API server"


def test_the_autoscaler_scales_exactly_the_worker_deployments_with_the_chart_scaling() -> None:
    from kubernetes.client import ApiClient

    from fleet.autoscaler.backends.kubernetes import KubernetesBackend
    from fleet.autoscaler.config import ScalingConfig

    docs = render(*SCENARIOS["nats-fleet"])
    (autoscaler,) = named(docs, "Deployment", "autoscaler")
    assert autoscaler["spec"]["replicas"] == 1 and autoscaler["spec"]["strategy"] == {"type": "Recreate"}
    params = cli_params(autoscaler)
    assert params["backend"] == "kubernetes" and params["model"] == ()  # every model of FLEET_MODELS
    api = ApiClient()
    try:
        backend = KubernetesBackend(params["namespace"], params["deployment_template"], api_client=api)
        assert {m: backend.deployment_name(m) for m in workers(docs)} == {
            m: d["metadata"]["name"] for m, d in workers(docs).items()
        }
    finally:
        api.close()
    assert params["namespace"] == "fleet-ns"  # $(POD_NAMESPACE), from the pod's own namespace
    flags = {AUTOSCALER_FLAGS.get(name, name): value for name, value in params.items()}
    config = ScalingConfig.model_validate({f: flags[f] for f in ScalingConfig.model_fields if flags.get(f) is not None})
    assert (config.min_replicas, config.max_replicas, config.mode) == (0, 8, "rate")
    assert (config.target_drain_s, config.predictive_horizon_s, config.scale_down_stabilization_s) == (20, 40, 120)


# -- KEDA -------------------------------------------------------------------------------------------------------


def scaler_keys(source: str, struct: str) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """(trigger metadata keys, the required ones, enums) that a KEDA scaler's metadata struct declares."""
    body = re.search(rf"type {struct} struct \{{(.*?)\n\}}", source, re.S)
    assert body is not None, f"KEDA's source has no struct {struct}"
    known, required, enums = set(), set(), {}
    for tag in re.findall(r'keda:"([^"]+)"', body.group(1)):
        fields = dict(part.strip().partition("=")[::2] for part in tag.split(","))
        if "triggerMetadata" not in fields.get("order", ""):
            continue
        known.add(fields["name"])
        if "optional" not in fields and "default" not in fields:
            required.add(fields["name"])
        if "enum" in fields:
            enums[fields["name"]] = set(fields["enum"].split(";"))
    return known, required, enums


def scaled_objects(docs: tuple[Manifest, ...]) -> dict[str, Manifest]:
    return {d["metadata"]["labels"]["fleet/model"]: d for d in of_kind(docs, "ScaledObject")}


@pytest.mark.parametrize("scenario", ["kafka-keda", "nats-keda"])
def test_the_keda_engine_renders_one_scaled_object_per_model_and_no_fleet_autoscaler(scenario: str) -> None:
    docs = render(*SCENARIOS[scenario])
    by_model = scaled_objects(docs)
    assert set(by_model) == set(workers(docs)) and len(by_model) == len(of_kind(docs, "ScaledObject"))
    for model, scaled in by_model.items():
        target = scaled["spec"]["scaleTargetRef"]
        assert target == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": workers(docs)[model]["metadata"]["name"],
        }
    assert not named(docs, "Deployment", "autoscaler")
    assert not {"Role", "RoleBinding", "ServiceAccount"} & {d["kind"] for d in docs}


def test_keda_triggers_follow_fleets_names_and_scaling_settings() -> None:
    kafka = scaled_objects(render(*SCENARIOS["kafka-keda"]))
    echo = kafka["echo"]["spec"]
    assert (echo["minReplicaCount"], echo["maxReplicaCount"], echo["cooldownPeriod"]) == (0, 2, 120)
    behavior = echo["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 4, "periodSeconds": 5}]
    (trigger,) = echo["triggers"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["bootstrapServers"] == "kafka-0.kafka.svc:9092,kafka-1.kafka.svc:9092"
    assert trigger["metadata"]["topic"] == c.request_subject("echo")
    assert trigger["metadata"]["consumerGroup"] == c.consumer_name("echo")
    assert (trigger["metadata"]["lagThreshold"], trigger["metadata"]["activationLagThreshold"]) == ("1000", "5")
    (trigger,) = scaled_objects(render(*SCENARIOS["nats-keda"]))["embed"]["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    assert trigger["metadata"]["stream"] == c.REQ_STREAM
    assert trigger["metadata"]["consumer"] == durable_name(c.request_subject("embed"), c.consumer_name("embed"))
    assert trigger["metadata"]["natsServerMonitoringEndpoint"] == "nats:8222"


@pytest.mark.parametrize(
    ("scenario", "scaler", "struct"),
    [
        ("kafka-keda", "kafka_scaler.go", "kafkaMetadata"),
        ("nats-keda", "nats_jetstream_scaler.go", "natsJetStreamMetadata"),
    ],
)
def test_keda_trigger_metadata_uses_only_keys_the_scaler_declares(scenario: str, scaler: str, struct: str) -> None:
    known, required, enums = scaler_keys(deploy_tools.keda().scaler_source(scaler), struct)
    assert {"lagThreshold", "activationLagThreshold"} <= known  # the parse found the struct's tags
    for scaled in of_kind(render(*SCENARIOS[scenario]), "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            metadata = trigger["metadata"]
            assert set(metadata) <= known, f"keys KEDA does not know: {set(metadata) - known}"
            assert required <= set(metadata), f"required keys missing: {required - set(metadata)}"
            for key, allowed in enums.items():
                assert metadata.get(key, next(iter(allowed))) in allowed


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict_passes_including_the_install_notes(scenario: str) -> None:
    proc = deploy_tools.run_helm(
        "lint", "--strict", str(CHART), "--kube-version", RENDER_KUBE_VERSION, *SCENARIOS[scenario]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
