{{/* Names ------------------------------------------------------------------------------------------------- */}}

{{- define "fleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-fleet", or the release name alone when it already contains the chart name. */}}
{{- define "fleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's resource name; fails instead of truncating, so two names can never collide. */}}
{{- define "fleet.componentName" -}}
{{- $name := printf "%s-%s" (include "fleet.fullname" .root) .component }}
{{- if gt (len $name) 63 }}
{{- fail (printf "resource name %q is longer than 63 characters: shorten the release name, set fullnameOverride, or use a shorter model name" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* The worker Deployment of a model: "<fullname>-worker-<model>", "_" becoming "-" (not allowed in names). */}}
{{- define "fleet.workerName" -}}
{{- include "fleet.componentName" (dict "root" .root "component" (printf "worker-%s" (.model | replace "_" "-"))) }}
{{- end }}

{{- define "fleet.configName" -}}
{{- include "fleet.componentName" (dict "root" . "component" "config") }}
{{- end }}

{{- define "fleet.secretName" -}}
{{- if .Values.secret.create }}
{{- include "fleet.componentName" (dict "root" . "component" "secret") }}
{{- else }}
{{- .Values.secret.existingSecret }}
{{- end }}
{{- end }}

{{/* Labels ------------------------------------------------------------------------------------------------ */}}

{{- define "fleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels selecting one component's pods (args: root, component). */}}
{{- define "fleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every resource's labels (args: root, component). */}}
{{- define "fleet.labels" -}}
helm.sh/chart: {{ include "fleet.chart" .root }}
{{ include "fleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: fleet
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Pods ---------------------------------------------------------------------------------------------------- */}}

{{- define "fleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Pod annotations (args: root, metricsPort or nil): config checksum, so config changes roll the pods, and the
Prometheus scrape annotations. */}}
{{- define "fleet.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- if and .metricsPort .root.Values.prometheus.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .metricsPort | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Settings shared by every Fleet container: the ConfigMap, then the Secret (which wins on equal keys). */}}
{{- define "fleet.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "fleet.configName" . }}
{{- with include "fleet.secretName" . }}
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end }}

{{/* Models --------------------------------------------------------------------------------------------------- */}}

{{/* One model's worker settings: `workers.defaults` with the model's keys on top, each replacing the default's
whole. Written by hand because sprig's merge treats false and 0 as unset, so `gpu: false` would not override. */}}
{{- define "fleet.worker" -}}
{{- $own := default dict (get .root.Values.workers.models .model) }}
{{- $w := deepCopy .root.Values.workers.defaults }}
{{- range $key, $value := $own }}
{{- $_ := set $w $key $value }}
{{- end }}
{{- if not (hasKey $own "drainTimeoutSeconds") }}
{{- $_ := set $w "drainTimeoutSeconds" .root.Values.drainTimeoutSeconds }}
{{- end }}
{{- toJson $w }}
{{- end }}

{{/* One model's scaling: autoscaler.scaling with the model's own `scaling` keys on top (KEDA engine). */}}
{{- define "fleet.scaling" -}}
{{- $s := deepCopy .root.Values.autoscaler.scaling }}
{{- range $key, $value := (default dict (get .root.Values.workers.models .model)).scaling }}
{{- $_ := set $s $key $value }}
{{- end }}
{{- toJson $s }}
{{- end }}

{{/* FLEET_ROUTING: "model=dispatch,..." for the models that `fleet dispatcher` serves. */}}
{{- define "fleet.dispatched" -}}
{{- $models := list }}
{{- range $model, $_ := .Values.workers.models }}
{{- if eq (include "fleet.worker" (dict "root" $ "model" $model) | fromJson).routing "dispatch" }}
{{- $models = append $models $model }}
{{- end }}
{{- end }}
{{- toJson $models }}
{{- end }}

{{/* FLEET_MODELS: what the gateway accepts; a model with a `handler` import path is served by that path. */}}
{{- define "fleet.modelList" -}}
{{- $models := list }}
{{- range $model, $own := .Values.workers.models }}
{{- $models = append $models (default $model (default dict $own).handler) }}
{{- end }}
{{- join "," $models }}
{{- end }}

{{/* The NATS durable consumer of a model's workers: fleet.brokers.nats.durable_name(request_subject(m),
consumer_name(m)). */}}
{{- define "fleet.natsDurable" -}}
{{- printf "fleet-%s__fleet_req_%s" . . }}
{{- end }}

{{/* The scheme of the broker URL: "nats" or "kafka". */}}
{{- define "fleet.brokerKind" -}}
{{- regexFind "^[a-z]+" .Values.broker.url }}
{{- end }}

{{/* "host:port[,host:port]" from the broker URL (no scheme, path or query). */}}
{{- define "fleet.brokerHosts" -}}
{{- regexReplaceAll "[/?].*$" (regexReplaceAll "^[a-z]+://([^@]*@)?" .Values.broker.url "") "" }}
{{- end }}

{{/* Checks ---------------------------------------------------------------------------------------------------- */}}

{{/* Values that the schema cannot check; a violation stops rendering with a message that says what to change. */}}
{{- define "fleet.validate" -}}
{{- $keda := and .Values.autoscaler.enabled (eq .Values.autoscaler.engine "keda") }}
{{- range $model, $own := .Values.workers.models }}
{{- $w := include "fleet.worker" (dict "root" $ "model" $model) | fromJson }}
{{- if le (float64 $w.terminationGracePeriodSeconds) (float64 $w.drainTimeoutSeconds) }}
{{- fail (printf "workers.models.%s: terminationGracePeriodSeconds (%v) must be greater than the drain deadline drainTimeoutSeconds (%v, FLEET_DRAIN_TIMEOUT_S), or Kubernetes kills a draining worker mid-batch" $model $w.terminationGracePeriodSeconds $w.drainTimeoutSeconds) }}
{{- end }}
{{- if and (eq $w.routing "dispatch") (not $.Values.dispatcher.enabled) }}
{{- fail (printf "workers.models.%s.routing is dispatch, but dispatcher.enabled is false: nothing would assign its requests" $model) }}
{{- end }}
{{- if and (default dict $own).scaling (not $keda) }}
{{- fail (printf "workers.models.%s.scaling needs autoscaler.engine=keda: the Fleet autoscaler applies autoscaler.scaling to every model (set one model's min, max or pause at run time with PUT /v1/scaling/%s)" $model $model) }}
{{- end }}
{{- $s := include "fleet.scaling" (dict "root" $ "model" $model) | fromJson }}
{{- if lt (int $s.max_replicas) (int $s.min_replicas) }}
{{- fail (printf "workers.models.%s: scaling min_replicas (%v) is above max_replicas (%v)" $model $s.min_replicas $s.max_replicas) }}
{{- end }}
{{- if and $keda (not $s.lag_per_replica) }}
{{- fail (printf "workers.models.%s: autoscaler.engine=keda needs scaling.lag_per_replica (the lagThreshold of its ScaledObject), in autoscaler.scaling or the model's own scaling" $model) }}
{{- end }}
{{- end }}
{{- if and .Values.dispatcher.enabled (eq (include "fleet.dispatched" . | fromJsonArray | len) 0) }}
{{- fail "dispatcher.enabled is true, but no model has routing: dispatch (set workers.models.<model>.routing or workers.defaults.routing)" }}
{{- end }}
{{- end }}
