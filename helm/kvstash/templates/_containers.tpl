{{/*
The three containers. Flags reach the services as KVSTASH_<SERVICE>_<FLAG>
variables (kvstash/settings.py); tests/helm dry-parses each container's with
the service's real parser, so chart and code cannot drift apart.
*/}}

{{- define "kvstash.container.scheduler" -}}
{{- $s := .Values.scheduler -}}
{{- $flags := include "kvstash.serverFlags" (dict "root" . "port" $s.port "metricsPort" .Values.metrics.ports.scheduler) | fromYaml -}}
{{- $_ := set $flags "worker-address" (printf "127.0.0.1:%d" (int .Values.worker.port)) -}}
{{- $_ := set $flags "cache-address" (include "kvstash.cacheAddress" .) -}}
{{- if .Values.auth.enabled -}}
{{- $_ := set $flags "auth-token-file" (printf "%s/tokens" .Values.auth.mountPath) -}}
{{- end -}}
- name: scheduler
  image: {{ include "kvstash.image" (dict "image" .Values.images.control "root" .) }}
  imagePullPolicy: {{ .Values.images.pullPolicy }}
  command: [python, -m, scheduler_svc]
  env:
    {{- with include "kvstash.commonEnv" . | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with include "kvstash.flagEnv" (dict "service" "SCHEDULER" "flags" (merge $flags $s.flags)) | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with $s.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: grpc, containerPort: {{ $s.port }}, protocol: TCP}
    {{- if .Values.metrics.enabled }}
    - {name: metrics-sched, containerPort: {{ .Values.metrics.ports.scheduler }}, protocol: TCP}
    {{- end }}
  {{- with include "kvstash.probes" (dict "port" $s.port "probes" $s.probes "root" .) | trim }}{{ . | nindent 2 }}{{ end }}
  resources:
    {{- toYaml $s.resources | nindent 4 }}
  securityContext:
    {{- include "kvstash.securityContext" . | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp, subPath: scheduler}
    {{- with include "kvstash.secretMounts" . | trim }}{{ . | nindent 4 }}{{ end }}
    {{- if .Values.auth.enabled }}
    - {name: auth, mountPath: {{ .Values.auth.mountPath }}, readOnly: true}
    {{- end }}
{{- end -}}

{{- define "kvstash.container.worker" -}}
{{- $w := .Values.worker -}}
{{- $m := .Values.model -}}
{{- $flags := include "kvstash.serverFlags" (dict "root" . "port" $w.port "metricsPort" .Values.metrics.ports.worker) | fromYaml -}}
{{- $_ := set $flags "device" $w.device -}}
{{- if eq $m.source "builtin" -}}
{{- $_ := set $flags "model" $m.name -}}
{{- else -}}
{{- $_ := set $flags "model" (trimSuffix "/" (printf "%s/%s" $m.mountPath $m.subPath)) -}}
{{- end -}}
{{- $_ := set $flags "cache-address" (include "kvstash.cacheAddress" .) -}}
{{- $arena := and .Values.cache.enabled .Values.cache.arena.enabled -}}
{{- $_ := set $flags "cache-arena" $arena -}}
- name: worker
  image: {{ include "kvstash.image" (dict "image" .Values.images.worker "root" .) }}
  imagePullPolicy: {{ .Values.images.pullPolicy }}
  command: [python, -m, gpu_worker]
  env:
    {{- with include "kvstash.commonEnv" . | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with include "kvstash.flagEnv" (dict "service" "WORKER" "flags" (merge $flags $w.flags)) | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with $w.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: worker-grpc, containerPort: {{ $w.port }}, protocol: TCP}
    {{- if .Values.metrics.enabled }}
    - {name: metrics-worker, containerPort: {{ .Values.metrics.ports.worker }}, protocol: TCP}
    {{- end }}
  {{- with include "kvstash.probes" (dict "port" $w.port "probes" $w.probes "root" .) | trim }}{{ . | nindent 2 }}{{ end }}
  resources:
    requests:
      {{- range $k, $v := $w.resources.requests }}
      {{ $k }}: {{ $v | quote }}
      {{- end }}
      {{- if gt (int $w.gpu.count) 0 }}
      {{ $w.gpu.resourceName }}: {{ $w.gpu.count }}
      {{- end }}
    limits:
      {{- range $k, $v := $w.resources.limits }}
      {{ $k }}: {{ $v | quote }}
      {{- end }}
      {{- if gt (int $w.gpu.count) 0 }}
      {{ $w.gpu.resourceName }}: {{ $w.gpu.count }}
      {{- end }}
  securityContext:
    {{- include "kvstash.securityContext" . | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp, subPath: worker}
    {{- if $arena }}
    - {name: arena, mountPath: {{ .Values.cache.arena.path }}}
    {{- end }}
    {{- if ne $m.source "builtin" }}
    - {name: model, mountPath: {{ $m.mountPath }}, readOnly: true}
    {{- end }}
    {{- with include "kvstash.secretMounts" . | trim }}{{ . | nindent 4 }}{{ end }}
{{- end -}}

{{- define "kvstash.container.cache" -}}
{{- $c := .Values.cache -}}
{{- $flags := include "kvstash.serverFlags" (dict "root" . "port" $c.port "metricsPort" .Values.metrics.ports.cache) | fromYaml -}}
{{- $_ := set $flags "memory-budget" (printf "%sMiB" (include "kvstash.mib" $c.memoryBudget)) -}}
{{- if $c.arena.enabled -}}
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
      {{ $k }}: {{ $v | quote }}
      {{- end }}
      {{- if not $c.resources.requests.memory }}
      {{- /* The arena is resident whole from the start: request what it takes. */}}
      memory: {{ printf "%sMi" (include "kvstash.cacheLimitMiB" .) }}
      {{- end }}
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
    {{- if $c.arena.enabled }}
    - {name: arena, mountPath: {{ $c.arena.path }}}
    {{- end }}
    {{- if $c.disk.enabled }}
    - {name: disk, mountPath: {{ $c.disk.path }}}
    {{- end }}
    {{- with include "kvstash.secretMounts" . | trim }}{{ . | nindent 4 }}{{ end }}
{{- end -}}
