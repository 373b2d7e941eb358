{{/*
The three containers. Flags reach the services as KVSTASH_<SERVICE>_<FLAG>
variables (kvstash/common/settings.py); tests/helm dry-parses each container's with
the service's real parser, so chart and code cannot drift apart.
*/}}

{{/* (dict "root" $ "pool" <an entry of kvstash.pools>) */}}
{{- define "kvstash.container.scheduler" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $s := $v.scheduler -}}
{{- $flags := include "kvstash.serverFlags" (dict "root" $root "port" $s.port "metricsPort" $v.metrics.ports.scheduler) | fromYaml -}}
{{- $_ := set $flags "worker-address" (printf "127.0.0.1:%d" (int $v.worker.port)) -}}
{{- $_ := set $flags "cache-address" (include "kvstash.cacheAddress" $root) -}}
{{- $_ := set $flags "prefix-segment-tokens" (int $v.cache.prefixTier.segmentTokens) -}}
{{- $_ := set $flags "prefix-write" $v.cache.prefixTier.write -}}
{{- /* Wait as long as the kubelet lets the worker load its model (--worker-wait's own default, 120 s, is far less): past it the scheduler exits 1. */ -}}
{{- if not (hasKey $s.flags "worker-wait") -}}
{{- $_ := set $flags "worker-wait" (include "kvstash.startupSeconds" $v.worker.probes.startup | atoi) -}}
{{- end -}}
{{- if $v.auth.enabled -}}
{{- $_ := set $flags "auth-token-file" (include "kvstash.authTokenFile" $root) -}}
{{- end -}}
{{- $flags = merge $flags .pool.schedulerFlags -}}
- name: scheduler
  image: {{ include "kvstash.image" (dict "image" $v.images.control "root" $root) }}
  imagePullPolicy: {{ $v.images.pullPolicy }}
  command: [python, -m, scheduler_svc]
  env:
    {{- with include "kvstash.commonEnv" $root | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with include "kvstash.flagEnv" (dict "service" "SCHEDULER" "flags" (merge $flags $s.flags)) | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with $s.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: grpc, containerPort: {{ $s.port }}, protocol: TCP}
    {{- if $v.metrics.enabled }}
    - {name: metrics-sched, containerPort: {{ $v.metrics.ports.scheduler }}, protocol: TCP}
    {{- end }}
  {{- with include "kvstash.probes" (dict "port" $s.port "probes" $s.probes "root" $root) | trim }}{{ . | nindent 2 }}{{ end }}
  resources:
    {{- toYaml $s.resources | nindent 4 }}
  securityContext:
    {{- include "kvstash.securityContext" $root | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp, subPath: scheduler}
    {{- with include "kvstash.secretMounts" $root | trim }}{{ . | nindent 4 }}{{ end }}
    {{- if $v.auth.enabled }}
    - {name: auth, mountPath: {{ $v.auth.mountPath }}, readOnly: true}
    {{- end }}
{{- end -}}

{{/* (dict "root" $ "pool" <an entry of kvstash.pools>): the GPUs and resources are the pool's. */}}
{{- define "kvstash.container.worker" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $w := $v.worker -}}
{{- $m := $v.model -}}
{{- $gpus := int .pool.gpuCount -}}
{{- $resources := .pool.workerResources -}}
{{- $flags := include "kvstash.serverFlags" (dict "root" $root "port" $w.port "metricsPort" $v.metrics.ports.worker) | fromYaml -}}
{{- $_ := set $flags "device" $w.device -}}
{{- if eq $m.source "builtin" -}}
{{- $_ := set $flags "model" $m.name -}}
{{- else -}}
{{- $_ := set $flags "model" (trimSuffix "/" (printf "%s/%s" $m.mountPath $m.subPath)) -}}
{{- end -}}
{{- $_ := set $flags "cache-address" (include "kvstash.cacheAddress" $root) -}}
{{- $arena := include "kvstash.arena" $root | eq "true" -}}
{{- $_ := set $flags "cache-arena" $arena -}}
{{- $threads := include "kvstash.workerThreads" . -}}
{{- if and $threads (not (hasKey $w.flags "num-threads")) -}}
{{- $_ := set $flags "num-threads" (atoi $threads) -}}
{{- end -}}
- name: worker
  image: {{ include "kvstash.image" (dict "image" $v.images.worker "root" $root) }}
  imagePullPolicy: {{ $v.images.pullPolicy }}
  command: [python, -m, gpu_worker]
  env:
    {{- with include "kvstash.commonEnv" $root | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with include "kvstash.flagEnv" (dict "service" "WORKER" "flags" (merge $flags $w.flags)) | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with $w.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: worker-grpc, containerPort: {{ $w.port }}, protocol: TCP}
    {{- if $v.metrics.enabled }}
    - {name: metrics-worker, containerPort: {{ $v.metrics.ports.worker }}, protocol: TCP}
    {{- end }}
  {{- with include "kvstash.probes" (dict "port" $w.port "probes" $w.probes "root" $root) | trim }}{{ . | nindent 2 }}{{ end }}
  resources:
    requests:
      {{- range $k, $q := $resources.requests }}
      {{ $k }}: {{ $q | quote }}
      {{- end }}
      {{- if gt $gpus 0 }}
      {{ $w.gpu.resourceName }}: {{ $gpus }}
      {{- end }}
    limits:
      {{- range $k, $q := $resources.limits }}
      {{ $k }}: {{ $q | quote }}
      {{- end }}
      {{- if gt $gpus 0 }}
      {{ $w.gpu.resourceName }}: {{ $gpus }}
      {{- end }}
  securityContext:
    {{- include "kvstash.securityContext" $root | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp, subPath: worker}
    {{- if $arena }}
    - {name: arena, mountPath: {{ $v.cache.arena.path }}}
    {{- end }}
    {{- if ne $m.source "builtin" }}
    - {name: model, mountPath: {{ $m.mountPath }}, readOnly: true}
    {{- end }}
    {{- with include "kvstash.secretMounts" $root | trim }}{{ . | nindent 4 }}{{ end }}
{{- end -}}

{{- define "kvstash.container.cache" -}}
{{- $c := .Values.cache -}}
{{- $arena := include "kvstash.arena" . | eq "true" -}}
{{- $flags := include "kvstash.serverFlags" (dict "root" . "port" $c.port "metricsPort" .Values.metrics.ports.cache) | fromYaml -}}
{{- $_ := set $flags "memory-budget" (printf "%sMiB" (include "kvstash.mib" $c.memoryBudget)) -}}
{{- $_ := set $flags "unpinned-share" $c.prefixTier.memoryShare -}}
{{- if $arena -}}
{{- $_ := set $flags "arena-dir" $c.arena.path -}}
{{- end -}}
{{- if $c.disk.enabled -}}
{{- $_ := set $flags "disk-dir" $c.disk.path -}}
{{- $_ := set $flags "disk-budget" (printf "%sMiB" (include "kvstash.mib" $c.disk.budget)) -}}
{{- end -}}
- name: cache
  image: {{ include "kvstash.image" (dict "image" .Values.images.control "root" .) }}
  imagePullPolicy: {{ .Values.images.pullPolicy }}
  command: [python, -m, cache_svc]
  env:
    {{- with include "kvstash.commonEnv" . | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with include "kvstash.flagEnv" (dict "service" "CACHE" "flags" (merge $flags $c.flags)) | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with $c.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: cache-grpc, containerPort: {{ $c.port }}, protocol: TCP}
    {{- if .Values.metrics.enabled }}
    - {name: metrics-cache, containerPort: {{ .Values.metrics.ports.cache }}, protocol: TCP}
    {{- end }}
  {{- with include "kvstash.probes" (dict "port" $c.port "probes" $c.probes "root" .) | trim }}{{ . | nindent 2 }}{{ end }}
  resources:
    requests:
      {{- range $k, $v := $c.resources.requests }}
      {{- if ne $k "memory" }}
      {{ $k }}: {{ $v | quote }}
      {{- end }}
      {{- end }}
      {{- /* By default the limit: an arena is resident whole from the start, and a shared cache holds every instance's KV. */}}
      memory: {{ $c.resources.requests.memory | default (printf "%sMi" (include "kvstash.cacheLimitMiB" .)) | quote }}
    limits:
      {{- range $k, $v := $c.resources.limits }}
      {{- if ne $k "memory" }}
      {{ $k }}: {{ $v | quote }}
      {{- end }}
      {{- end }}
      memory: {{ printf "%sMi" (include "kvstash.cacheLimitMiB" .) }}
  securityContext:
    {{- include "kvstash.securityContext" . | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp, subPath: cache}
    {{- if $arena }}
    - {name: arena, mountPath: {{ $c.arena.path }}}
    {{- end }}
    {{- if $c.disk.enabled }}
    - {name: disk, mountPath: {{ $c.disk.path }}}
    {{- end }}
    {{- with include "kvstash.secretMounts" . | trim }}{{ . | nindent 4 }}{{ end }}
{{- end -}}
