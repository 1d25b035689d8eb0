{{/*
Names, labels and the operator's RBAC rules, shared by the templates.
The rules are written once here and used by the ClusterRole (watch mode "all")
or by one Role per namespace (watch mode "namespaces"), so both modes grant
the same verbs.  docs/operator.md lists why the operator needs each verb.
*/}}

{{- define "meshtrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshtrain.fullname" -}}
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

{{/*
The name of one of the release's objects: the full name and a component suffix, e.g.
`include "meshtrain.componentName" (list . "metrics")` is "mt-meshtrain-metrics".  The full
name is shortened first, so the suffix always survives and the whole stays a DNS label
(at most 63 characters) whatever the release is called.
*/}}
{{- define "meshtrain.componentName" -}}
{{- $suffix := index . 1 }}
{{- $prefix := include "meshtrain.fullname" (index . 0) | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $suffix }}
{{- end }}

{{- define "meshtrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshtrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshtrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "meshtrain.labels" -}}
helm.sh/chart: {{ include "meshtrain.chart" . }}
{{ include "meshtrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: meshtrain
{{- end }}

{{- define "meshtrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "meshtrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "meshtrain.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Labels that let Prometheus pick up the monitoring objects. */}}
{{- define "meshtrain.monitoringLabels" -}}
{{ include "meshtrain.labels" . }}
{{- with .Values.monitoring.selectorLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Rules on namespaced resources, in every watched namespace (the operator's
cluster/kube.py and handlers.py are the callers):
- trainingjobs: kopf lists and watches them and patches its finalizer and
  progress annotations (and the reconciler the kueue.x-k8s.io/queue-name label
  under kueue.requireQueue "default"); the reconciler reads one (get) and deletes finished
  jobs after ttlSecondsAfterFinished.  status: phase, placement, conditions.
- pods: kopf watches the gang pods; the reconciler creates them gated,
  patches the gate away, deletes them on gang restart, suspend and finish.
- services, configmaps: the headless Service (rank 0's DNS name) and the spec
  ConfigMap of each job, created, read back when the name exists (patched only
  when the job owns it: a namesake is a NameConflict), deleted.
- podgroups (scheduling.k8s.io): the native gang of each attempt, created where
  the API server serves it (GenericWorkload), read back when the name exists.
- events: the reconciler's Events about each job (kopf's own posting is off).
- persistentvolumeclaims: read (get) to place a job whose checkpoint claim is
  bound to a node-affine volume only on the nodes that volume allows.
Each gang's own NetworkPolicy is granted apart (rbac.yaml), in the namespaces
whose gangs get one only, in either watch mode.
*/}}
{{- define "meshtrain.namespacedRules" -}}
- apiGroups: ["meshtrain.io"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["meshtrain.io"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
# Children name their job with blockOwnerDeletion: where OwnerReferencesPermissionEnforcement
# runs (OpenShift), that needs update on the owner's finalizers.
- apiGroups: ["meshtrain.io"]
  resources: ["trainingjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create"]
{{- if eq .Values.gang.backend "coscheduling" }}
# gang.backend coscheduling: each gang's scheduler-plugins PodGroup.
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create"]
{{- end }}
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# Kueue: the Workload of each queued job (moved to the job's new queue while it waits;
# deleted when outdated, suspended or the job deleted), and giving an evicted workload's
# quota back.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
# The LocalQueue a queued job names: its ClusterQueue says whether the queue is TAS.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
# DRA (resources.dra): each job's ResourceClaimTemplate <job>-gpus-<hash10> its pods claim their
# GPUs from (created before them, kept across gang restarts, a new name when its spec changes,
# deleted with the job), and with resources.dra.computeDomain its ComputeDomain (NVIDIA's DRA driver).
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaimtemplates"]
  verbs: ["get", "create", "delete"]
- apiGroups: ["resource.nvidia.com"]
  resources: ["computedomains"]
  verbs: ["get", "create", "delete"]
{{- end }}

{{/*
Rules on cluster-scoped reads (always a ClusterRole, whatever the watch mode):
- nodes: the operator's cache lists and watches them (topology labels, GPUs,
  taints, conditions); a gang's planned nodes are read (get) again just before
  its gates are lifted.
- persistentvolumes, storageclasses: the node affinity of the volume a job's
  claim is bound to (get), or for a WaitForFirstConsumer claim the local
  volumes it could bind to (list) and its class's allowedTopologies (get).
- pods, cluster-wide list and watch: the cache of what is taken on each node,
  by any pod in any namespace, so that two jobs never plan onto the same free
  GPUs.
- customresourcedefinitions, namespaces: kopf's resource and namespace
  discovery.
- resourceslices, deviceclasses, resourceclaims (resource.k8s.io): the DRA
  devices of every node, the classes jobs ask for, and the devices allocated
  to claims in any namespace (free devices, as pods are for extended GPUs).
*/}}
{{- define "meshtrain.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["persistentvolumes"]
  verbs: ["get", "list"]
- apiGroups: ["storage.k8s.io"]
  resources: ["storageclasses"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# Kueue: a queued job's WorkloadPriorityClass gives its workload's priority, and the
# ResourceFlavor Kueue assigned it the nodes (labels) and taints (tolerations) it may use;
# a TAS queue (a ClusterQueue whose flavor names a Topology): the levels its Workload asks for.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloadpriorityclasses", "resourceflavors", "clusterqueues", "topologies"]
  verbs: ["get"]
# Else the pods' PriorityClass, or the cluster's globalDefault one, does (as in Kueue).
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get", "list"]
# DRA: the devices each node publishes (ResourceSlices), the classes jobs name (DeviceClasses)
# and the devices claims in every namespace hold (ResourceClaims), as pods are read for GPUs.
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceslices", "deviceclasses", "resourceclaims"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{/* The trainer image the operator gives jobs whose spec.image is empty. */}}
{{- define "meshtrain.trainerImage" -}}
{{- $image := .Values.trainer.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
Namespaces whose trainer pods get the chart's trainer NetworkPolicy, and whose gangs the
operator gives a NetworkPolicy each (a JSON list): the watched namespaces (watch.mode
"namespaces") and networkPolicy.trainerNamespaces.
*/}}
{{- define "meshtrain.trainerPolicyNamespaces" -}}
{{- $namespaces := .Values.networkPolicy.trainerNamespaces }}
{{- if eq .Values.watch.mode "namespaces" }}
{{- $namespaces = concat .Values.watch.namespaces $namespaces | uniq }}
{{- end }}
{{- $namespaces | toJson }}
{{- end }}

{{/*
NetworkPolicyPeers of the operator's pods (a JSON list): its namespace and pod labels.
*/}}
{{- define "meshtrain.operatorPeers" -}}
{{- $pods := include "meshtrain.selectorLabels" . | fromYaml }}
{{- list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" $pods)) | toJson }}
{{- end }}

{{/*
NetworkPolicyPeers allowed to scrape (a JSON list): the Prometheus the values name and
networkPolicy.extraIngressFrom.
*/}}
{{- define "meshtrain.metricsPeers" -}}
{{- $prometheus := .Values.networkPolicy.prometheus }}
{{- $peer := dict "namespaceSelector" (dict "matchLabels" $prometheus.namespaceSelector) "podSelector" (dict "matchLabels" $prometheus.podSelector) }}
{{- concat (list $peer) (.Values.networkPolicy.extraIngressFrom | default list) | toJson }}
{{- end }}

{{/*
The trainer exporters' ports by name (a JSON list of NetworkPolicyPorts): metrics-<local
rank> for every local rank a node may run (meshtrain/api/limits.py MAX_GPUS_PER_NODE).
Named, because each job picks its own metrics.port; the rendezvous port is not among them.
*/}}
{{- define "meshtrain.trainerMetricsPorts" -}}
{{- $ports := list }}
{{- range $rank := until 64 }}
{{- $ports = append $ports (dict "protocol" "TCP" "port" (printf "metrics-%d" $rank)) }}
{{- end }}
{{- $ports | toJson }}
{{- end }}
