{{/* Names and labels. */}}
{{- define "codex-fleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "codex-fleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "codex-fleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "codex-fleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "codex-fleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "codex-fleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "codex-fleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "codex-fleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The port of an "addr" value such as "0.0.0.0:8443" or "[::]:8443". */}}
{{- define "codex-fleet.port" -}}
{{- splitList ":" . | last | int }}
{{- end }}

{{/*
TOML lines for config.toml. Each takes (dict "k" KEY "v" VALUE) and writes nothing when VALUE is
null, so codex-fleet's own default applies. Strings and arrays go through toJson: a JSON string or
array of strings is also a valid TOML basic string or array. Integers go through int64 so large
values are not printed in float notation.
*/}}
{{- define "codex-fleet.toml.str" -}}
{{- if not (kindIs "invalid" .v) }}
{{ .k }} = {{ .v | toString | toJson }}
{{- end }}
{{- end }}

{{- define "codex-fleet.toml.int" -}}
{{- if not (kindIs "invalid" .v) }}
{{ .k }} = {{ .v | int64 }}
{{- end }}
{{- end }}

{{- define "codex-fleet.toml.list" -}}
{{- if not (kindIs "invalid" .v) }}
{{ .k }} = [{{ range $i, $e := .v }}{{ if $i }}, {{ end }}{{ $e | toString | toJson }}{{ end }}]
{{- end }}
{{- end }}

{{- define "codex-fleet.toml.bool" -}}
{{- if not (kindIs "invalid" .v) }}
{{ .k }} = {{ .v }}
{{- end }}
{{- end }}

{{- define "codex-fleet.toml.intlist" -}}
{{- if not (kindIs "invalid" .v) }}
{{ .k }} = [{{ range $i, $e := .v }}{{ if $i }}, {{ end }}{{ $e | int64 }}{{ end }}]
{{- end }}
{{- end }}

{{/* Kubernetes' grace period: longer than codex-fleet's whole drain (turns, interrupt, sessions, workers). */}}
{{- define "codex-fleet.terminationGrace" -}}
{{- include "codex-fleet.graceOf" (dict "root" . "v" .Values.terminationGracePeriodSeconds "key" "terminationGracePeriodSeconds") }}
{{- end }}

{{/* A tenant node pod's: the node drains as serve does (same [drain] and workers), so the same rule. */}}
{{- define "codex-fleet.tenantTerminationGrace" -}}
{{- include "codex-fleet.graceOf" (dict "root" . "v" .Values.tenantPod.terminationGracePeriodSeconds "key" "tenantPod.terminationGracePeriodSeconds") }}
{{- end }}

{{/* (dict "root" . "v" VALUE "key" NAME): VALUE, or the drain + 10 s when null; refused when not longer than the drain. */}}
{{- define "codex-fleet.graceOf" -}}
{{- $v := .root.Values }}
{{- $stop := $v.workers.stop_grace_secs | default 10 | int64 }}
{{- $turns := $v.drain.timeout_secs | default 300 | int64 }}
{{- $settle := $v.drain.settle_secs | default 5 | int64 }}
{{- $drain := add (max $turns $settle) $stop 16 }}
{{- if kindIs "invalid" .v }}
{{- add $drain 10 }}
{{- else if le (.v | int64) $drain }}
{{- fail (printf "%s (%v) must be longer than the drain: max(drain.timeout_secs, drain.settle_secs) + workers.stop_grace_secs + 16 = %d" .key .v $drain) }}
{{- else }}
{{- .v | int64 }}
{{- end }}
{{- end }}

{{/* mode: kubernetes. */}}

{{/* The pods a Service, budget or policy means: the one pod (single), the edges (kubernetes). */}}
{{- define "codex-fleet.podSelectorLabels" -}}
{{ include "codex-fleet.selectorLabels" . }}
{{- if eq .Values.mode "kubernetes" }}
app.kubernetes.io/component: edge
{{- end }}
{{- end }}

{{/* Tenant node pods (the edge adds codex-fleet.io/tenant to each). */}}
{{- define "codex-fleet.tenantSelectorLabels" -}}
{{ include "codex-fleet.selectorLabels" . }}
app.kubernetes.io/component: tenant-node
{{- end }}

{{/* nodes.kubernetes.name_prefix: pod <prefix>-node-<tenant>, PVC <prefix>-home-<tenant>. */}}
{{- define "codex-fleet.namePrefix" -}}
{{- .Values.nodes.kubernetes.name_prefix | default (include "codex-fleet.fullname" .) }}
{{- end }}

{{- define "codex-fleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "codex-fleet.tenantImage" -}}
{{- $repo := .Values.tenantPod.image.repository | default .Values.image.repository }}
{{- $tag := .Values.tenantPod.image.tag | default .Values.image.tag | default .Chart.AppVersion }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* The link's Secrets: cert-manager's, or the ones provided. Each holds tls.crt, tls.key, ca.crt. */}}
{{- define "codex-fleet.linkEdgeSecret" -}}
{{- if .Values.link.certManager.enabled }}
{{- printf "%s-link-edge" (include "codex-fleet.fullname" .) }}
{{- else if .Values.link.edgeSecret }}
{{- .Values.link.edgeSecret }}
{{- else }}
{{- fail "link.edgeSecret is required when link.certManager.enabled is false (a Secret with tls.crt, tls.key, ca.crt: the edges' link client certificate)" }}
{{- end }}
{{- end }}

{{- define "codex-fleet.linkNodeSecret" -}}
{{- if .Values.link.certManager.enabled }}
{{- printf "%s-link-node" (include "codex-fleet.fullname" .) }}
{{- else if .Values.link.nodeSecret }}
{{- .Values.link.nodeSecret }}
{{- else }}
{{- fail "link.nodeSecret is required when link.certManager.enabled is false (a Secret with tls.crt, tls.key, ca.crt: the tenant nodes' link server certificate)" }}
{{- end }}
{{- end }}

{{/* The tenant nodes' config.toml (ConfigMap <fullname>-node-config): one tenant per pod, given by
`codex-fleet node --tenant <id>`; no [[tenants]] (the edge puts the tenant's own entry in its pod's
env, CODEX_FLEET_TENANT_ENTRY, without credentials). */}}
{{- define "codex-fleet.nodeConfig" -}}
# Rendered by the codex-fleet chart: the config of every tenant node pod. The edge starts each
# pod with `node --config <this> --tenant <id> --exit-when-idle`.
[node]
name = "tenant-node"
edge_ca = "/etc/codex-fleet/link/ca.crt"

[listen]
addr = {{ printf "0.0.0.0:%d" (.Values.nodes.kubernetes.link_port | int) | toJson }}
tls_cert = "/etc/codex-fleet/link/tls.crt"
tls_key = "/etc/codex-fleet/link/tls.key"
{{- include "codex-fleet.toml.int" (dict "k" "handshake_timeout_secs" "v" .Values.listen.handshake_timeout_secs) }}

[admin]
addr = "0.0.0.0:9464"

{{ include "codex-fleet.config.workers" . }}

{{ include "codex-fleet.config.limits" . }}

[drain]
{{- include "codex-fleet.toml.int" (dict "k" "settle_secs" "v" .Values.drain.settle_secs) }}
{{- include "codex-fleet.toml.int" (dict "k" "timeout_secs" "v" .Values.drain.timeout_secs) }}

{{- /* The session audit is the node's (it owns sessions, approvals, threads): always on,
tenantPod.audit.path ("-": stdout, the pod's log) with audit.queue, audit.max_file_bytes and audit.keep_files. */}}

[audit]
{{- include "codex-fleet.toml.str" (dict "k" "path" "v" (.Values.tenantPod.audit.path | default "-")) }}
{{- with .Values.audit }}
{{- include "codex-fleet.toml.int" (dict "k" "queue" "v" .queue) }}
{{- include "codex-fleet.toml.int" (dict "k" "max_file_bytes" "v" .max_file_bytes) }}
{{- include "codex-fleet.toml.int" (dict "k" "keep_files" "v" .keep_files) }}
{{- end }}
{{- end }}

{{/* The edge's read-only mounts: wss TLS, the link's client certificate, the tenant pod template. */}}
{{- define "codex-fleet.edgeMounts" -}}
- name: tls
  mountPath: /etc/codex-fleet/tls
  readOnly: true
- name: link
  mountPath: /etc/codex-fleet/link
  readOnly: true
- name: tenant-pod
  mountPath: /etc/codex-fleet/tenant-pod
  readOnly: true
{{- end }}
