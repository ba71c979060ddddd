{{/* Names, labels and the pieces several templates share. */}}

{{- define "shardwise.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name, a DNS label; names of the objects below add suffixes to
it, so it is cut at 40 characters to leave room for them. */}}
{{- define "shardwise.fullname" -}}
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

{{- define "shardwise.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardwise.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardwise.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "shardwise.labels" -}}
helm.sh/chart: {{ include "shardwise.chart" . }}
{{ include "shardwise.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shardwise
{{- end -}}

{{- define "shardwise.image" -}}
{{- $repo := .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "shardwise.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shardwise.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator serves, as a JSON list; [] means all of them. */}}
{{- define "shardwise.watchNamespaces" -}}
{{- if .Values.operator.watch.allNamespaces -}}
[]
{{- else if .Values.operator.watch.namespaces -}}
{{- .Values.operator.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* Where the profiler's service account goes, as a JSON list. */}}
{{- define "shardwise.profilerNamespaces" -}}
{{- if .Values.profiler.namespaces -}}
{{- .Values.profiler.namespaces | uniq | toJson -}}
{{- else if .Values.operator.watch.allNamespaces -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
{{- include "shardwise.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{/* Where the workers' service account goes, as a JSON list (the profiler's logic). */}}
{{- define "shardwise.workerNamespaces" -}}
{{- if .Values.workers.namespaces -}}
{{- .Values.workers.namespaces | uniq | toJson -}}
{{- else if .Values.operator.watch.allNamespaces -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
{{- include "shardwise.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{/*
The operator's rules on cluster-scoped resources (a ClusterRole in every mode).
docs/operations.md ("RBAC") gives the reason for each rule.
*/}}
{{- define "shardwise.clusterRules" -}}
# GPU types (nvidia.com/gpu.product), GPU memory and allocatable GPUs of the nodes a
# job may use; a change of capacity triggers resharding.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
{{- if .Values.kueue.enabled }}
# Kueue's ClusterQueues: the GPU quota a queued job is sized by (read only).
- apiGroups: [kueue.x-k8s.io]
  resources: [clusterqueues]
  verbs: [get, list, watch]
{{- end }}
{{- if .Values.operator.watch.allNamespaces }}
# kopf's resource observer: notices the DLRMJob CRD being re-applied (an upgrade)
# without an operator restart. Read-only. A namespaced operator serves exact namespace
# names with kopf's scanning off (no namespace or CRD observers): it needs neither.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
{{- if and .Values.peering.enabled .Values.operator.watch.allNamespaces }}
# kopf peering (cluster-wide operator): watch the peers, patch its own keep-alive.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}

{{/*
The operator's rules in the namespaces it serves (a ClusterRole bound cluster-wide
with allNamespaces, else a Role in each namespace).
*/}}
{{- define "shardwise.namespacedRules" -}}
# The custom resource: kopf watches it and patches it (finalizer, its own progress
# annotations); the reconciler reads it back.
- apiGroups: [shardwise.dev]
  resources: [dlrmjobs]
  verbs: [get, list, watch, patch]
# Phase, conditions, plan and cost-model summaries.
- apiGroups: [shardwise.dev]
  resources: [dlrmjobs/status]
  verbs: [patch]
# Profiling Jobs and the worker Job: watched for completion and failure, suspended
# and resumed (patch), replaced on a new plan or world size (delete).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# Pods of those Jobs, read for the first failure's cause (OOMKilled, image pull,
# unschedulable) in conditions and Events; deleted (forced) only when one is stuck
# terminating (30 s) on a node that is gone or not Ready.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, delete]
# Plan ConfigMaps (written), cost-model ConfigMaps (published by profiling pods, read
# and pruned), tables ConfigMaps (spec.tables.configMapRef, read).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
# The workers' headless Service (torchrun rendezvous, stable pod DNS names), kept in a
# kopf index like the Jobs.
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# An Event on every phase transition, and kopf's handler Events (create); a repeat
# raises the count of the Event already posted (get, patch); the Job controller's
# FailedCreate Events on a Job whose pods cannot be created (list, with a field
# selector on the Job).
- apiGroups: [""]
  resources: [events]
  verbs: [create, get, list, patch]
{{- if .Values.kueue.enabled }}
# Kueue's Workloads of the queued Jobs, read to say why a job waits (the Jobs' suspend
# is Kueue's to set; the operator only reads), and the LocalQueues that lead to the
# ClusterQueue whose quota sizes the job.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads, localqueues]
  verbs: [get, list, watch]
{{- end }}
{{- if and .Values.peering.enabled (not .Values.operator.watch.allNamespaces) }}
# kopf peering (namespaced operator): watch the peers, patch its own keep-alive.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}
