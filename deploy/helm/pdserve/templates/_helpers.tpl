{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "pdserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* PDSERVE_REDIS_URL: built in the pod's environment from the password Secret (in-chart
     Redis), or the whole URL from a Secret (external). Never on a command line. */}}
{{- define "pdserve.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.key }}
- name: PDSERVE_REDIS_URL
  value: redis://:$(PDSERVE_REDIS_PASSWORD)@{{ include "pdserve.fullname" . }}-redis:6379/{{ .Values.redis.db }}
{{- else }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "redis.enabled=false needs redis.external.urlSecret (a Secret holding the Redis URL)" .Values.redis.external.urlSecret }}
      key: {{ .Values.redis.external.urlKey }}
{{- end }}
{{- if .Values.clusterSecret.enabled }}
- name: PDSERVE_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.clusterSecretName" . }}
      key: {{ .Values.clusterSecret.key }}
{{- end }}
{{- with .Values.monitoring.auth.existingSecret }}
- name: PDSERVE_METRICS_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.monitoring.auth.key }}
{{- end }}
{{- end -}}

{{- define "pdserve.clusterSecretName" -}}
{{- default (printf "%s-cluster" (include "pdserve.fullname" .)) .Values.clusterSecret.existingSecret -}}
{{- end -}}

{{/* A probe on a gRPC port: gRPC health, or the port itself under TLS (kubelet's gRPC
     probes speak plaintext only). */}}
{{/* Liveness: the process is up and its port accepts connections. Never gRPC health: a
     draining worker or router reports NOT_SERVING on purpose (so readiness takes it out of
     the Service) while it finishes its streams, and a liveness probe that failed then would
     restart it mid-drain. */}}
{{- define "pdserve.liveness" -}}
tcpSocket:
  port: {{ .port }}
{{- end -}}

{{- define "pdserve.probe" -}}
{{- if .root.Values.tls.enabled }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end -}}

{{/* The TLS flags of a component (pdserve.serving.security.args): files of the mounted
     Secret. Workers: their servers and mTLS between workers; the router: its public servers,
     and mTLS to the workers. */}}
{{- define "pdserve.tlsArgs" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled }}
- --tls-cert
- {{ $t.mountPath }}/tls.crt
- --tls-key
- {{ $t.mountPath }}/tls.key
{{- if or (ne .component "router") $t.clientCertsOnPublicAPI }}
- --tls-ca
- {{ $t.mountPath }}/ca.crt
{{- end }}
{{- if eq .component "router" }}
- --internal-tls-ca
- {{ $t.mountPath }}/ca.crt
{{- with $t.serverName }}
- --internal-tls-server-name
- {{ . }}
{{- end }}
{{- else }}
{{- with $t.serverName }}
- --tls-server-name
- {{ . }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.commonMounts" -}}
- name: model
  mountPath: {{ dir .Values.model.path }}
  readOnly: true
- name: home
  mountPath: /home/pdserve
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.commonVolumes" -}}
- name: model
{{- if .Values.model.hostPath }}
  hostPath:
    path: {{ .Values.model.hostPath }}
    type: Directory
{{- else }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" (include "pdserve.fullname" .)) .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
- name: home
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.enabled needs tls.secretName" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Spread a component's pods over nodes: a node drain or loss takes one, not the pool. */}}
{{- define "pdserve.spread" -}}
{{- $cfg := .cfg -}}
{{- if $cfg.affinity }}
affinity:
  {{- toYaml $cfg.affinity | nindent 2 }}
{{- else if $cfg.spreadAcrossNodes }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "pdserve.selectorLabels" . | nindent 14 }}
{{- end }}
{{- if $cfg.spreadAcrossNodes }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "pdserve.selectorLabels" . | nindent 8 }}
  - maxSkew: 1
    topologyKey: topology.kubernetes.io/zone
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "pdserve.selectorLabels" . | nindent 8 }}
{{- end }}
{{- with $cfg.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $cfg.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.podAnnotations" -}}
{{- if .root.Values.monitoring.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Seconds a stopping worker needs: 2 s of notice after leaving the registry, then its
     drain timeout; SIGKILL must not land in the middle (plus 10 s to exit). */}}
{{- define "pdserve.workerGrace" -}}
{{- add 2 .drainTimeoutSeconds 10 -}}
{{- end -}}
