{{/*
Checks values.schema.json cannot express: each rule fails the render with a
message naming the keys involved and what to change.
*/}}

{{- define "kvstash.validate" -}}
{{- $errors := list -}}
{{- $v := .Values -}}
{{- $c := $v.cache -}}
{{- $i := $v.instances -}}

{{- $pools := include "kvstash.pools" . | fromYamlArray -}}

{{- /* Service names are DNS labels, at most 63 characters; the longest the chart makes is "<fullname>-instances". */ -}}
{{- $fullname := include "kvstash.fullname" . -}}
{{- if gt (len $fullname) 53 -}}
{{- $errors = append $errors (printf "the release's full name %q is %d characters: Kubernetes would refuse the Service %s-instances (a Service name is at most 63); use a shorter release name, or fullnameOverride of at most 53 characters" $fullname (len $fullname) $fullname) -}}
{{- end -}}
{{- /* A StatefulSet's pods carry the label controller-revision-hash "<name>-<10 characters>", a label value of at most 63: its name at most 52. */ -}}
{{- $statefulSets := list -}}
{{- if and $c.enabled (eq $c.mode "shared") -}}
{{- $statefulSets = append $statefulSets (printf "%s-cache" $fullname) -}}
{{- end -}}
{{- if and $c.enabled (eq $c.mode "sidecar") $c.disk.enabled $c.disk.persistence.enabled -}}
{{- range $pools -}}
{{- $statefulSets = append $statefulSets .name -}}
{{- end -}}
{{- end -}}
{{- range $statefulSets -}}
{{- if gt (len .) 52 -}}
{{- $errors = append $errors (printf "the StatefulSet %q is %d characters: Kubernetes would refuse its pods (their controller-revision-hash label is the name, a dash and 10 characters: at most 63); use a shorter release name, or a fullnameOverride %d characters shorter" . (len .) (sub (len .) 52)) -}}
{{- end -}}
{{- end -}}
{{- if not (has $c.mode (list "sidecar" "daemonset" "shared")) -}}
{{- $errors = append $errors (printf "cache.mode %q: use sidecar, daemonset or shared" $c.mode) -}}
{{- end -}}
{{- if lt (int $v.worker.gpu.count) 0 -}}
{{- $errors = append $errors (printf "worker.gpu.count is %d: use 0 (CPU only) or more" (int $v.worker.gpu.count)) -}}
{{- end -}}
{{- if and (gt (int $v.worker.gpu.count) 0) (eq $v.worker.device "cpu") -}}
{{- $errors = append $errors (printf "worker.gpu.count is %d but worker.device is cpu: the GPU would sit idle" (int $v.worker.gpu.count)) -}}
{{- end -}}

{{- /* P/D pools: both must exist, and the KV handoff needs one cache both reach. */ -}}
{{- if eq $i.role "pd" -}}
{{- if lt (int $i.prefill.replicas) 1 -}}
{{- $errors = append $errors "instances.role is pd but instances.prefill.replicas is 0: clients call the prefill pool (the public Service selects it), so it needs at least 1 (or use role mixed)" -}}
{{- end -}}
{{- if lt (int $i.decode.replicas) 1 -}}
{{- $errors = append $errors "instances.role is pd but instances.decode.replicas is 0: prefill instances hand every request to the decode pool, so it needs at least 1 (or use role mixed)" -}}
{{- end -}}
{{- $handoff := "the KV handoff goes through one cache service both pools reach (a prefill worker puts each request's KV in its cache, the decode worker restores it from its own by snapshot id)" -}}
{{- if not $c.enabled -}}
{{- $errors = append $errors (printf "instances.role is pd but cache.enabled is false: %s; enable the cache with cache.mode shared" $handoff) -}}
{{- else if ne $c.mode "shared" -}}
{{- $errors = append $errors (printf "instances.role is pd but cache.mode is %s: %s, and a %s cache is not shared across pods (decode instances would miss every snapshot and recompute the prompt); set cache.mode shared" $c.mode $handoff (ternary "per-pod" "per-node" (eq $c.mode "sidecar"))) -}}
{{- end -}}
{{- if eq $v.worker.device "cpu" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $gpus := index (index $i $role) "gpuCount" -}}
{{- if and (not (kindIs "invalid" $gpus)) (gt (int $gpus) 0) -}}
{{- $errors = append $errors (printf "instances.%s.gpuCount is %d but worker.device is cpu: the GPU would sit idle" $role (int $gpus)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* Disruption budget against the replicas it guards, pool by pool. */ -}}
{{- $pdb := $i.pdb -}}
{{- if $pdb.enabled -}}
{{- if eq (kindIs "invalid" $pdb.minAvailable) (kindIs "invalid" $pdb.maxUnavailable) -}}
{{- $errors = append $errors "instances.pdb: set exactly one of minAvailable and maxUnavailable" -}}
{{- else if not (kindIs "invalid" $pdb.minAvailable) -}}
{{- range $pools -}}
{{- /* minAvailable equal to the replicas blocks every eviction too (0 of 0 blocks nothing). */ -}}
{{- if and (gt (int $pdb.minAvailable) 0) (ge (int $pdb.minAvailable) (int .replicas)) -}}
{{- $errors = append $errors (printf "instances.pdb.minAvailable is %d but %s is %d: no pod could ever be evicted, so node drains would wait forever (lower minAvailable below the replicas, use maxUnavailable, or disable the PDB)" (int $pdb.minAvailable) .replicasKey (int .replicas)) -}}
{{- end -}}
{{- end -}}
{{- else if eq (int $pdb.maxUnavailable) 0 -}}
{{- $errors = append $errors "instances.pdb.maxUnavailable is 0: no pod could ever be evicted, so node drains would wait forever (use 1 or more, or disable the PDB)" -}}
{{- end -}}
{{- end -}}

{{- /* The cache's memory: budget + overhead within the limit, budget within the arena. */ -}}
{{- if $c.enabled -}}
{{- $budget := include "kvstash.mib" $c.memoryBudget | atoi -}}
{{- $overhead := include "kvstash.mib" $c.overhead | atoi -}}
{{- $limit := include "kvstash.cacheLimitMiB" . | atoi -}}
{{- if gt (add $budget $overhead) $limit -}}
{{- $errors = append $errors (printf "cache.memoryBudget (%dMi) + cache.overhead (%dMi) = %dMi exceeds cache.resources.limits.memory (%dMi): the cache would be OOM-killed; raise the limit or lower the budget (or leave the limit empty to derive it)" $budget $overhead (add $budget $overhead) $limit) -}}
{{- end -}}
{{- with $c.resources.requests.memory -}}
{{- $request := include "kvstash.mib" . | atoi -}}
{{- if gt $request $limit -}}
{{- $errors = append $errors (printf "cache.resources.requests.memory (%dMi) exceeds the cache's memory limit (%dMi, %s): Kubernetes refuses a container whose request is above its limit; lower the request, or leave it empty to request the limit" $request $limit (ternary "cache.resources.limits.memory" "derived from cache.memoryBudget + cache.overhead" (not (empty $c.resources.limits.memory)))) -}}
{{- end -}}
{{- end -}}
{{- if and $c.arena.enabled (eq $c.mode "sidecar") -}}
{{- $shm := include "kvstash.arenaSizeLimitMiB" . | atoi -}}
{{- if gt $budget $shm -}}
{{- $errors = append $errors (printf "cache.memoryBudget (%dMi) exceeds cache.arena.sizeLimit (%dMi): the arena is allocated whole at start and would not fit its emptyDir" $budget $shm) -}}
{{- end -}}
{{- end -}}
{{- if $c.disk.enabled -}}
{{- $disk := include "kvstash.mib" $c.disk.budget | atoi -}}
{{- $room := include "kvstash.diskSizeMiB" . | atoi -}}
{{- if gt $disk $room -}}
{{- $errors = append $errors (printf "cache.disk.budget (%dMi) exceeds the room for the disk tier (%dMi, cache.disk.%s)" $disk $room (ternary "persistence.size" "sizeLimit" $c.disk.persistence.enabled)) -}}
{{- end -}}
{{- if and $c.disk.persistence.enabled (eq $c.mode "daemonset") -}}
{{- $errors = append $errors "cache.disk.persistence needs cache.mode sidecar (each instance's cache gets its own claim) or shared (the cache's one pod gets one); a daemonset's disk tier is an emptyDir" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* The model's volume. */ -}}
{{- $m := $v.model -}}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) -}}
{{- $errors = append $errors "model.source is pvc: set model.pvc.claimName" -}}
{{- else if and (eq $m.source "hostPath") (not $m.hostPath.path) -}}
{{- $errors = append $errors "model.source is hostPath: set model.hostPath.path" -}}
{{- else if and (eq $m.source "image") (not $m.image.reference) -}}
{{- $errors = append $errors "model.source is image: set model.image.reference" -}}
{{- end -}}

{{- /* The worker's one built-in model (other sources name a directory: model.mountPath, model.subPath). */ -}}
{{- if and (eq $m.source "builtin") (ne (toString $m.name) "tiny") -}}
{{- $errors = append $errors (printf "model.name is %q with model.source builtin: the worker has one built-in model, \"tiny\"; serve a checkpoint with model.source pvc, hostPath or image (model.name is then unused)" (toString $m.name)) -}}
{{- end -}}

{{- /* The worker's KV blocks: within the worker's range, and whole in every prefix segment. */ -}}
{{- $block := include "kvstash.blockSize" . | atoi -}}
{{- $segment := int $c.prefixTier.segmentTokens -}}
{{- if or (lt $block 1) (gt $block 1024) -}}
{{- $errors = append $errors (printf "worker.flags.block-size is %v: the worker takes 1 to 1024 tokens per KV block" (index $v.worker.flags "block-size")) -}}
{{- else if mod $segment $block -}}
{{- $lower := mul (div $segment $block) $block -}}
{{- $suggest := ternary (printf "%d or %d" $lower (add $lower $block)) (toString $block) (gt $lower 0) -}}
{{- $errors = append $errors (printf "cache.prefixTier.segmentTokens is %d, not a multiple of the worker's KV block size %d (%s): every scheduler would refuse it at start, once its worker had loaded the model; use e.g. %s, or 0 to turn the prefix tier off" $segment $block (ternary "worker.flags.block-size" "the worker's default; worker.flags.block-size sets it" (hasKey $v.worker.flags "block-size")) $suggest) -}}
{{- end -}}

{{- /* The scheduler answers NOT_SERVING until its worker is up: its startup probe must outlast --worker-wait. */ -}}
{{- $schedulerStartup := $v.scheduler.probes.startup -}}
{{- $schedulerBudget := include "kvstash.startupSeconds" $schedulerStartup | atoi -}}
{{- $wait := include "kvstash.workerWait" . | float64 -}}
{{- if gt $wait (float64 $schedulerBudget) -}}
{{- $period := int $schedulerStartup.periodSeconds -}}
{{- $waitFrom := ternary "scheduler.flags.worker-wait" (printf "worker.probes.startup: %d x %d s, the time the kubelet lets the worker load its model" (int $v.worker.probes.startup.failureThreshold) (int $v.worker.probes.startup.periodSeconds)) (hasKey $v.scheduler.flags "worker-wait") -}}
{{- $errors = append $errors (printf "scheduler.probes.startup allows the scheduler %d s (%d x %d s) but it waits up to %s s for its worker (--worker-wait, from %s), answering NOT_SERVING until then: the kubelet would restart it while the worker still loads; raise scheduler.probes.startup.failureThreshold to at least %d" $schedulerBudget (int $schedulerStartup.failureThreshold) $period (include "kvstash.workerWait" .) $waitFrom (div (add (ceil $wait | int) (sub $period 1)) $period)) -}}
{{- end -}}

{{- /* Ports within one pod: its containers share one network, so Kubernetes takes two on one port, and the second to listen there crash-loops on "address in use". smg serves its metrics port whether metrics.enabled or not (on 127.0.0.1). */ -}}
{{- $sidecar := and $c.enabled (eq $c.mode "sidecar") -}}
{{- $mp := $v.metrics.ports -}}
{{- $instance := list (list "scheduler.port" $v.scheduler.port) (list "worker.port" $v.worker.port) -}}
{{- if $v.metrics.enabled -}}
{{- $instance = concat $instance (list (list "metrics.ports.scheduler" $mp.scheduler) (list "metrics.ports.worker" $mp.worker)) -}}
{{- end -}}
{{- if $sidecar -}}
{{- $instance = append $instance (list "cache.port" $c.port) -}}
{{- if $v.metrics.enabled -}}
{{- $instance = append $instance (list "metrics.ports.cache" $mp.cache) -}}
{{- end -}}
{{- end -}}
{{- $pods := list (list "an instance pod (its scheduler, worker and, in cache.mode sidecar, cache share one network)" $instance) -}}
{{- if and $c.enabled (not $sidecar) -}}
{{- $pods = append $pods (list "the cache's pod" (concat (list (list "cache.port" $c.port)) (ternary (list (list "metrics.ports.cache" $mp.cache)) list $v.metrics.enabled))) -}}
{{- end -}}
{{- if $v.gateway.enabled -}}
{{- $pods = append $pods (list "the gateway's pod" (list (list "gateway.port" $v.gateway.port) (list "metrics.ports.gateway" $mp.gateway))) -}}
{{- end -}}
{{- range $pod := $pods -}}
{{- $seen := dict -}}
{{- range $key := index $pod 1 -}}
{{- $port := toString (int (index $key 1)) -}}
{{- if hasKey $seen $port -}}
{{- $errors = append $errors (printf "%s and %s are both %s, one port twice in %s: Kubernetes takes such a pod, and the second to listen there crash-loops on \"address in use\"; give each its own port" (get $seen $port) (index $key 0) $port (index $pod 0)) -}}
{{- else -}}
{{- $_ := set $seen $port (index $key 0) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* Switches that need a companion value. */ -}}
{{- if and $v.tls.enabled (not $v.tls.secretName) -}}
{{- $errors = append $errors "tls.enabled: set tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- if and $v.auth.enabled (not $v.auth.secretName) -}}
{{- $errors = append $errors "auth.enabled: set auth.secretName (a Secret whose key \"tokens\" holds one token a line)" -}}
{{- end -}}
{{- if and $v.tracing.enabled (not $v.tracing.endpoint) -}}
{{- $errors = append $errors "tracing.enabled: set tracing.endpoint (OTEL_EXPORTER_OTLP_ENDPOINT)" -}}
{{- end -}}
{{- $t := $v.tracing -}}
{{- if and $t.enabled (hasSuffix "traceidratio" $t.sampler) (not (regexMatch "^(0(\\.[0-9]*)?|1(\\.0*)?|\\.[0-9]+)$" (toString $t.samplerArg))) -}}
{{- /* OpenTelemetry's SDK samples at 1.0 (every request) where the ratio does not parse or is out of range. */ -}}
{{- $errors = append $errors (printf "tracing.samplerArg %q is no ratio from 0 to 1 (e.g. \"0.1\" for one request in ten): tracing.sampler %s would trace every request instead" (toString $t.samplerArg) $t.sampler) -}}
{{- end -}}
{{- range $key := list "serviceMonitor" "grafanaDashboard" "prometheusRule" -}}
{{- if and (index $v.metrics $key).enabled (not $v.metrics.enabled) -}}
{{- $errors = append $errors (printf "metrics.%s.enabled needs metrics.enabled (no port to scrape)" $key) -}}
{{- end -}}
{{- end -}}
{{- $sm := $v.metrics.serviceMonitor -}}
{{- if and $sm.enabled (gt (include "kvstash.durationMs" $sm.scrapeTimeout | atoi) (include "kvstash.durationMs" $sm.interval | atoi)) -}}
{{- $errors = append $errors (printf "metrics.serviceMonitor.scrapeTimeout %s is longer than metrics.serviceMonitor.interval %s: the Prometheus Operator rejects such a ServiceMonitor, and nothing would be scraped; lower scrapeTimeout to at most the interval" $sm.scrapeTimeout $sm.interval) -}}
{{- end -}}

{{- /* The gateway: schedulers to route to, over channels smg can speak. */ -}}
{{- $g := $v.gateway -}}
{{- if $g.enabled -}}
{{- $entryRole := include "kvstash.entryRole" . -}}
{{- range $pools -}}
{{- if and (eq .role $entryRole) (lt (int .replicas) 1) -}}
{{- $why := ternary " (it routes to the prefill pool only: prefill instances hand decoding on themselves)" "" (eq .role "prefill") -}}
{{- $errors = append $errors (printf "gateway.enabled but %s is 0: the gateway would have no scheduler to route requests to%s; add instances, or disable the gateway" .replicasKey $why) -}}
{{- end -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- $errors = append $errors "gateway.enabled with tls.enabled: the schedulers then accept only TLS, and smg 1.13.0 speaks plaintext gRPC to its workers (its --ca-cert-paths, --client-cert-path and --client-key-path serve HTTP workers only); disable gateway.enabled or tls.enabled" -}}
{{- end -}}
{{- if $v.auth.enabled -}}
{{- $errors = append $errors (printf "gateway.enabled with auth.enabled: the schedulers then demand a bearer token (auth.secretName %q) on every VllmEngine call, and smg 1.13.0 sends gRPC workers none (its --api-key guards its own HTTP API only); disable gateway.enabled or auth.enabled" $v.auth.secretName) -}}
{{- end -}}
{{- if $g.pdb.enabled -}}
{{- if eq (kindIs "invalid" $g.pdb.minAvailable) (kindIs "invalid" $g.pdb.maxUnavailable) -}}
{{- $errors = append $errors "gateway.pdb: set exactly one of minAvailable and maxUnavailable" -}}
{{- else if not (kindIs "invalid" $g.pdb.minAvailable) -}}
{{- /* The budget renders with 2 replicas or more: there minAvailable equal to them blocks every eviction too. */ -}}
{{- $min := int $g.pdb.minAvailable -}}
{{- if or (gt $min (int $g.replicas)) (and (gt (int $g.replicas) 1) (ge $min (int $g.replicas))) -}}
{{- $errors = append $errors (printf "gateway.pdb.minAvailable is %d but gateway.replicas is %d: no gateway pod could ever be evicted, so node drains would wait forever (lower minAvailable below the replicas, use maxUnavailable, or disable the PDB)" $min (int $g.replicas)) -}}
{{- end -}}
{{- else if eq (int $g.pdb.maxUnavailable) 0 -}}
{{- $errors = append $errors "gateway.pdb.maxUnavailable is 0: no gateway pod could ever be evicted, so node drains would wait forever (use 1 or more, or disable the PDB)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* NetworkPolicy peers: Kubernetes takes an ipBlock alone or selectors, never both. */ -}}
{{- if $v.networkPolicy.enabled -}}
{{- range $key := list "clients" "gatewayClients" "metricsFrom" -}}
{{- range $n, $peer := index $v.networkPolicy $key -}}
{{- if and (hasKey $peer "ipBlock") (or (hasKey $peer "podSelector") (hasKey $peer "namespaceSelector")) -}}
{{- $errors = append $errors (printf "networkPolicy.%s[%d] has an ipBlock beside a podSelector or namespaceSelector: Kubernetes refuses such a peer; make them two entries (a source matching either is admitted)" $key $n) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* Flags the chart sets itself cannot also come from <component>.flags. */ -}}
{{- $server := list "listen" "metrics-port" "metrics-host" "tls-cert" "tls-key" "tls-ca" "plaintext" -}}
{{- $owned := dict
  "scheduler" (concat $server (list "worker-address" "cache-address" "auth-token-file" "token-file" "role" "decode-address" "reservation-timeout" "handoff-wait" "prefix-segment-tokens" "prefix-write"))
  "worker" (concat $server (list "device" "model" "cache-address" "cache-arena"))
  "cache" (concat $server (list "memory-budget" "unpinned-share" "arena-dir" "disk-dir" "disk-budget"))
  "gateway" (include "kvstash.gateway.ownedFlags" . | fromYamlArray) -}}
{{- range $component, $names := $owned -}}
{{- range $flag, $_ := (index $v $component).flags -}}
{{- $negated := trimPrefix "no-" $flag -}}
{{- if has $flag $names -}}
{{- $errors = append $errors (printf "%s.flags.%s is set by the chart: use the matching value in values.yaml" $component $flag) -}}
{{- else if and (hasPrefix "no-" $flag) (has $negated $names) -}}
{{- $errors = append $errors (printf "%s.flags.%s negates --%s, which is set by the chart: use the matching value in values.yaml" $component $flag $negated) -}}
{{- else if and (hasPrefix "no-" $flag) (ne $component "gateway") -}}
{{- /* No flag of these services is named no-...: kvstash/common/settings.py reads a switch's variable by its own name, and would ignore KVSTASH_<SERVICE>_NO_<FLAG>. */ -}}
{{- $errors = append $errors (printf "%s.flags.%s: write %s: false (a switch is passed by its own name; the service would ignore KVSTASH_%s_%s)" $component $flag $negated (upper $component) ($flag | replace "-" "_" | upper)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- if $errors -}}
{{- fail (printf "\n\nkvstash: inconsistent values:\n  - %s\n" (join "\n  - " $errors)) -}}
{{- end -}}
{{- end -}}
