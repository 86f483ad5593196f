{{/* Chart name, truncated for label values. */}}
{{- define "mmcast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource-name prefix. Truncated to 40 characters: the StatefulSet appends "-worker" and Kubernetes limits a
StatefulSet name to 52 (its pods get a controller-revision-hash label built from it).
*/}}
{{- define "mmcast.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mmcast.schedulerName" -}}{{ include "mmcast.fullname" . }}-scheduler{{- end }}
{{- define "mmcast.workerName" -}}{{ include "mmcast.fullname" . }}-worker{{- end }}

{{- define "mmcast.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mmcast.labels" -}}
helm.sh/chart: {{ include "mmcast.chart" . }}
{{ include "mmcast.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mmcast
{{- end }}

{{- define "mmcast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mmcast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "mmcast.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mmcast.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mmcast.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "mmcast.groupName" -}}{{ include "mmcast.fullname" . }}-group{{- end }}
{{- define "mmcast.headlessName" -}}{{ include "mmcast.fullname" . }}-headless{{- end }}

{{/*
How the release is laid out: `pod` (one pod per group), `lws` (multinode as a LeaderWorkerSet, when the cluster
serves leaderworkerset.x-k8s.io/v1) or `statefulset` (multinode without it: a scheduler Deployment + a rank
StatefulSet, one group).
*/}}
{{- define "mmcast.layout" -}}
{{- if eq .Values.topology "pod" }}pod
{{- else if .Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1" }}lws
{{- else }}statefulset
{{- end }}
{{- end }}

{{/* Component label of the pods that run a scheduler (and so take client traffic). */}}
{{- define "mmcast.clientComponent" -}}
{{- $layout := include "mmcast.layout" . }}
{{- if eq $layout "pod" }}group{{ else if eq $layout "lws" }}leader{{ else }}scheduler{{ end }}
{{- end }}

{{/* Labels the LeaderWorkerSet controller puts on every pod of a group (leaderworkerset.x-k8s.io/v1). */}}
{{- define "mmcast.lwsGroupIndexLabel" -}}leaderworkerset.sigs.k8s.io/group-index{{- end }}
{{- define "mmcast.lwsWorkerIndexLabel" -}}leaderworkerset.sigs.k8s.io/worker-index{{- end }}

{{/* DNS name of rank r of the LeaderWorkerSet group $(MMCAST_GROUP_INDEX): the leader is <lws>-<g>, the others
<lws>-<g>-<r>, under the headless Service the controller names after the LeaderWorkerSet. (list root rank) */}}
{{- define "mmcast.lwsHost" -}}
{{- $root := index . 0 }}
{{- $rank := int (index . 1) }}
{{- $name := include "mmcast.groupName" $root }}
{{- $pod := ternary (printf "%s-$(MMCAST_GROUP_INDEX)" $name) (printf "%s-$(MMCAST_GROUP_INDEX)-%d" $name $rank) (eq $rank 0) }}
{{- printf "%s.%s.%s.svc.%s" $pod $name $root.Release.Namespace $root.Values.clusterDomain }}
{{- end }}

{{/* The scheduler's --workers for the layout: ranks in its own pod on 127.0.0.1 (rank i's port = grpcPort + i in
`topology: pod`), the others by DNS name. */}}
{{- define "mmcast.schedulerWorkers" -}}
{{- $layout := include "mmcast.layout" . }}
{{- $targets := list }}
{{- range $rank := until (int .Values.tensorParallelSize) }}
{{- if eq $layout "pod" }}
{{- $targets = append $targets (printf "127.0.0.1:%d" (add $.Values.worker.grpcPort $rank)) }}
{{- else if and (eq $layout "lws") (eq $rank 0) }}
{{- $targets = append $targets (printf "127.0.0.1:%d" (int $.Values.worker.grpcPort)) }}
{{- else if eq $layout "lws" }}
{{- $targets = append $targets (printf "%s:%d" (include "mmcast.lwsHost" (list $ $rank)) (int $.Values.worker.grpcPort)) }}
{{- else }}
{{- $targets = append $targets (printf "%s:%d" (include "mmcast.workerHost" (list $ $rank)) (int $.Values.worker.grpcPort)) }}
{{- end }}
{{- end }}
{{- join "," $targets }}
{{- end }}

{{/* DNS name of one rank: <statefulset>-<ordinal>.<headless service>.<namespace>.svc.<clusterDomain>. */}}
{{- define "mmcast.workerHost" -}}
{{- $root := index . 0 }}
{{- $rank := index . 1 }}
{{- printf "%s-%d.%s.%s.svc.%s" (include "mmcast.workerName" $root) (int $rank) (include "mmcast.workerName" $root) $root.Release.Namespace $root.Values.clusterDomain }}
{{- end }}

{{- define "mmcast.schedulerId" -}}
{{- default (printf "%s/%s" .Release.Namespace .Release.Name) .Values.worker.schedulerId }}
{{- end }}

{{/* Folder of the model inside every container. */}}
{{- define "mmcast.modelDir" -}}
{{- if eq .Values.model.source "tiny" }}
{{- printf "%s/tiny" (trimSuffix "/" .Values.model.mountPath) }}
{{- else if .Values.model.pvc.path }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.pvc.path) }}
{{- else }}
{{- trimSuffix "/" .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* Checks that span several values; the schema covers each value alone. */}}
{{- define "mmcast.validate" -}}
{{- $sec := .Values.security }}
{{- if and (not (include "mmcast.workerTokenSecret" .)) (not $sec.workerTLS.secretName) (not $sec.insecure) }}
{{- fail "the rank streams would have no authentication: set security.workerToken.secretName (an existing Secret) or security.workerToken.create=true (the chart creates one), or security.workerTLS.secretName (mutual TLS); security.insecure=true serves them unauthenticated" }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName: the name of an existing PVC holding the model folder" }}
{{- end }}
{{- $grace := .Values.scheduler.terminationGracePeriodSeconds }}
{{- if and (not (kindIs "invalid" $grace)) (le (int $grace) (int .Values.scheduler.drainSeconds)) }}
{{- fail (printf "scheduler.terminationGracePeriodSeconds=%v must exceed scheduler.drainSeconds=%v, or in-flight requests are killed mid-drain" $grace .Values.scheduler.drainSeconds) }}
{{- end }}
{{- if and (not (kindIs "invalid" $grace)) (ne (include "mmcast.layout" .) "statefulset") (le (int $grace) (add .Values.scheduler.drainSeconds 5)) }}
{{- fail (printf "scheduler.terminationGracePeriodSeconds=%v must exceed scheduler.drainSeconds + 5 = %v with topology=%s: the ranks beside the scheduler wait out its drain, then take up to 5 s to stop" $grace (add .Values.scheduler.drainSeconds 5) .Values.topology) }}
{{- end }}
{{- range $component := list "group" "scheduler" "worker" }}
{{- $pdb := index $.Values.podDisruptionBudget $component }}
{{- if and (not (kindIs "invalid" $pdb.minAvailable)) (not (kindIs "invalid" $pdb.maxUnavailable)) }}
{{- fail (printf "podDisruptionBudget.%s: set minAvailable or maxUnavailable, not both (set the other to null)" $component) }}
{{- end }}
{{- if and $.Values.podDisruptionBudget.enabled (kindIs "invalid" $pdb.minAvailable) (kindIs "invalid" $pdb.maxUnavailable) }}
{{- fail (printf "podDisruptionBudget.%s: set minAvailable or maxUnavailable (both null would mean maxUnavailable 0, which blocks kubectl drain); the default is maxUnavailable: 1" $component) }}
{{- end }}
{{- end }}
{{- $layout := include "mmcast.layout" . }}
{{- if and (eq $layout "statefulset") (gt (int .Values.replicaCount) 1) }}
{{- fail (printf "replicaCount=%v with topology=multinode needs the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1), which this cluster does not serve: install LeaderWorkerSet, or install one release per group (docs/DEPLOYMENT.md section 4)" .Values.replicaCount) }}
{{- end }}
{{- $http := .Values.scheduler.http }}
{{- $readiness := .Values.scheduler.probes.readiness }}
{{- if and (eq $readiness.kind "http") (not $http.enabled) }}
{{- fail "scheduler.probes.readiness.kind=http needs scheduler.http.enabled=true: the probe calls GET /health on the scheduler's http port; enable the HTTP API or set the kind back to grpc" }}
{{- end }}
{{- if and (eq $readiness.kind "http") $sec.clientTLS.secretName $sec.clientTLS.requireClientCert }}
{{- fail "scheduler.probes.readiness.kind=http cannot be used with security.clientTLS.requireClientCert=true: the HTTP API then requires a client certificate, which the kubelet's probe does not present; keep kind=grpc (it uses the plaintext health port)" }}
{{- end }}
{{- if $http.enabled }}
{{- $taken := include "mmcast.schedulerPodPorts" . | fromJson }}
{{- with (get $taken (toString (int $http.port))) }}
{{- fail (printf "scheduler.http.port=%v is already %s in the scheduler's pod: pick another port" (int $http.port) .) }}
{{- end }}
{{- end }}
{{- if and (ne $layout "statefulset") $sec.workerTLS.secretName (not $sec.workerTLS.serverName) }}
{{- fail (printf "security.workerTLS needs security.workerTLS.serverName with topology=%s: the scheduler reaches the ranks in its own pod at 127.0.0.1, so name the certificate's DNS name it must verify" .Values.topology) }}
{{- end }}
{{- end }}

{{/* The other ports of the pod holding the scheduler, as JSON {port: "<value that sets it>"}: its own gRPC,
metrics and health ports, and in a group pod or LeaderWorkerSet leader the ports of the ranks beside it. */}}
{{- define "mmcast.schedulerPodPorts" -}}
{{- $v := .Values }}
{{- $ports := dict }}
{{- $layout := include "mmcast.layout" . }}
{{- $ranks := 0 }}
{{- if eq $layout "pod" }}{{ $ranks = int $v.tensorParallelSize }}{{ else if eq $layout "lws" }}{{ $ranks = 1 }}{{ end }}
{{- range $rank := until $ranks }}
{{- $offset := ternary $rank 0 (eq $layout "pod") }}
{{- $_ := set $ports (toString (add $v.worker.grpcPort $offset)) (printf "worker.grpcPort of rank %d" $rank) }}
{{- $_ = set $ports (toString (add $v.worker.metricsPort $offset)) (printf "worker.metricsPort of rank %d" $rank) }}
{{- if include "mmcast.workerTLS" $ }}
{{- $_ = set $ports (toString (add $v.security.workerTLS.healthPort $offset)) (printf "security.workerTLS.healthPort of rank %d" $rank) }}
{{- end }}
{{- end }}
{{- if gt $ranks 0 }}{{ $_ := set $ports (toString (int $v.worker.distPort)) "worker.distPort" }}{{ end }}
{{- if include "mmcast.clientTLS" . }}
{{- $_ := set $ports (toString (int $v.security.clientTLS.healthPort)) "security.clientTLS.healthPort" }}
{{- end }}
{{- $_ := set $ports (toString (int $v.scheduler.metricsPort)) "scheduler.metricsPort" }}
{{- $_ = set $ports (toString (int $v.scheduler.grpcPort)) "scheduler.grpcPort" }}
{{- toJson $ports }}
{{- end }}

{{/* Volumes shared by both components: model, /tmp, /dev/shm. Argument: (list root component). */}}
{{- define "mmcast.volumes" -}}
{{- $root := index . 0 }}
{{- $values := index $root.Values (index . 1) -}}
- name: model
{{- if eq $root.Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $root.Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ $values.tmpSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $values.shmSizeLimit }}
{{- with $root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Mounts of an mmcast container: (list root [tmp volume name]). */}}
{{- define "mmcast.volumeMounts" -}}
{{- $root := index . 0 -}}
- name: model
  mountPath: {{ $root.Values.model.mountPath }}
  readOnly: true
- name: {{ if gt (len .) 1 }}{{ index . 1 }}{{ else }}tmp{{ end }}
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- with $root.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes of a group pod (`topology: pod`): the model, /dev/shm shared by every container, a /tmp per container. */}}
{{- define "mmcast.groupVolumes" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scheduler.tmpSizeLimit }}
{{- range $rank := until (int .Values.tensorParallelSize) }}
- name: tmp-rank-{{ $rank }}
  emptyDir:
    sizeLimit: {{ $.Values.worker.tmpSizeLimit }}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.worker.shmSizeLimit }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Environment of every mmcast container: caches under the writable /tmp, offline model loading. */}}
{{- define "mmcast.commonEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: HF_HUB_OFFLINE
  value: "1"
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The init container that builds the tiny model into the pod's model emptyDir. */}}
{{- define "mmcast.tinyModelInit" -}}
{{- if eq .Values.model.source "tiny" -}}
- name: make-tiny-model
  image: {{ include "mmcast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["mmcast"]
  args:
    - make-tiny-model
    - {{ include "mmcast.modelDir" . | quote }}
    {{- range .Values.model.tiny.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "mmcast.commonEnv" . | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Container resources with the GPU count added under the configured resource name. (list root component) */}}
{{- define "mmcast.resources" -}}
{{- $root := index . 0 }}
{{- $values := index $root.Values (index . 1) }}
{{- $res := deepCopy (default dict $values.resources) }}
{{- if gt (int $values.gpus) 0 }}
{{- $limits := default dict (get $res "limits") }}
{{- $_ := set $limits $root.Values.gpu.resourceName (int $values.gpus) }}
{{- $_ = set $res "limits" $limits }}
{{- $requests := default dict (get $res "requests") }}
{{- $_ = set $requests $root.Values.gpu.resourceName (int $values.gpus) }}
{{- $_ = set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Native gRPC probes: (list probeValues port). */}}
{{- define "mmcast.grpcProbe" -}}
{{- $p := index . 0 -}}
grpc:
  port: {{ index . 1 }}
  service: {{ default "" $p.service | quote }}
periodSeconds: {{ $p.periodSeconds }}
failureThreshold: {{ $p.failureThreshold }}
timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}

{{/* The scheduler's HTTP readiness probe: GET /health on its `http` port (200 only while the group serves).
(list probeValues scheme) */}}
{{- define "mmcast.httpProbe" -}}
{{- $p := index . 0 -}}
httpGet:
  path: /health
  port: http
  scheme: {{ index . 1 }}
periodSeconds: {{ $p.periodSeconds }}
failureThreshold: {{ $p.failureThreshold }}
timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}

{{/* Scheme of the scheduler's HTTP API: it takes the client port's TLS. */}}
{{- define "mmcast.httpScheme" -}}{{ if include "mmcast.clientTLS" . }}HTTPS{{ else }}HTTP{{ end }}{{- end }}

{{- define "mmcast.scrapeAnnotations" -}}
{{- if .root.Values.prometheusScrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Security (docs/SECURITY.md): Secrets mounted read-only under /etc/mmcast, and the flags that point at them. */}}
{{- define "mmcast.clientTLS" -}}{{ if .Values.security.clientTLS.secretName }}true{{ end }}{{- end }}
{{- define "mmcast.workerTLS" -}}{{ if .Values.security.workerTLS.secretName }}true{{ end }}{{- end }}

{{/* The worker-token Secret in use: the existing one named, else the chart's own when created, else "". */}}
{{- define "mmcast.workerTokenSecret" -}}
{{- $t := .Values.security.workerToken }}
{{- if $t.secretName }}{{ $t.secretName }}{{ else if $t.create }}{{ include "mmcast.fullname" . }}-worker-token{{ end }}
{{- end }}

{{/* Port the kubelet's gRPC probes use: the plaintext health port while the gRPC port is TLS. (list root component) */}}
{{- define "mmcast.probePort" -}}
{{- $root := index . 0 }}
{{- if eq (index . 1) "scheduler" }}
{{- ternary $root.Values.security.clientTLS.healthPort $root.Values.scheduler.grpcPort (eq (include "mmcast.clientTLS" $root) "true") }}
{{- else }}
{{- ternary $root.Values.security.workerTLS.healthPort $root.Values.worker.grpcPort (eq (include "mmcast.workerTLS" $root) "true") }}
{{- end }}
{{- end }}

{{/* The secret volumes of a component. (list root component) */}}
{{- define "mmcast.securityVolumes" -}}
{{- $root := index . 0 }}
{{- $sec := $root.Values.security }}
{{- $scheduler := eq (index . 1) "scheduler" }}
{{- if and $scheduler $sec.clientTLS.secretName }}
- name: client-tls
  secret:
    secretName: {{ $sec.clientTLS.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and $scheduler $sec.authTokens.secretName }}
- name: auth-tokens
  secret:
    secretName: {{ $sec.authTokens.secretName }}
    defaultMode: 0440
{{- end }}
{{- if $sec.workerTLS.secretName }}
- name: worker-tls
  secret:
    secretName: {{ $sec.workerTLS.secretName }}
    defaultMode: 0440
{{- end }}
{{- with (include "mmcast.workerTokenSecret" $root) }}
- name: worker-token
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "mmcast.securityMounts" -}}
{{- $root := index . 0 }}
{{- $sec := $root.Values.security }}
{{- $scheduler := eq (index . 1) "scheduler" }}
{{- if and $scheduler $sec.clientTLS.secretName }}
- name: client-tls
  mountPath: /etc/mmcast/client-tls
  readOnly: true
{{- end }}
{{- if and $scheduler $sec.authTokens.secretName }}
- name: auth-tokens
  mountPath: /etc/mmcast/auth-tokens
  readOnly: true
{{- end }}
{{- if $sec.workerTLS.secretName }}
- name: worker-tls
  mountPath: /etc/mmcast/worker-tls
  readOnly: true
{{- end }}
{{- if include "mmcast.workerTokenSecret" $root }}
- name: worker-token
  mountPath: /etc/mmcast/worker-token
  readOnly: true
{{- end }}
{{- end }}

{{/* (list root component [rank health port]) */}}
{{- define "mmcast.securityArgs" -}}
{{- $root := index . 0 }}
{{- $sec := $root.Values.security }}
{{- $workerHealth := $sec.workerTLS.healthPort }}
{{- if gt (len .) 2 }}{{ $workerHealth = index . 2 }}{{ end }}
{{- if eq (index . 1) "scheduler" }}
{{- if $sec.clientTLS.secretName }}
- --tls-cert-file=/etc/mmcast/client-tls/tls.crt
- --tls-key-file=/etc/mmcast/client-tls/tls.key
{{- if $sec.clientTLS.requireClientCert }}
- --tls-client-ca-file=/etc/mmcast/client-tls/ca.crt
{{- end }}
- --health-port={{ $sec.clientTLS.healthPort }}
{{- end }}
{{- if $sec.authTokens.secretName }}
- --auth-tokens-file=/etc/mmcast/auth-tokens/{{ $sec.authTokens.key }}
{{- end }}
{{- if $sec.workerTLS.secretName }}
- --worker-tls-ca-file=/etc/mmcast/worker-tls/ca.crt
- --worker-tls-cert-file=/etc/mmcast/worker-tls/tls.crt
- --worker-tls-key-file=/etc/mmcast/worker-tls/tls.key
{{- with $sec.workerTLS.serverName }}
- --worker-tls-server-name={{ . }}
{{- end }}
{{- end }}
{{- if include "mmcast.workerTokenSecret" $root }}
- --worker-token-file=/etc/mmcast/worker-token/{{ $sec.workerToken.key }}
{{- end }}
{{- else }}
{{- if $sec.workerTLS.secretName }}
- --tls-cert-file=/etc/mmcast/worker-tls/tls.crt
- --tls-key-file=/etc/mmcast/worker-tls/tls.key
- --tls-client-ca-file=/etc/mmcast/worker-tls/ca.crt
- --health-port={{ $workerHealth }}
{{- end }}
{{- if include "mmcast.workerTokenSecret" $root }}
- --shared-token-file=/etc/mmcast/worker-token/{{ $sec.workerToken.key }}
{{- else if not $sec.workerTLS.secretName }}
- --insecure-allow-unauthenticated=true
{{- end }}
{{- end }}
{{- end }}
