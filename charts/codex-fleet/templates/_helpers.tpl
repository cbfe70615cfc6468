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
{{- $stop := .Values.workers.stop_grace_secs | default 10 | int64 }}
{{- $turns := .Values.drain.timeout_secs | default 300 | int64 }}
{{- $settle := .Values.drain.settle_secs | default 5 | int64 }}
{{- $drain := add (max $turns $settle) $stop 16 }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $drain 10 }}
{{- else if le (.Values.terminationGracePeriodSeconds | int64) $drain }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be longer than the drain: max(drain.timeout_secs, drain.settle_secs) + workers.stop_grace_secs + 16 = %d" .Values.terminationGracePeriodSeconds $drain) }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds | int64 }}
{{- end }}
{{- end }}
