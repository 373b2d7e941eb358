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

{{/* Selector of one pool's pods: (dict "root" $ "role" "prefill"). */}}
{{- define "kvstash.poolSelector" -}}
{{ include "kvstash.selectorLabels" .root }}
app.kubernetes.io/component: instance
kvstash.io/role: {{ .role }}
{{- end -}}

{{/* Selector of every instance pod, whichever pool. */}}
{{- define "kvstash.instanceSelector" -}}
{{- if eq .Values.instances.role "pd" -}}
{{ include "kvstash.selectorLabels" . }}
app.kubernetes.io/component: instance
{{- else -}}
{{ include "kvstash.poolSelector" (dict "root" . "role" "mixed") }}
{{- end -}}
{{- end -}}

{{/* The pool clients call, behind the public Service. */}}
{{- define "kvstash.entryRole" -}}
{{- ternary "prefill" "mixed" (eq .Values.instances.role "pd") -}}
{{- end -}}

{{/* host:port of the decode pool's headless Service: one address per ready decode pod. */}}
{{- define "kvstash.decodeAddress" -}}
{{- printf "%s-decode.%s.svc.%s:%d" (include "kvstash.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.scheduler.port) -}}
{{- end -}}

{{/*
The instance pools as a YAML list (read it with fromYamlArray): one "mixed"
pool named like the release, or with instances.role pd a "prefill" and a
"decode" pool named <fullname>-<role>. Each holds what may differ between
pools, resolved against the shared values, so templates never look at the
role's keys themselves:
  role, name, headless (its headless Service), replicas, replicasKey (for
  messages), gpuCount, workerResources, nodeSelector, tolerations, affinity,
  schedulerFlags (the P/D flags of its role, --token-file for prefill with
  auth on; none for mixed).
*/}}
{{- define "kvstash.pools" -}}
{{- $i := .Values.instances -}}
{{- $w := .Values.worker -}}
{{- $fullname := include "kvstash.fullname" . -}}
{{- $pools := list -}}
{{- if eq $i.role "pd" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $p := index $i $role -}}
{{- $gpus := index $p "gpuCount" -}}
{{- $flags := dict "role" $role -}}
{{- if eq $role "prefill" -}}
{{- $_ := set $flags "decode-address" (include "kvstash.decodeAddress" $) -}}
{{- $_ := set $flags "handoff-wait" $p.handoffWait -}}
{{- /* Decode schedulers demand a token like any caller's: send the first accepted one. */ -}}
{{- if $.Values.auth.enabled -}}
{{- $_ := set $flags "token-file" (include "kvstash.authTokenFile" $) -}}
{{- end -}}
{{- else -}}
{{- $_ := set $flags "reservation-timeout" $p.reservationTimeout -}}
{{- end -}}
{{- $pools = append $pools (dict
  "role" $role
  "name" (printf "%s-%s" $fullname $role)
  "headless" (printf "%s-%s" $fullname $role)
  "replicas" $p.replicas
  "replicasKey" (printf "instances.%s.replicas" $role)
  "gpuCount" (ternary $w.gpu.count $gpus (kindIs "invalid" $gpus))
  "workerResources" (default $w.resources $p.workerResources)
  "nodeSelector" (default $i.nodeSelector $p.nodeSelector)
  "tolerations" (default $i.tolerations $p.tolerations)
  "affinity" (default $i.affinity $p.affinity)
  "schedulerFlags" $flags) -}}
{{- end -}}
{{- else -}}
{{- $pools = list (dict
  "role" "mixed"
  "name" $fullname
  "headless" (printf "%s-instances" $fullname)
  "replicas" $i.replicas
  "replicasKey" "instances.replicas"
  "gpuCount" $w.gpu.count
  "workerResources" $w.resources
  "nodeSelector" $i.nodeSelector
  "tolerations" $i.tolerations
  "affinity" $i.affinity
  "schedulerFlags" dict) -}}
{{- end -}}
{{- toYaml $pools -}}
{{- end -}}

{{/* The helm test pod (templates/tests): it calls the public Service and the gateway. */}}
{{- define "kvstash.testSelector" -}}
{{ include "kvstash.selectorLabels" . }}
app.kubernetes.io/component: test
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

{{/* A Prometheus duration as values.schema.json takes it ("30s", "500ms", "1m", "2h") -> milliseconds. */}}
{{- define "kvstash.durationMs" -}}
{{- $d := toString . -}}
{{- $unit := regexFind "[a-z]+$" $d -}}
{{- mul (trimSuffix $unit $d | atoi) (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit) -}}
{{- end -}}

{{/* A CPU quantity ("2", 1.5, "500m") -> whole CPUs, rounded up, at least 1. */}}
{{- define "kvstash.cpuCeil" -}}
{{- $q := toString . -}}
{{- if regexMatch "^[0-9]+m$" $q -}}
{{- max 1 (div (add (trimSuffix "m" $q | atoi) 999) 1000) -}}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?$" $q -}}
{{- max 1 (ceil (float64 $q) | int) -}}
{{- else -}}
{{- fail (printf "kvstash: CPU %q is not a quantity like 2, 1.5 or 500m" $q) -}}
{{- end -}}
{{- end -}}

{{/*
The worker's torch threads (dict "root" $ "pool" <an entry of kvstash.pools>):
worker.numThreads, else the pool's worker CPU limit (its request where it has
no limit), rounded up; "" with neither, and the worker derives the count from
its own cgroup. torch alone would take one thread per node core.
*/}}
{{- define "kvstash.workerThreads" -}}
{{- $r := .pool.workerResources -}}
{{- $cpu := dig "limits" "cpu" (dig "requests" "cpu" "" $r) $r -}}
{{- if not (kindIs "invalid" .root.Values.worker.numThreads) -}}
{{- .root.Values.worker.numThreads -}}
{{- else if ne (toString $cpu) "" -}}
{{- include "kvstash.cpuCeil" $cpu -}}
{{- end -}}
{{- end -}}

{{/* Seconds a startup probe lets a container come up: (dict "periodSeconds" N "failureThreshold" M). */}}
{{- define "kvstash.startupSeconds" -}}
{{- mul (int .periodSeconds) (int .failureThreshold) -}}
{{- end -}}

{{/*
The scheduler's --worker-wait in seconds: scheduler.flags.worker-wait, else
the worker's startup budget (worker.probes.startup), the time the kubelet
gives it to load its model before restarting it.
*/}}
{{- define "kvstash.workerWait" -}}
{{- $flags := .Values.scheduler.flags -}}
{{- if hasKey $flags "worker-wait" -}}
{{- include "kvstash.arg" (index $flags "worker-wait") -}}
{{- else -}}
{{- include "kvstash.startupSeconds" .Values.worker.probes.startup -}}
{{- end -}}
{{- end -}}

{{/*
The worker's KV block size in tokens: worker.flags.block-size, else the
worker's own default (gpu_worker/config.py WorkerConfig.block_size; a test
keeps the two equal).
*/}}
{{- define "kvstash.blockSize" -}}
{{- $flags := .Values.worker.flags -}}
{{- if hasKey $flags "block-size" -}}
{{- index $flags "block-size" | int -}}
{{- else -}}
16
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

{{/* The disk tier's claim, one per pod of a StatefulSet (cache.disk.persistence). */}}
{{- define "kvstash.diskClaimTemplate" -}}
{{- $p := .Values.cache.disk.persistence -}}
- metadata:
    name: disk
    labels:
      {{- include "kvstash.selectorLabels" . | nindent 6 }}
  spec:
    accessModes:
      {{- toYaml $p.accessModes | nindent 6 }}
    {{- with $p.storageClass }}
    storageClassName: {{ . }}
    {{- end }}
    resources:
      requests:
        storage: {{ printf "%sMi" (include "kvstash.diskSizeMiB" .) }}
{{- end -}}

{{/*
The cache address scheduler and worker use: loopback in the pod (sidecar), or
the Service "<fullname>-cache" (daemonset: node-local; shared: the one cache).
*/}}
{{- define "kvstash.cacheAddress" -}}
{{- if not .Values.cache.enabled -}}
{{- else if eq .Values.cache.mode "sidecar" -}}
{{- printf "127.0.0.1:%d" (int .Values.cache.port) -}}
{{- else -}}
{{- printf "%s-cache.%s.svc:%d" (include "kvstash.fullname" .) .Release.Namespace (int .Values.cache.port) -}}
{{- end -}}
{{- end -}}

{{/*
"true" when cache and workers share the arena, else "": a shared cache has
no co-located workers, whatever cache.arena.enabled says.
*/}}
{{- define "kvstash.arena" -}}
{{- $c := .Values.cache -}}
{{- if and $c.enabled $c.arena.enabled (ne $c.mode "shared") -}}true{{- end -}}
{{- end -}}

{{/*
The node directory of a per-node cache's arena (cache.mode daemonset): one
per namespace and release unless cache.daemonset.hostPath names one. Every
pod runs as runAsUser, so releases sharing a directory could read and
overwrite each other's KV. "_" is in no namespace or release name: no two
releases get the same path.
*/}}
{{- define "kvstash.arenaHostPath" -}}
{{- .Values.cache.daemonset.hostPath | default (printf "/dev/shm/kvstash_%s_%s" .Release.Namespace .Release.Name) -}}
{{- end -}}

{{/* The mounted auth Secret's tokens: --auth-token-file, and prefill's --token-file. */}}
{{- define "kvstash.authTokenFile" -}}
{{- printf "%s/tokens" .Values.auth.mountPath -}}
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

{{/* A value as one flag's text: whole numbers without an exponent (YAML's 1000000 is 1e+06). */}}
{{- define "kvstash.arg" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
Flags as environment variables: (dict "service" "SCHEDULER" "flags" $dict) ->
KVSTASH_SCHEDULER_<FLAG> entries, sorted (kvstash/common/settings.py reads them).
*/}}
{{- define "kvstash.flagEnv" -}}
{{- $service := .service -}}
{{- range $flag, $value := .flags }}
- name: {{ printf "KVSTASH_%s_%s" $service ($flag | replace "-" "_" | upper) }}
  value: {{ include "kvstash.arg" $value | quote }}
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
