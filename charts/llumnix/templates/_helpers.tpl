{{- define "llumnix.fullname" -}}
{{- printf "%s-llumnix-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llumnix.serviceAccountName" -}}
{{- default (include "llumnix.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "llumnix.labels" -}}
app.kubernetes.io/name: llumnix-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: llumnix
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "llumnix.selectorLabels" -}}
app.kubernetes.io/name: llumnix-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llumnix.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "llumnix.vllmImage" -}}
{{- /* The default tag names the vLLM release the connector supports (llumnix/vllm_support.py). */ -}}
{{- printf "%s:%s" .Values.vllmImage.repository (default (printf "%s-vllm0.32.0" .Chart.AppVersion) .Values.vllmImage.tag) -}}
{{- end -}}

{{- define "llumnix.roleKind" -}}
{{- if .Values.operator.allNamespaces -}}ClusterRole{{- else -}}Role{{- end -}}
{{- end -}}

{{- /* "true" when the Prometheus Operator's objects are rendered: monitoring.enabled true, or "auto"
and the cluster serves monitoring.coreos.com/v1. */ -}}
{{- define "llumnix.monitoring" -}}
{{- $enabled := .Values.monitoring.enabled -}}
{{- if eq (toString $enabled) "auto" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- else if $enabled -}}true{{- end -}}
{{- end -}}

{{- define "llumnix.monitorNamespaces" -}}
{{- if .Values.operator.allNamespaces }}
namespaceSelector:
  any: true
{{- else }}
namespaceSelector:
  matchNames: [{{ .Release.Namespace | quote }}]
{{- end }}
{{- end -}}
