{{/*
Containers and pod-level settings shared by the layouts (group pod, LeaderWorkerSet, scheduler Deployment + rank
StatefulSet): one definition of the scheduler container and of a rank container, so every layout passes the
services the same flags.
*/}}

{{/* The scheduler container. (dict "root" . "tmp" <its /tmp volume>) */}}
{{- define "mmcast.schedulerContainer" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
- name: scheduler
  image: {{ include "mmcast.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["mmcast-scheduler"]
  args:
    - --listen=0.0.0.0:{{ $v.scheduler.grpcPort }}
    - --metrics-port={{ $v.scheduler.metricsPort }}
    - --workers={{ include "mmcast.schedulerWorkers" $root }}
    - --model={{ include "mmcast.modelDir" $root }}
    - --transfer-mode={{ $v.transferMode }}
    - --max-num-batched-tokens={{ $v.scheduler.limits.maxNumBatchedTokens }}
    - --max-num-seqs={{ $v.scheduler.limits.maxNumSeqs }}
    - --max-waiting={{ $v.scheduler.limits.maxWaiting }}
    - --max-images-per-request={{ $v.scheduler.limits.maxImagesPerRequest }}
    - --max-image-pixels={{ int64 $v.scheduler.limits.maxImagePixels }}
    - --max-videos-per-request={{ $v.scheduler.limits.maxVideosPerRequest }}
    - --max-video-frames={{ $v.scheduler.limits.maxVideoFrames }}
    - --max-video-seconds={{ $v.scheduler.limits.maxVideoSeconds }}
    - --max-video-frame-pixels={{ int64 $v.scheduler.limits.maxVideoFramePixels }}
    - --max-request-bytes={{ int64 $v.scheduler.limits.maxRequestBytes }}
    - --chunk-size-bytes={{ int64 $v.scheduler.chunkSizeBytes }}
    - --group-deadline-seconds={{ $v.scheduler.groupDeadlineSeconds }}
    - --drain-seconds={{ $v.scheduler.drainSeconds }}
    {{- if $v.scheduler.http.enabled }}
    - --http-port={{ $v.scheduler.http.port }}
    {{- end }}
    - --scheduler-id={{ include "mmcast.schedulerId" $root }}
    - --log-level={{ upper $v.logLevel }}
    {{- with (include "mmcast.securityArgs" (list $root "scheduler")) }}
    {{- . | trim | nindent 4 }}
    {{- end }}
    {{- range $v.scheduler.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "mmcast.commonEnv" $root | nindent 4 }}
    {{- if eq (include "mmcast.layout" $root) "lws" }}
    - name: MMCAST_GROUP_INDEX
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['{{ include "mmcast.lwsGroupIndexLabel" $root }}']
    {{- end }}
    {{- with $v.scheduler.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $v.scheduler.grpcPort }}
      protocol: TCP
    - name: metrics
      containerPort: {{ $v.scheduler.metricsPort }}
      protocol: TCP
    {{- if $v.scheduler.http.enabled }}
    - name: http
      containerPort: {{ $v.scheduler.http.port }}
      protocol: TCP
    {{- end }}
    {{- if include "mmcast.clientTLS" $root }}
    - name: health
      containerPort: {{ $v.security.clientTLS.healthPort }}
      protocol: TCP
    {{- end }}
  startupProbe:
    {{- include "mmcast.grpcProbe" (list $v.scheduler.probes.startup (include "mmcast.probePort" (list $root "scheduler"))) | nindent 4 }}
  readinessProbe:
    {{- if eq $v.scheduler.probes.readiness.kind "http" }}
    {{- include "mmcast.httpProbe" (list $v.scheduler.probes.readiness (include "mmcast.httpScheme" $root)) | nindent 4 }}
    {{- else }}
    {{- include "mmcast.grpcProbe" (list $v.scheduler.probes.readiness (include "mmcast.probePort" (list $root "scheduler"))) | nindent 4 }}
    {{- end }}
  livenessProbe:
    {{- include "mmcast.grpcProbe" (list (merge (dict "service" "") $v.scheduler.probes.liveness) (include "mmcast.probePort" (list $root "scheduler"))) | nindent 4 }}
  resources:
    {{- include "mmcast.resources" (list $root "scheduler") | nindent 4 }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "mmcast.volumeMounts" (list $root .tmp) | nindent 4 }}
    {{- with (include "mmcast.securityMounts" (list $root "scheduler")) }}
    {{- . | trim | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
A rank container in a group pod or a LeaderWorkerSet pod.
(dict "root" . "name" <container> "rank" <int, or -1: MMCAST_RANK from the LeaderWorkerSet worker-index label>
      "offset" <added to every port of the rank> "distHost" <rank 0's host> "bindLocal" <rank 0's store on 127.0.0.1 only; given to every rank>
      "tmp" <its /tmp volume>)
*/}}
{{- define "mmcast.rankContainer" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $offset := int .offset -}}
{{- $tls := include "mmcast.workerTLS" $root -}}
{{- $grpc := add $v.worker.grpcPort $offset -}}
{{- $health := add $v.security.workerTLS.healthPort $offset -}}
{{- $probePort := ternary $health $grpc (eq $tls "true") -}}
{{- $lws := eq (include "mmcast.layout" $root) "lws" -}}
{{- /* Port names are unique in a pod and at most 15 characters: rank<i>-metrics in a group pod. */ -}}
{{- $prefix := ternary "rank-" (printf "rank%d-" $offset) $lws -}}
- name: {{ .name }}
  image: {{ include "mmcast.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["mmcast-worker"]
  args:
    {{- if ge (int .rank) 0 }}
    - --rank={{ .rank }}
    {{- end }}
    - --world-size={{ $v.tensorParallelSize }}
    - --listen=0.0.0.0:{{ $grpc }}
    - --dist-init=tcp://{{ .distHost }}:{{ $v.worker.distPort }}
    {{- if .bindLocal }}
    - --dist-bind-host=127.0.0.1
    {{- end }}
    - --model={{ include "mmcast.modelDir" $root }}
    - --device={{ $v.worker.device }}
    - --dtype={{ $v.worker.dtype }}
    - --kv-blocks={{ $v.worker.kvBlocks }}
    - --metrics-port={{ add $v.worker.metricsPort $offset }}
    - --payload-cache-bytes={{ int64 $v.worker.payloadCacheBytes }}
    - --encoder-cache-tokens={{ $v.worker.encoderCacheTokens }}
    - --scheduler-id={{ include "mmcast.schedulerId" $root }}
    - --log-level={{ lower $v.logLevel }}
    {{- with (include "mmcast.securityArgs" (list $root "worker" $health)) }}
    {{- . | trim | nindent 4 }}
    {{- end }}
    {{- range $v.worker.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "mmcast.commonEnv" $root | nindent 4 }}
    {{- if $lws }}
    - name: MMCAST_GROUP_INDEX
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['{{ include "mmcast.lwsGroupIndexLabel" $root }}']
    {{- end }}
    {{- if lt (int .rank) 0 }}
    - name: MMCAST_RANK
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['{{ include "mmcast.lwsWorkerIndexLabel" $root }}']
    {{- end }}
    {{- if and (eq (include "mmcast.layout" $root) "pod") $v.worker.loopbackCollectives }}
    {{- $names := list }}
    {{- range $v.worker.extraEnv }}{{ $names = append $names .name }}{{ end }}
    {{- range $name := list "GLOO_SOCKET_IFNAME" "NCCL_SOCKET_IFNAME" }}
    {{- if not (has $name $names) }}
    - name: {{ $name }}
      value: lo
    {{- end }}
    {{- end }}
    {{- end }}
    {{- with $v.worker.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ $prefix }}grpc
      containerPort: {{ $grpc }}
      protocol: TCP
    - name: {{ $prefix }}metrics
      containerPort: {{ add $v.worker.metricsPort $offset }}
      protocol: TCP
    {{- if $tls }}
    - name: {{ $prefix }}health
      containerPort: {{ $health }}
      protocol: TCP
    {{- end }}
    {{- if eq (int .rank) 0 }}
    - name: {{ $prefix }}dist
      containerPort: {{ $v.worker.distPort }}
      protocol: TCP
    {{- end }}
  lifecycle:
    preStop:
      exec:
        # The kubelet signals every container of a pod (and, in a LeaderWorkerSet, every pod of a group) at once:
        # a rank stays up through its scheduler's drain (--drain-seconds), then stops within 5 s of SIGTERM.
        command: ["sleep", "{{ $v.scheduler.drainSeconds }}"]
  startupProbe:
    {{- include "mmcast.grpcProbe" (list $v.worker.probes.startup $probePort) | nindent 4 }}
  readinessProbe:
    {{- include "mmcast.grpcProbe" (list $v.worker.probes.readiness $probePort) | nindent 4 }}
  livenessProbe:
    {{- include "mmcast.grpcProbe" (list (merge (dict "service" "") $v.worker.probes.liveness) $probePort) | nindent 4 }}
  resources:
    {{- include "mmcast.resources" (list $root "worker") | nindent 4 }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "mmcast.volumeMounts" (list $root .tmp) | nindent 4 }}
    {{- with (include "mmcast.securityMounts" (list $root "worker")) }}
    {{- . | trim | nindent 4 }}
    {{- end }}
{{- end }}

{{/* Pod-level settings before the containers. (list root component) */}}
{{- define "mmcast.podSpecHead" -}}
{{- $root := index . 0 -}}
{{- $c := index $root.Values (index . 1) -}}
serviceAccountName: {{ include "mmcast.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $c.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with (include "mmcast.tinyModelInit" $root) }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level placement after the volumes. (list root component) */}}
{{- define "mmcast.podSpecPlacement" -}}
{{- $c := index (index . 0).Values (index . 1) -}}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: the component's own plus the scrape annotations of its first metrics port. (list root component port) */}}
{{- define "mmcast.podAnnotations" -}}
{{- $root := index . 0 -}}
{{- $c := index $root.Values (index . 1) -}}
{{- $annotations := merge (dict) (default dict $c.podAnnotations) (include "mmcast.scrapeAnnotations" (dict "root" $root "port" (index . 2)) | fromYaml) }}
{{- with $annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Grace period of a pod holding a scheduler: the larger of the worker's and drainSeconds + 15 (or the scheduler's own). */}}
{{- define "mmcast.schedulerGrace" -}}
{{- $grace := .Values.scheduler.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $grace }}{{ $grace = add (int .Values.scheduler.drainSeconds) 15 }}{{ end }}
{{- int $grace }}
{{- end }}
