{{/*
Pod template shared by the four services. Call with (dict "root" $ "component" "session").
Every service is the same image and binary; `agentplane serve <component>` runs it.
*/}}
{{- define "agentplane.podTemplate" -}}
{{- $root := .root -}}
{{- $component := .component -}}
{{- $c := index $root.Values $component -}}
{{- $secret := include "agentplane.secretName" $root -}}
{{- $keys := $root.Values.secrets.keys -}}
{{- $isolated := and (eq $component "sandbox") (eq $c.isolation "namespaces") -}}
{{- /* The secrets this service reads, each mounted as a file and named by its AGENTPLANE_*_FILE. */ -}}
{{- $secretFiles := list (dict "env" "AGENTPLANE_INTERNAL_TOKEN_FILE" "key" $keys.internalToken "path" "internal-token") -}}
{{- if include "agentplane.redisPasswordEnabled" $root -}}
{{- $secretFiles = append $secretFiles (dict "env" "AGENTPLANE_REDIS_PASSWORD_FILE" "key" $keys.redisPassword "path" "redis-password") -}}
{{- end -}}
{{- if eq $component "credential" -}}
{{- $secretFiles = append $secretFiles (dict "env" "AGENTPLANE_CREDENTIAL_KEY_FILE" "key" $keys.credentialKey "path" "credential-key") -}}
{{- $secretFiles = append $secretFiles (dict "env" "AGENTPLANE_ATTESTATION_KEY_FILE" "key" $keys.attestationKey "path" "attestation-key") -}}
{{- end -}}
metadata:
  labels:
    {{- include "agentplane.labels" . | nindent 4 }}
    {{- with $c.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- if not $root.Values.secrets.existingSecret }}
    checksum/secret-spec: {{ pick $root.Values.secrets "internalToken" "credentialKey" "attestationKey" | toJson | cat $root.Values.redis.password | sha256sum }}
    {{- end }}
    {{- with $c.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "agentplane.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  # The service drains by itself on SIGTERM: health NOT_SERVING, AGENTPLANE_DRAIN_DELAY,
  # then GracefulStop bounded by AGENTPLANE_SHUTDOWN_TIMEOUT. The grace period covers both
  # plus a margin, so the kubelet never SIGKILLs a pod that is still within its bounds.
  terminationGracePeriodSeconds: {{ include "agentplane.terminationGracePeriodSeconds" $root }}
  {{- if $isolated }}
  # A user namespace of its own: bubblewrap nests each sandbox's user namespace in it, and
  # the container's uids map to unprivileged host uids (statefulset-sandbox.yaml says why).
  hostUsers: false
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $c.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $component }}
      image: {{ include "agentplane.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args: ["serve", {{ $component | quote }}]
      ports:
        - name: grpc
          containerPort: {{ $c.ports.grpc }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $c.ports.metrics }}
          protocol: TCP
        {{- if eq $component "credential" }}
        - name: proxy
          containerPort: {{ $c.ports.proxy }}
          protocol: TCP
        {{- end }}
      envFrom:
        - configMapRef:
            name: {{ include "agentplane.configName" $root }}
      env:
        - name: AGENTPLANE_GRPC_ADDR
          value: {{ printf ":%d" (int $c.ports.grpc) | quote }}
        - name: AGENTPLANE_METRICS_ADDR
          value: {{ printf ":%d" (int $c.ports.metrics) | quote }}
        # Secrets are files in the secrets volume, never environment values.
        {{- range $secretFiles }}
        - name: {{ .env }}
          value: {{ printf "%s/%s" (include "agentplane.secretsDir" $root) .path | quote }}
        {{- end }}
        - name: AGENTPLANE_REDIS_URL
          value: {{ include "agentplane.redisURL" $root | quote }}
        {{- if eq $component "sandbox" }}
        - name: AGENTPLANE_SANDBOX_ISOLATION
          value: {{ $c.isolation | quote }}
        # The owner lease of each sandbox names this address, so callers
        # send the sandbox's calls to the pod that owns it.
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        - name: AGENTPLANE_SANDBOX_ADVERTISE_ADDR
          value: {{ printf "$(POD_IP):%d" (int $c.ports.grpc) | quote }}
        - name: AGENTPLANE_SANDBOX_ROOT
          value: {{ $c.root | quote }}
        - name: AGENTPLANE_WRAPPER_BIN
          value: {{ $c.wrapperBin | quote }}
        - name: AGENTPLANE_SANDBOX_PROXY_URL
          value: {{ include "agentplane.proxyURL" $root | quote }}
        - name: AGENTPLANE_SANDBOX_EGRESS_ALLOW
          value: {{ join "," $c.egress.allow | quote }}
        {{- with $c.pool }}
        - name: AGENTPLANE_SANDBOX_POOL
          value: {{ include "agentplane.profileDurations" (.sizes | default dict) | quote }}
        - name: AGENTPLANE_SANDBOX_POOL_DIRECTORY
          value: {{ .directory | quote }}
        {{- end }}
        {{- with $c.egress.expectedDenials }}
        - name: AGENTPLANE_AGENT_EXPECTED_DENIALS
          value: {{ include "agentplane.profileHosts" . | quote }}
        {{- end }}
        - name: AGENTPLANE_SANDBOX_EGRESS_MAX_CONNS
          value: {{ int $c.egress.maxConns | quote }}
        - name: AGENTPLANE_SANDBOX_EGRESS_MAX_BYTES
          value: {{ $c.egress.maxBytes | quote }}
        - name: AGENTPLANE_SANDBOX_EGRESS_BYTES_WINDOW
          value: {{ $c.egress.bytesWindow | quote }}
        - name: AGENTPLANE_SANDBOX_EGRESS_IDLE
          value: {{ $c.egress.idle | quote }}
        - name: AGENTPLANE_SANDBOX_CGROUPS
          value: {{ $c.limits.cgroups | quote }}
        - name: AGENTPLANE_SANDBOX_MEMORY_LIMIT
          value: {{ $c.limits.memory | quote }}
        - name: AGENTPLANE_SANDBOX_CPU_LIMIT
          value: {{ int $c.limits.cpuMillis | quote }}
        - name: AGENTPLANE_SANDBOX_NICE
          value: {{ int $c.limits.nice | quote }}
        - name: AGENTPLANE_SANDBOX_PIDS_LIMIT
          value: {{ int $c.limits.pids | quote }}
        - name: AGENTPLANE_SANDBOX_DISK_QUOTA
          value: {{ $c.limits.diskQuota | quote }}
        - name: AGENTPLANE_SANDBOX_RLIMITS
          value: {{ $c.limits.rlimits | quote }}
        - name: AGENTPLANE_SANDBOX_SOCKET_CONNS
          value: {{ int $c.limits.socketConns | quote }}
        - name: AGENTPLANE_SANDBOX_SOCKET_IDLE
          value: {{ $c.limits.socketIdle | quote }}
        {{- end }}
        {{- if eq $component "session" }}
        - name: AGENTPLANE_SESSION_SUSPEND_AFTER
          value: {{ $c.suspendAfter | quote }}
        - name: AGENTPLANE_SESSION_SUSPEND_AFTER_PROFILES
          value: {{ include "agentplane.profileDurations" $c.suspendAfterProfiles | quote }}
        {{- with $c.priceTable }}
        - name: AGENTPLANE_SESSION_PRICE_TABLE
          value: {{ toJson . | quote }}
        {{- end }}
        {{- end }}
        {{- if eq $component "credential" }}
        - name: AGENTPLANE_PROXY_ADDR
          value: {{ printf ":%d" (int $c.ports.proxy) | quote }}
        {{- end }}
        {{- with $c.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      # Native gRPC probes against grpc.health.v1: the startup and liveness probes ask for the
      # "liveness" service (the process is up), readiness asks for "" (SERVING only while Redis
      # answers, NOT_SERVING while draining), so a Redis outage takes pods out of the Service
      # without restarting them.
      startupProbe:
        grpc:
          port: {{ $c.ports.grpc }}
          service: liveness
        periodSeconds: 2
        timeoutSeconds: 2
        failureThreshold: 60
      livenessProbe:
        grpc:
          port: {{ $c.ports.grpc }}
          service: liveness
        periodSeconds: 10
        timeoutSeconds: 3
        failureThreshold: 3
      readinessProbe:
        grpc:
          port: {{ $c.ports.grpc }}
          service: ""
        periodSeconds: 5
        timeoutSeconds: 3
        failureThreshold: 2
      resources:
        {{- toYaml $c.resources | nindent 8 }}
      securityContext:
        {{- include "agentplane.containerSecurityContext" . | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: secrets
          mountPath: {{ include "agentplane.secretsDir" $root }}
          readOnly: true
        {{- if eq $component "sandbox" }}
        - name: sandbox-root
          mountPath: {{ $c.root }}
        {{- end }}
  volumes:
    # readOnlyRootFilesystem is on; /tmp is the only scratch space besides the sandbox root.
    - name: tmp
      emptyDir:
        sizeLimit: 1Gi
    # Only the keys this service reads; group-readable for the pod's fsGroup, nothing else.
    - name: secrets
      secret:
        secretName: {{ $secret }}
        defaultMode: 288 # 0440
        items:
          {{- range $secretFiles }}
          - key: {{ .key }}
            path: {{ .path }}
          {{- end }}
    {{- if and (eq $component "sandbox") (not $c.persistence.enabled) }}
    - name: sandbox-root
      emptyDir:
        sizeLimit: {{ $c.emptyDirSizeLimit }}
    {{- end }}
{{- end -}}
