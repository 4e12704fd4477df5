{{/* vim: set filetype=mustache: */}}
{{- define "agentplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "agentplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "agentplane.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of a component's resources. Call with (dict "root" $ "component" "session"). */}}
{{- define "agentplane.componentName" -}}
{{- printf "%s-%s" (include "agentplane.fullname" .root) .component -}}
{{- end -}}

{{/* Selector labels: stable across upgrades. Call with (dict "root" $ "component" "session"). */}}
{{- define "agentplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentplane.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every resource. Call with (dict "root" $ "component" "session"). */}}
{{- define "agentplane.labels" -}}
helm.sh/chart: {{ include "agentplane.chart" .root }}
{{ include "agentplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: agentplane
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels that select every pod of the release (NetworkPolicy peers). */}}
{{- define "agentplane.releaseSelector" -}}
app.kubernetes.io/name: {{ include "agentplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "agentplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "agentplane.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "agentplane.secretName" -}}
{{- default (printf "%s-secrets" (include "agentplane.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "agentplane.configName" -}}
{{- printf "%s-config" (include "agentplane.fullname" .) -}}
{{- end -}}

{{- define "agentplane.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the Redis password comes from the Secret (key secrets.keys.redisPassword). */}}
{{- define "agentplane.redisPasswordEnabled" -}}
{{- if or .Values.redis.usePassword .Values.redis.password .Values.redis.bundled.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The Redis URL the services use. Fails when no Redis is configured, and when the URL carries a
password: that belongs in the Secret (redis.password or the existing Secret's key), which the
services read from a file (AGENTPLANE_REDIS_PASSWORD_FILE), while the URL is a plain value.
*/}}
{{- define "agentplane.redisURL" -}}
{{- $url := "" -}}
{{- if .Values.redis.url -}}
{{- $url = .Values.redis.url -}}
{{- else if .Values.redis.bundled.enabled -}}
{{- $url = printf "redis://%s-redis.%s.svc:6379/0" (include "agentplane.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- fail "agentplane: no Redis configured: set redis.url to an external Redis (redis://, rediss://, redis+sentinel://, redis+cluster://, unix://) or redis.bundled.enabled=true to try the chart" -}}
{{- end -}}
{{- if regexMatch "^[^:]+://[^/?@]*:[^/?@]*@" $url -}}
{{- fail "agentplane: redis.url carries a password: put it in redis.password (or the existing Secret's redis-password key with redis.usePassword=true); the services read it from a mounted file" -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{/* Where each pod mounts its Secret keys as files. */}}
{{- define "agentplane.secretsDir" -}}/etc/agentplane/secrets{{- end -}}

{{/* gRPC address a peer dials. Call with (dict "root" $ "component" "sandbox"). */}}
{{- define "agentplane.peerAddr" -}}
{{- $c := index .root.Values .component -}}
{{- $name := include "agentplane.componentName" . -}}
{{- if .root.Values.headlessService.enabled -}}
{{- printf "dns:///%s-headless.%s.svc:%d" $name .root.Release.Namespace (int $c.ports.grpc) -}}
{{- else -}}
{{- printf "%s.%s.svc:%d" $name .root.Release.Namespace (int $c.ports.grpc) -}}
{{- end -}}
{{- end -}}

{{- define "agentplane.proxyURL" -}}
{{- if .Values.credential.proxy.url -}}
{{- .Values.credential.proxy.url -}}
{{- else -}}
{{- printf "http://%s-proxy.%s.svc:%d" (include "agentplane.fullname" .) .Release.Namespace (int .Values.credential.ports.proxy) -}}
{{- end -}}
{{- end -}}

{{/* drain delay + graceful-stop bound + margin, in seconds. */}}
{{- define "agentplane.terminationGracePeriodSeconds" -}}
{{- $s := .Values.shutdown -}}
{{- add (int $s.drainDelaySeconds) (int $s.timeoutSeconds) (int $s.extraGraceSeconds) -}}
{{- end -}}

{{/* A seccomp or AppArmor profile: localhostProfile only with type Localhost (the API refuses it otherwise, e.g. after --set ...type=Unconfined over the default). */}}
{{- define "agentplane.profile" -}}
type: {{ .type }}
{{- if eq .type "Localhost" }}
localhostProfile: {{ required "sandbox.namespaces: a Localhost profile needs localhostProfile" .localhostProfile }}
{{- end }}
{{- end -}}

{{/* Container securityContext: global defaults overlaid with the component's. */}}
{{- define "agentplane.containerSecurityContext" -}}
{{- /* A shallow overlay, not mergeOverwrite: mergeOverwrite ignores false, so a component could not turn readOnlyRootFilesystem off. */ -}}
{{- $base := deepCopy .root.Values.containerSecurityContext -}}
{{- $c := index .root.Values .component -}}
{{- if and (eq .component "sandbox") (eq $c.isolation "namespaces") -}}
{{- /* What bubblewrap needs (statefulset-sandbox.yaml); the component's own overlay below still wins. */ -}}
{{- $_ := set $base "procMount" "Unmasked" -}}
{{- $_ := set $base "seccompProfile" (include "agentplane.profile" $c.namespaces.seccompProfile | fromYaml) -}}
{{- $_ := set $base "appArmorProfile" (include "agentplane.profile" $c.namespaces.appArmorProfile | fromYaml) -}}
{{- end -}}
{{- range $k, $v := ((index .root.Values .component).containerSecurityContext | default dict) -}}
{{- $_ := set $base $k $v -}}
{{- end -}}
{{- toYaml $base -}}
{{- end -}}

{{/*
A map of agent profile to duration as profile=duration,... sorted by
profile (AGENTPLANE_SESSION_SUSPEND_AFTER_PROFILES).
*/}}
{{- define "agentplane.profileDurations" -}}
{{- $out := list }}
{{- range $k, $v := . }}
{{- $out = append $out (printf "%s=%s" $k (toString $v)) }}
{{- end }}
{{- join "," $out }}
{{- end }}

{{/* A map of agent profile to hosts as profile=host|host,... (AGENT_EXPECTED_DENIALS). */}}
{{- define "agentplane.profileHosts" -}}
{{- $out := list }}
{{- range $k, $v := . }}
{{- $out = append $out (printf "%s=%s" $k (join "|" $v)) }}
{{- end }}
{{- join "," $out }}
{{- end }}
