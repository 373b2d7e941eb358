{{/* Names, labels, images and the pieces every container shares. */}}

{{- define "kvstash.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvstash.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvstash.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstash.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvstash.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvstash.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvstash
{{- end -}}

{{/* Selector of the instance pods. */}}
{{- define "kvstash.instanceSelector" -}}
{{ include "kvstash.selectorLabels" . }}
app.kubernetes.io/component: instance
kvstash.io/role: {{ .Values.instances.role }}
{{- end -}}

{{- define "kvstash.cacheSelector" -}}
{{ include "kvstash.selectorLabels" . }}
app.kubernetes.io/component: cache
{{- end -}}

{{- define "kvstash.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvstash.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* (dict "image" .Values.images.control "root" $) -> repository:tag */}}
{{- define "kvstash.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* "512Mi" / "2Gi" -> MiB as a decimal string (the schema allows only these). */}}
{{- define "kvstash.mib" -}}
{{- $q := toString . -}}
{{- if hasSuffix "Gi" $q -}}
{{- mul (trimSuffix "Gi" $q | atoi) 1024 -}}
{{- else if hasSuffix "Mi" $q -}}
{{- trimSuffix "Mi" $q | atoi -}}
{{- else -}}
{{- fail (printf "kvstash: %q is not a size in Mi or Gi" $q) -}}
{{- end -}}
{{- end -}}

{{/* Derived sizes, in MiB. */}}
{{- define "kvstash.cacheLimitMiB" -}}
{{- $c := .Values.cache -}}
{{- if $c.resources.limits.memory -}}
{{- include "kvstash.mib" $c.resources.limits.memory -}}
{{- else -}}
{{- add (include "kvstash.mib" $c.memoryBudget | atoi) (include "kvstash.mib" $c.overhead | atoi) -}}
{{- end -}}
{{- end -}}

{{- define "kvstash.arenaSizeLimitMiB" -}}
{{- $a := .Values.cache.arena -}}
{{- if $a.sizeLimit -}}
{{- include "kvstash.mib" $a.sizeLimit -}}
{{- else -}}
{{- add (include "kvstash.mib" .Values.cache.memoryBudget | atoi) 64 -}}
{{- end -}}
{{- end -}}

{{/* Room for the disk tier: claim size (persistent) or emptyDir sizeLimit. */}}
{{- define "kvstash.diskSizeMiB" -}}
{{- $d := .Values.cache.disk -}}
{{- $explicit := ternary $d.persistence.size $d.sizeLimit $d.persistence.enabled -}}
{{- if $explicit -}}
{{- include "kvstash.mib" $explicit -}}
{{- else -}}
{{- add (include "kvstash.mib" $d.budget | atoi) 1024 -}}
{{- end -}}
{{- end -}}

{{/* The cache address scheduler and worker use: loopback in the pod, or the node-local Service. */}}
{{- define "kvstash.cacheAddress" -}}
{{- if not .Values.cache.enabled -}}
{{- else if eq .Values.cache.mode "daemonset" -}}
{{- printf "%s-cache.%s.svc:%d" (include "kvstash.fullname" .) .Release.Namespace (int .Values.cache.port) -}}
{{- else -}}
{{- printf "127.0.0.1:%d" (int .Values.cache.port) -}}
{{- end -}}
{{- end -}}

{{- define "kvstash.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsGroup }}
fsGroup: {{ .Values.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvstash.securityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsGroup }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Flags as environment variables: (dict "service" "SCHEDULER" "flags" $dict) ->
KVSTASH_SCHEDULER_<FLAG> entries, sorted (kvstash/settings.py reads them).
*/}}
{{- define "kvstash.flagEnv" -}}
{{- $service := .service -}}
{{- range $flag, $value := .flags }}
- name: {{ printf "KVSTASH_%s_%s" $service ($flag | replace "-" "_" | upper) }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end -}}

{{/* Flags every server gets from the chart: listen, metrics, TLS or --plaintext. */}}
{{- define "kvstash.serverFlags" -}}
{{- $root := .root -}}
{{- $flags := dict "listen" (printf "0.0.0.0:%d" (int .port)) -}}
{{- if $root.Values.metrics.enabled -}}
{{- $_ := set $flags "metrics-port" .metricsPort -}}
{{- $_ := set $flags "metrics-host" "0.0.0.0" -}}
{{- end -}}
{{- if $root.Values.tls.enabled -}}
{{- $dir := $root.Values.tls.mountPath -}}
{{- $_ := set $flags "tls-cert" (printf "%s/tls.crt" $dir) -}}
{{- $_ := set $flags "tls-key" (printf "%s/tls.key" $dir) -}}
{{- $_ := set $flags "tls-ca" (printf "%s/ca.crt" $dir) -}}
{{- else -}}
{{- $_ := set $flags "plaintext" true -}}
{{- end -}}
{{- toYaml $flags -}}
{{- end -}}

{{/* Environment shared by the services: tracing and where Python may write. */}}
{{- define "kvstash.commonEnv" -}}
{{- $t := .Values.tracing }}
- name: HOME
  value: /tmp
{{- if $t.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $t.endpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $t.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.samplerArg | quote }}
{{- if $t.resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ $t.resourceAttributes | quote }}
{{- end }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- end -}}

{{/*
Probes against the standard gRPC health service: (dict "port" N "probes"
.Values.x.probes "root" $). Native gRPC probes without TLS; with TLS the
kubelet cannot speak to the port, so kvstash-health runs in the container
with the pod's certificate.
*/}}
{{- define "kvstash.probes" -}}
{{- $root := .root -}}
{{- $port := int .port -}}
{{- range $kind, $p := .probes }}
{{ $kind }}Probe:
  {{- if $root.Values.tls.enabled }}
  {{- $dir := $root.Values.tls.mountPath }}
  exec:
    command: [kvstash-health, {{ printf "127.0.0.1:%d" $port | quote }}, --tls-ca, {{ printf "%s/ca.crt" $dir | quote }}, --tls-cert, {{ printf "%s/tls.crt" $dir | quote }}, --tls-key, {{ printf "%s/tls.key" $dir | quote }}]
  {{- else }}
  grpc:
    port: {{ $port }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}
{{- end -}}

{{/* Volume mounts of the secrets every service container gets. */}}
{{- define "kvstash.secretMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvstash.secretVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ .Values.auth.secretName }}
    defaultMode: 0440
    items:
      - key: tokens
        path: tokens
{{- end }}
{{- end -}}

{{/* The model volume (model.source pvc, hostPath or image). */}}
{{- define "kvstash.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "image" }}
- name: model
  image:
    reference: {{ $m.image.reference }}
    pullPolicy: {{ $m.image.pullPolicy }}
{{- end }}
{{- end -}}
