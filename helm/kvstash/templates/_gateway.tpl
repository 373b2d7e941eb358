{{/*
The smg gateway (gateway.enabled): its name, selector and `smg launch`
arguments. tests/helm dry-parses the arguments with smg's own parser, so
chart and smg cannot drift apart.
*/}}

{{- define "kvstash.gatewayName" -}}
{{- printf "%s-gateway" (include "kvstash.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvstash.gatewaySelector" -}}
{{ include "kvstash.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/*
`smg launch` arguments, a YAML list. Discovery: every ready pod of the pool
clients call (kvstash.entryRole), in the release's namespace only, at the
scheduler's port (VllmEngine shares it with kvstash.v1.Scheduler).
*/}}
{{- define "kvstash.gateway.args" -}}
{{- $v := .Values -}}
{{- $g := $v.gateway -}}
{{- $args := list
  "--host" "0.0.0.0"
  "--port" (include "kvstash.arg" $g.port)
  "--prometheus-port" (include "kvstash.arg" $v.metrics.ports.gateway)
  "--prometheus-host" (ternary "0.0.0.0" "127.0.0.1" $v.metrics.enabled)
  "--policy" $g.policy
  "--cache-threshold" (include "kvstash.arg" $g.cacheAware.cacheThreshold)
  "--balance-abs-threshold" (include "kvstash.arg" $g.cacheAware.balanceAbsThreshold)
  "--balance-rel-threshold" (include "kvstash.arg" $g.cacheAware.balanceRelThreshold)
  "--health-check-interval-secs" (include "kvstash.arg" $g.healthCheck.intervalSeconds)
  "--health-failure-threshold" (include "kvstash.arg" $g.healthCheck.failureThreshold)
  "--shutdown-grace-period-secs" (include "kvstash.arg" $g.shutdownGracePeriodSeconds)
  "--log-level" $g.logLevel
  "--service-discovery"
  "--service-discovery-namespace" .Release.Namespace
  "--service-discovery-port" (include "kvstash.arg" $v.scheduler.port) -}}
{{- $args = append $args "--selector" -}}
{{- $pool := include "kvstash.poolSelector" (dict "root" . "role" (include "kvstash.entryRole" .)) | fromYaml -}}
{{- range $key, $value := $pool -}}
{{- $args = append $args (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- if $v.tracing.enabled -}}
{{- $args = concat $args (list "--enable-trace" "--otlp-traces-endpoint" $v.tracing.endpoint) -}}
{{- end -}}
{{- range $flag, $value := $g.flags -}}
{{- if kindIs "bool" $value -}}
{{- if $value -}}
{{- $args = append $args (printf "--%s" $flag) -}}
{{- end -}}
{{- else -}}
{{- $args = concat $args (list (printf "--%s" $flag) (include "kvstash.arg" $value)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* Flags of `smg launch` the chart sets itself (gateway.flags may not), aliases included. */}}
{{- define "kvstash.gateway.ownedFlags" -}}
{{- toYaml (list "host" "port" "prometheus-port" "prometheus-host" "policy"
  "cache-threshold" "cache-match-threshold" "balance-abs-threshold" "spill-abs-threshold"
  "balance-rel-threshold" "spill-rel-threshold" "health-check-interval-secs"
  "health-failure-threshold" "shutdown-grace-period-secs" "log-level" "service-discovery"
  "discovery-provider" "service-discovery-namespace" "service-discovery-port" "selector"
  "worker-urls" "enable-trace" "otlp-traces-endpoint") -}}
{{- end -}}

{{/* HTTP probes: startup and readiness wait for a registered scheduler, liveness for the process. */}}
{{- define "kvstash.gateway.probes" -}}
{{- $paths := dict "startup" "/readiness" "readiness" "/readiness" "liveness" "/liveness" -}}
{{- range $kind, $p := .Values.gateway.probes }}
{{ $kind }}Probe:
  httpGet: {path: {{ index $paths $kind }}, port: http}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}
{{- end -}}
