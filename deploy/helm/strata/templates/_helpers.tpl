{{/* Names, labels and the environment every Strata process shares. */}}

{{- define "strata.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "strata.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (list $ "web"). */}}
{{- define "strata.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "strata.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "strata.nodeImage" -}}
{{ .Values.nodeImage.repository }}:{{ .Values.nodeImage.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "strata.appSecret" -}}
{{- .Values.existingSecret | default (printf "%s-app" (include "strata.fullname" .)) -}}
{{- end -}}

{{- define "strata.databaseSecret" -}}
{{- if .Values.postgresql.enabled -}}
{{- printf "%s-postgresql" (include "strata.fullname" .) -}}
{{- else -}}
{{- required "externalDatabase.existingSecret: name the Secret holding DATABASE_URL (or enable postgresql)" .Values.externalDatabase.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "strata.databaseKey" -}}
{{- ternary "database-url" .Values.externalDatabase.key .Values.postgresql.enabled -}}
{{- end -}}

{{- define "strata.redisSecret" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s-redis" (include "strata.fullname" .) -}}
{{- else -}}
{{- required "externalRedis.existingSecret: name the Secret holding REDIS_URL (or enable redis)" .Values.externalRedis.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "strata.redisKey" -}}
{{- ternary "redis-url" .Values.externalRedis.key .Values.redis.enabled -}}
{{- end -}}

{{- define "strata.nodeCredentialsSecret" -}}
{{- printf "%s-node-credentials" (include "strata.fullname" .) -}}
{{- end -}}

{{/* Node names: the StatefulSet's pod names. */}}
{{- define "strata.nodeNames" -}}
{{- $fullname := include "strata.fullname" . -}}
{{- range $i := until (int .Values.nodes.replicas) -}}
{{ printf "%s-node-%d " $fullname $i }}
{{- end -}}
{{- end -}}

{{/* Settings and secrets of the node processes and the control plane alike (each has its own
URLs: a node's are its own credential's). */}}
{{- define "strata.sharedEnv" -}}
- name: DJANGO_SETTINGS_MODULE
  value: controlplane.settings.prod
- name: STRATA_SECRET_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "strata.appSecret" . }}, key: secret-key}
{{- end -}}

{{/* The control plane's environment: its own DATABASE_URL, and the host names it answers to. */}}
{{- define "strata.controlPlaneEnv" -}}
{{- $fullname := include "strata.fullname" . -}}
{{- $hosts := list "$(POD_IP)" "localhost" "127.0.0.1" -}}
{{- range $service := list "web" "api" -}}
{{- $hosts = append $hosts (printf "%s-%s" $fullname $service) -}}
{{- $hosts = append $hosts (printf "%s-%s.%s.svc" $fullname $service $.Release.Namespace) -}}
{{- end -}}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{ include "strata.sharedEnv" . }}
# The key nodes without a credential of their own are read with; each node of this chart has its own.
- name: STRATA_NODE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "strata.appSecret" . }}, key: node-admin-key}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef: {name: {{ include "strata.databaseSecret" . }}, key: {{ include "strata.databaseKey" . }}}
- name: REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ include "strata.redisSecret" . }}, key: {{ include "strata.redisKey" . }}}
- name: STRATA_ALLOWED_HOSTS
  value: {{ join "," (concat $hosts .Values.allowedHosts) | quote }}
- name: STRATA_SSL_REDIRECT
  value: {{ .Values.sslRedirect | quote }}
{{- if .Values.proxySslHeader }}
- name: STRATA_PROXY_SSL_HEADER
  value: {{ .Values.proxySslHeader | quote }}
{{- end }}
{{- end -}}

{{/* A control-plane container's hardening and its writable /tmp (the root filesystem is read-only). */}}
{{- define "strata.controlPlaneContainer" -}}
image: {{ include "strata.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - {name: tmp, mountPath: /tmp}
{{- end -}}

{{- define "strata.controlPlanePod" -}}
serviceAccountName: {{ include "strata.fullname" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: tmp
    emptyDir: {}
{{- end -}}
