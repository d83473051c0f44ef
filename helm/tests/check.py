#!/usr/bin/env python3
"""Checks a rendered Ferry chart's wiring, beyond what the Kubernetes schemas check:

- every Ferry container's command line is accepted by the binary's own parser
  (`--check-config`: each flag checked as the service would, nothing started);
- every host:port a container dials (flags and environment) names a Service of the manifest, or
  a StatefulSet pod behind a headless Service, and a port that Service (or pod) has;
- Services select pods, and their target ports are ports of those pods; StatefulSets' governing
  Services exist and are headless;
- every referenced Secret and ConfigMap exists (or is declared external);
- probes point at the container's probe port (`--probe-listen`, plaintext health and /metrics);
- mutual TLS between services is on in every Ferry container or in none; each reads its
  certificate from a mounted Secret, and a Secret that a cert-manager Certificate of the
  manifest issues names the role of the binary that presents it;
- etcd endpoints point at the bundled etcd's members through its Service (or at the declared
  external endpoints), the same in every container;
- each executor's `--kv-agent` is its own pod's agent's advertised address, sharing the
  agent's shared-memory folder; advertised addresses name the pod itself and its listen port;
- a CUDA executor's weights (16 or 32 bits) and KV cache fit in its share of the GPU memory its node
  affinity requires;
- an HTTPRoute's InferencePool backend selects pods and targets ports they listen on;
- a data-parallel group's executors are its ranks 0 to size - 1, under one scheduler pool;
- HPA, PodDisruptionBudget, Ingress, NetworkPolicy and ServiceMonitor targets exist.

Usage: check.py MANIFEST --bin DIR [--image-repo REPO] [--external-secret NAME]...
       [--external-etcd URL]...
Prints each failure and exits 1 if any, else prints what it checked.
"""

import argparse
import os
import re
import subprocess
import sys

from manifests import Manifest, load

ADDRESS = re.compile(r"^(?:(https?)://)?([A-Za-z0-9.-]+):(\d+)/?$")


class Checker:
    def __init__(self, manifest, args):
        self.m = manifest
        self.args = args
        self.failures = []
        self.counts = {}
        self.names = manifest.names()

    def fail(self, what):
        self.failures.append(what)

    def count(self, what):
        self.counts[what] = self.counts.get(what, 0) + 1

    def first_pods(self):
        """One pod per workload: the pods of a workload differ only in their name."""
        return [p for p in self.m.pods if p.ordinal == 0]

    def is_ferry(self, c):
        return c.image.split(":")[0] == self.args.image_repo

    def is_service(self, p, c):
        """A Ferry service (not the etcd members' start-up helper, which serves nothing)."""
        return self.is_ferry(c) and p.argv(c)[1:2] != ["etcd-member"]

    def check_inference_pool(self, route, name):
        """An HTTPRoute's InferencePool backend exists, selects pods, and its target ports
        are ports those pods' containers listen on."""
        where = f"HTTPRoute {route['metadata']['name']}: InferencePool {name}"
        pool = next((o for o in self.m.by_kind.get("InferencePool", [])
                     if o["metadata"]["name"] == name), None)
        if pool is None:
            self.fail(f"{where} does not exist")
            return
        pods = self.m.selected(pool["spec"]["selector"]["matchLabels"])
        ports = {n for p in pods for c in p.containers for n in c.ports().values()}
        wanted = [t["number"] for t in pool["spec"]["targetPorts"]]
        if not pods or not set(wanted) <= ports:
            self.fail(f"{where} targets ports {wanted} of {len(pods)} pods listening on "
                      f"{sorted(ports)}")
        else:
            self.count("InferencePool backends on their pods' ports")

    def check_gpu_fit(self, p, c, argv):
        """A CUDA executor's weights (2 bytes a parameter on the device, 4 with `--dtype
        float32`) and KV cache fit
        in its share of the GPU its pod is bound to: the GPU's memory from the pod's required
        node affinity on GPU feature discovery's `nvidia.com/gpu.memory` label, the parameter
        count from its workload's `ferry.dev/model-parameters`, the KV cache from
        `--kv-cache-mib` (of the whole GPU) or what `--gpu-memory-utilization` leaves."""
        where = f"{p.workload}/{c.name}"
        terms = (p.spec.get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {})
                 .get("nodeSelectorTerms", []))
        floors = [int(e["values"][0]) + 1 for t in terms for e in t.get("matchExpressions", [])
                  if e.get("key") == "nvidia.com/gpu.memory" and e.get("operator") == "Gt"]
        if not terms or len(floors) < len(terms):
            self.fail(f"{where}: a CUDA executor whose GPU's memory no node affinity states "
                      "(nvidia.com/gpu.memory): its sizing cannot be checked")
            return
        gpu_mib = min(floors)  # the smallest GPU any of its terms admits
        params = p.workload_annotations.get("ferry.dev/model-parameters")
        if params is None:
            self.fail(f"{where}: no ferry.dev/model-parameters: its weights cannot be sized")
            return
        dtype = self.flag(argv, "dtype") or "auto"
        weights_mib = int(params) * (4 if dtype in ("float32", "float") else 2) / 2**20
        fraction = self.flag(argv, "gpu-memory-utilization")
        if fraction is not None:
            room, kv_mib = float(fraction) * gpu_mib, 0
        else:
            room, kv_mib = gpu_mib, int(self.flag(argv, "kv-cache-mib") or 512)
        if weights_mib + kv_mib >= room:
            self.fail(f"{where}: {weights_mib:.0f} MiB of {dtype} weights + {kv_mib} MiB of KV "
                      f"cache do not fit in {room:.0f} MiB of its {gpu_mib} MiB GPU")
        else:
            self.count("CUDA executors whose weights and KV fit their GPU")

    # -- flags ------------------------------------------------------------------------------
    def check_config(self):
        for p in self.first_pods():
            for c in p.containers:
                if not self.is_ferry(c):
                    continue
                # Files the binary reads to check its flags (an API keys file) come from the
                # Secrets given with --secret, mapped to where the container mounts them.
                vols = {v["name"]: v for v in p.spec.get("volumes", [])}
                mounts = {vm["mountPath"].rstrip("/"): self.args.secrets[name]
                          for vm in c.spec.get("volumeMounts", [])
                          if (name := vols.get(vm["name"], {}).get("secret", {})
                              .get("secretName")) in self.args.secrets}

                def local(v):
                    for path, folder in mounts.items():
                        v = v.replace(path + "/", folder + "/")
                    return v

                argv = [local(a) for a in p.argv(c)]
                binary = os.path.join(self.args.bin, argv[0])
                env = {k: local(v) for k, v in p.env(c).items() if v is not None}
                env["PATH"] = os.environ.get("PATH", "")
                env["RUST_BACKTRACE"] = "0"
                cut = argv.index("--") if "--" in argv else len(argv)
                r = subprocess.run(
                    # Before a `--`: what follows it is another program's (etcd's) flags.
                    [binary, *argv[1:cut], "--check-config", *argv[cut:]], env=env,
                    capture_output=True, text=True
                )
                if r.returncode != 0 or "configuration ok" not in r.stdout:
                    self.fail(f"{p.workload}/{c.name}: `{' '.join(argv)}` refused: "
                              f"{(r.stderr or r.stdout).strip()}")
                self.count("command lines accepted by --check-config")

    # -- addresses --------------------------------------------------------------------------
    def dialled(self, p, c):
        """(where, host, port) for every value that is an address to dial."""
        out = []
        for a in p.argv(c)[1:]:
            if a.startswith("--") and "=" in a:
                flag, value = a[2:].split("=", 1)
                if flag in ("listen", "http-listen", "probe-listen"):
                    continue
                for v in value.split(","):
                    out.append((f"--{flag}", v))
        for k, v in p.env(c).items():
            if v is not None:
                for part in v.split(","):
                    out.append((k, part))
        result = []
        for where, v in out:
            m = ADDRESS.match(v.strip())
            if m and not re.match(r"^\d+\.\d+\.\d+\.\d+$", m.group(2)):
                result.append((where, m.group(2), int(m.group(3))))
        return result

    def check_addresses(self):
        external = {ADDRESS.match(e).group(2) for e in self.args.external_etcd}
        for p in self.m.pods:
            for c in p.containers:
                for where, host, port in self.dialled(p, c):
                    if host in external:
                        self.count("external addresses")
                        continue
                    target = self.names.get(host)
                    if target is None:
                        self.fail(f"{p.workload}/{c.name} {where}: {host} names no Service or pod")
                        continue
                    kind, obj = target
                    if kind == "service":
                        ports = [sp["port"] for sp in obj["spec"]["ports"]]
                    else:
                        ports = list(obj.all_ports().values())
                    if port not in ports:
                        self.fail(f"{p.workload}/{c.name} {where}: {host} has no port {port} "
                                  f"(it has {ports})")
                    self.count("dialled addresses resolved")

    # -- Services and workloads -------------------------------------------------------------
    def check_services(self):
        for name, svc in self.m.services.items():
            pods = self.m.selected(svc["spec"].get("selector"))
            if not pods:
                self.fail(f"Service {name} selects no pod")
                continue
            for sp in svc["spec"]["ports"]:
                target = sp.get("targetPort", sp["port"])
                for pod in pods:
                    ports = pod.all_ports()
                    if target not in ports and target not in ports.values():
                        self.fail(f"Service {name} port {sp.get('name')}: pod {pod.name} has no "
                                  f"port {target}")
                self.count("Service ports with a target")
        for sts in self.m.by_kind.get("StatefulSet", []):
            sname = sts["spec"].get("serviceName")
            svc = self.m.services.get(sname)
            if svc is None or svc["spec"].get("clusterIP") != "None":
                self.fail(f"StatefulSet {sts['metadata']['name']}: governing Service {sname} "
                          "missing or not headless")
            self.count("StatefulSets with a headless Service")

    def check_references(self):
        secrets = {o["metadata"]["name"] for o in self.m.by_kind.get("Secret", [])}
        secrets |= {c["spec"]["secretName"] for c in self.m.by_kind.get("Certificate", [])}
        secrets |= set(self.args.external_secret)
        configmaps = {o["metadata"]["name"] for o in self.m.by_kind.get("ConfigMap", [])}

        def need(kind, name, where):
            have = secrets if kind == "Secret" else configmaps
            if name not in have:
                self.fail(f"{where}: {kind} {name} does not exist")
            self.count(f"{kind} references")

        for p in self.first_pods():
            vols = {v["name"]: v for v in p.spec.get("volumes", [])}
            for v in vols.values():
                if "secret" in v:
                    need("Secret", v["secret"]["secretName"], p.workload)
                if "configMap" in v:
                    need("ConfigMap", v["configMap"]["name"], p.workload)
            for s in p.spec.get("imagePullSecrets", []):
                need("Secret", s["name"], p.workload)
            for c in p.containers:
                for vm in c.spec.get("volumeMounts", []):
                    if vm["name"] not in vols and vm["name"] not in p.claims:
                        self.fail(f"{p.workload}/{c.name}: mounts volume {vm['name']}, "
                                  "which the pod does not have")
                    self.count("volume mounts")
                for e in c.spec.get("env", []):
                    ref = e.get("valueFrom", {})
                    if "secretKeyRef" in ref:
                        need("Secret", ref["secretKeyRef"]["name"], f"{p.workload}/{c.name}")
                    if "configMapKeyRef" in ref:
                        need("ConfigMap", ref["configMapKeyRef"]["name"], f"{p.workload}/{c.name}")
                for e in c.spec.get("envFrom", []):
                    if "secretRef" in e:
                        need("Secret", e["secretRef"]["name"], f"{p.workload}/{c.name}")
                    if "configMapRef" in e:
                        need("ConfigMap", e["configMapRef"]["name"], f"{p.workload}/{c.name}")
        for ing in self.m.by_kind.get("Ingress", []):
            for t in ing["spec"].get("tls", []):
                need("Secret", t["secretName"], f"Ingress {ing['metadata']['name']}")
            for rule in ing["spec"].get("rules", []):
                for path in rule["http"]["paths"]:
                    b = path["backend"]["service"]
                    svc = self.m.services.get(b["name"])
                    port = b["port"].get("name", b["port"].get("number"))
                    if svc is None or port not in [x.get("name") for x in svc["spec"]["ports"]] + \
                            [x["port"] for x in svc["spec"]["ports"]]:
                        self.fail(f"Ingress {ing['metadata']['name']}: backend {b} missing")
                    self.count("Ingress backends")

        for route in self.m.by_kind.get("HTTPRoute", []):
            for rule in route["spec"].get("rules", []):
                for b in rule.get("backendRefs", []):
                    if b.get("kind") == "InferencePool":
                        self.check_inference_pool(route, b["name"])
                        continue
                    svc = self.m.services.get(b["name"])
                    ports = [x["port"] for x in svc["spec"]["ports"]] if svc else []
                    if b.get("port") not in ports:
                        self.fail(f"HTTPRoute {route['metadata']['name']}: backend {b} names no "
                                  "Service port")
                    self.count("HTTPRoute backends")

    # -- probes -----------------------------------------------------------------------------
    def check_probes(self):
        for p in self.m.pods:
            for c in p.containers:
                if c.init or p.kind == "Job":  # run to completion: nothing to probe
                    continue
                ports = c.ports()
                listen = None
                if self.is_ferry(c):
                    listen = self.flag(p.argv(c), "probe-listen")
                    if listen is None:
                        self.fail(f"{p.workload}/{c.name}: no --probe-listen")
                listen = int(listen.rsplit(":", 1)[1]) if listen else None
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    probe = c.spec.get(kind)
                    if probe is None:
                        # Every container needs a readiness probe; Ferry's a liveness one too.
                        required = kind == "readinessProbe" or (
                            self.is_ferry(c) and kind == "livenessProbe")
                        if required:
                            self.fail(f"{p.workload}/{c.name}: no {kind}")
                        continue
                    for how in ("grpc", "httpGet", "tcpSocket"):
                        if how in probe:
                            port = probe[how]["port"]
                            port = ports.get(port, port)
                            if port not in ports.values():
                                self.fail(f"{p.workload}/{c.name} {kind}: port {port} is not a "
                                          "container port")
                            if how == "grpc" and listen is not None and port != listen:
                                self.fail(f"{p.workload}/{c.name} {kind}: gRPC probe on {port} but "
                                          f"the probe port is {listen}")
                            self.count("probes on a container port")
                    if self.is_ferry(c) and "grpc" not in probe:
                        self.fail(f"{p.workload}/{c.name} {kind}: not a gRPC health probe")

    # -- Ferry's own wiring -----------------------------------------------------------------
    def check_etcd(self):
        etcd = [s for s in self.m.by_kind.get("StatefulSet", [])
                if s["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd"]
        if etcd:
            sts = etcd[0]
            svc = sts["spec"]["serviceName"]
            client = next(sp["port"] for sp in self.m.services[svc]["spec"]["ports"]
                          if sp["name"] == "client")
            members = [f"{sts['metadata']['name']}-{i}.{svc}:{client}"
                       for i in range(sts["spec"]["replicas"])]
            # Services dial the first three members (a scale to 5 changes none of them); each
            # member's start-up helper asks all of them.
            want, everyone = set(members[:3]), set(members)
        else:
            want = {"{}:{}".format(*ADDRESS.match(e).group(2, 3)) for e in self.args.external_etcd}
            everyone = want
            if not want:
                self.fail("no bundled etcd and no --external-etcd given")
        seen = set()
        for p in self.m.pods:
            for c in p.containers:
                if not self.is_ferry(c):
                    continue
                env = p.env(c)
                argv = p.argv(c)
                if argv[1:2] == ["etcd-member"]:
                    eps = self.flag(argv, "etcd-endpoints") or ""
                    got = {"{}:{}".format(*ADDRESS.match(e).group(2, 3)) for e in eps.split(",")}
                    if got != everyone:
                        self.fail(f"{p.workload}/{c.name}: asks {sorted(got)} for the running "
                                  f"cluster, not every member {sorted(everyone)}")
                    self.count("etcd members asking every member how to start")
                    continue
                eps = env.get("FERRY_ETCD_ENDPOINTS") or ""
                got = {"{}:{}".format(*ADDRESS.match(e).group(2, 3)) for e in eps.split(",") if e}
                if got != want:
                    self.fail(f"{p.workload}/{c.name}: etcd endpoints {sorted(got)}, expected the "
                              f"etcd members {sorted(want)}")
                seen.add((eps, env.get("FERRY_CLUSTER")))
                self.count("containers pointed at etcd")
        if len(seen) > 1:
            self.fail(f"containers disagree on etcd or cluster name: {seen}")

    # -- disruption budgets and spread -----------------------------------------------------
    def check_disruption_budgets(self):
        """Every PodDisruptionBudget lets at least one of its pods go while all are up: one no
        eviction can meet blocks every node drain."""
        for pdb in self.m.by_kind.get("PodDisruptionBudget", []):
            name, spec = pdb["metadata"]["name"], pdb["spec"]
            pods = self.m.selected(spec["selector"].get("matchLabels", {}))
            if not pods:
                self.fail(f"PodDisruptionBudget {name} selects no pod")
                continue
            low = spec.get("minAvailable")
            high = spec.get("maxUnavailable")
            if isinstance(low, int) and low >= len(pods):
                self.fail(f"PodDisruptionBudget {name}: minAvailable {low} of {len(pods)} pods "
                          "blocks every drain")
            elif high in (0, "0", "0%"):
                self.fail(f"PodDisruptionBudget {name}: maxUnavailable 0 blocks every drain")
            else:
                self.count("disruption budgets a drain can meet")

    def check_spread(self):
        """The pods of every workload of more than one replica prefer (or are required to be
        on) different nodes or zones: anti-affinity on their own labels, or a spread
        constraint."""
        for kind in ("Deployment", "StatefulSet"):
            for w in self.m.by_kind.get(kind, []):
                spec, name = w["spec"]["template"]["spec"], w["metadata"]["name"]
                labels = w["spec"]["selector"]["matchLabels"]
                if w["spec"].get("replicas", 2) < 2:
                    continue
                anti = spec.get("affinity", {}).get("podAntiAffinity", {})
                terms = [t.get("podAffinityTerm", t) for t in
                         anti.get("preferredDuringSchedulingIgnoredDuringExecution", []) +
                         anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])]
                # A term away from the workload's own pods: its labels select them.
                selectors = [t.get("labelSelector", {}).get("matchLabels") or {} for t in terms]
                own = any(sel and sel.items() <= labels.items() for sel in selectors)
                if own or spec.get("topologySpreadConstraints"):
                    self.count("replicated workloads spread")
                else:
                    self.fail(f"{kind} {name}: its replicas may all land on one node")

    def flag(self, argv, name):
        for a in argv:
            if a.startswith(f"--{name}="):
                return a.split("=", 1)[1]
        return None

    def check_ferry_wiring(self):
        for p in self.m.pods:
            for c in p.containers:
                if not self.is_ferry(c):
                    continue
                argv = p.argv(c)
                advertised = self.flag(argv, "advertise-address")
                listen = self.flag(argv, "listen")
                if advertised:
                    host, port = advertised.rsplit(":", 1)
                    target = self.names.get(host)
                    if target != ("pod", p):
                        self.fail(f"{p.workload}/{c.name}: --advertise-address {advertised} does "
                                  f"not name its own pod")
                    if listen and int(port) != int(listen.rsplit(":", 1)[1]):
                        self.fail(f"{p.workload}/{c.name}: advertises port {port}, listens on "
                                  f"{listen}")
                    self.count("advertised addresses that name their pod")
                mounts = [vm["mountPath"] for vm in c.spec.get("volumeMounts", [])]
                env = p.env(c)
                files = [(k, env.get(k)) for k in
                         ("FERRY_ETCD_CACERT", "FERRY_ETCD_CERT", "FERRY_ETCD_KEY",
                          "FERRY_TLS_CERT", "FERRY_TLS_KEY", "FERRY_TLS_CA",
                          "FERRY_LOG_FILTER_FILE")]
                files.append(("--model", self.flag(argv, "model")))
                files.append(("--api-keys-file", self.flag(argv, "api-keys-file")))
                for what, path in files:
                    if path and not any(path.startswith(m.rstrip("/") + "/") for m in mounts):
                        self.fail(f"{p.workload}/{c.name}: {what} {path} is on no volume")
                    elif path:
                        self.count("files read from a mounted volume")
                if argv[0] == "ferry-executor":
                    cuda = self.flag(argv, "backend") == "cuda"
                    if cuda != c.image.endswith(self.args.cuda_suffix):
                        self.fail(f"{p.workload}: backend {self.flag(argv, 'backend')} in image "
                                  f"{c.image}")
                    self.count("executors in the image of their backend")
                    # A CUDA executor asks the device plugin for its GPU (and is given only it).
                    limits = c.spec.get("resources", {}).get("limits", {})
                    if cuda and not limits.get("nvidia.com/gpu"):
                        self.fail(f"{p.workload}/{c.name}: backend cuda with no nvidia.com/gpu "
                                  "limit")
                    elif cuda:
                        self.count("CUDA executors given GPUs")
                    if cuda:
                        self.check_gpu_fit(p, c, argv)
                    agent = next((x for x in p.containers if self.is_ferry(x) and
                                  p.argv(x)[0] == "ferry-kv"), None)
                    kv = self.flag(argv, "kv-agent")
                    if agent is None or kv is None:
                        self.fail(f"{p.workload}: executor without a KV agent beside it")
                        continue
                    aargv = p.argv(agent)
                    if kv != self.flag(aargv, "advertise-address"):
                        self.fail(f"{p.workload}: --kv-agent {kv} is not its agent's advertised "
                                  f"address {self.flag(aargv, 'advertise-address')}")
                    shm, ashm = self.flag(argv, "kv-shm-dir"), self.flag(aargv, "shm-dir")
                    vol = {vm["mountPath"]: vm["name"] for vm in c.spec.get("volumeMounts", [])}
                    avol = {vm["mountPath"]: vm["name"] for vm in
                            agent.spec.get("volumeMounts", [])}
                    if shm != ashm or vol.get(shm) is None or vol.get(shm) != avol.get(ashm):
                        self.fail(f"{p.workload}: executor's --kv-shm-dir {shm} and agent's "
                                  f"--shm-dir {ashm} are not one shared volume")
                    self.count("executors wired to their own agent")
        # Fronts and schedulers' own HTTP APIs route alike (`--route-load-tokens`).
        weights = {self.flag(p.argv(c), "route-load-tokens") for p in self.m.pods
                   for c in p.containers if self.is_service(p, c) and p.argv(c)[0] == "ferry-scheduler"}
        if len(weights) > 1 or None in weights:
            self.fail("routers weigh load differently: --route-load-tokens "
                      f"{sorted(map(str, weights))}")
        elif weights:
            self.count("routers weighing load alike")

    def check_shards(self):
        """The fronts follow exactly the scheduler pools the release runs."""
        fronts, pools = set(), set()
        for p in self.m.pods:
            for c in p.containers:
                if not self.is_service(p, c):
                    continue
                argv = p.argv(c)
                if argv[:2] == ["ferry-scheduler", "front"]:
                    fronts.add(self.flag(argv, "pool"))
                elif argv[0] == "ferry-scheduler":
                    pools.add(self.flag(argv, "pool"))
        for f in fronts:
            followed = set((f or "").split(","))
            if followed != pools:
                self.fail(f"a front follows pools {sorted(followed)}, the schedulers lead "
                          f"{sorted(pools)}")
            else:
                self.count("fronts following every scheduler pool")

    def flags(self, argv, name):
        return [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]

    def check_models(self):
        """Every front and scheduler serves the same models (files and names, in one order),
        and every executor runs one of them, so a request for any model has executors and
        every executor a scheduler that drives it."""
        served, executors = set(), []
        for p in self.m.pods:
            for c in p.containers:
                if not self.is_ferry(c):
                    continue
                argv = p.argv(c)
                if argv[0] == "ferry-scheduler" and argv[1:2] != ["etcd-member"]:
                    files, names = self.flags(argv, "model"), self.flags(argv, "served-model-name")
                    served.add((tuple(files), tuple(names)))
                elif argv[0] == "ferry-executor" and self.flag(argv, "model"):
                    executors.append((p.workload, self.flag(argv, "model")))
        if len(served) != 1:
            self.fail(f"fronts and schedulers serve different models: {sorted(served)}")
            return
        files, names = next(iter(served))
        if len(files) != len(names):
            self.fail(f"{len(files)} --model but {len(names)} --served-model-name")
        self.count("fronts and schedulers serving the same models")
        running = set()
        for workload, model in executors:
            if model not in files:
                self.fail(f"{workload}: runs {model}, which no scheduler serves ({list(files)})")
            else:
                running.add(model)
                self.count("executors running a served model")
        idle = [f for f in files if f not in running]
        if executors and idle:
            self.fail(f"no executor pool runs {idle}: requests for it would find no executor")

    def check_data_parallel(self):
        """Each data-parallel group's executors are ranks 0 to size - 1 of one size, one each,
        driven by one scheduler pool."""
        groups = {}
        for p in self.m.pods:
            for c in p.containers:
                argv = p.argv(c)
                if self.is_ferry(c) and argv[0] == "ferry-executor" and self.flag(argv, "dp-group"):
                    group = groups.setdefault(self.flag(argv, "dp-group"), [])
                    group.append((self.flag(argv, "dp-rank"), self.flag(argv, "dp-size"), p.name))
        pools = {self.flag(p.argv(c), "pool") for p in self.m.pods for c in p.containers
                 if self.is_service(p, c) and p.argv(c)[:1] == ["ferry-scheduler"]
                 and p.argv(c)[1:2] != ["front"]}
        for name, ranks in groups.items():
            sizes = {size for _, size, _ in ranks}
            got = sorted(rank for rank, _, _ in ranks)
            want = [str(i) for i in range(len(ranks))]
            if len(sizes) != 1 or sizes != {str(len(ranks))} or sorted(got, key=int) != want:
                self.fail(f"data-parallel group {name}: ranks {got} of sizes {sorted(sizes)} "
                          f"over {len(ranks)} pods")
            elif len(pools) > 1:
                self.fail(f"data-parallel group {name} under {len(pools)} scheduler pools")
            else:
                self.count("data-parallel groups whose pods are their ranks")

    ROLES = {"ferry-executor": "ferry-executor", "ferry-kv": "ferry-kv",
             "ferry-scheduler": "ferry-scheduler"}

    def check_tls(self):
        """Mutual TLS between services: all Ferry containers or none, each with its role's
        certificate."""
        issued = {c["spec"]["secretName"]: c["spec"].get("dnsNames", [])
                  for c in self.m.by_kind.get("Certificate", [])}
        modes = set()
        for p in self.m.pods:
            for c in p.containers:
                if not self.is_service(p, c):
                    continue
                env, argv = p.env(c), p.argv(c)
                cert = env.get("FERRY_TLS_CERT")
                plaintext = env.get("FERRY_PLAINTEXT") == "true"
                modes.add(bool(cert))
                if bool(cert) == plaintext:
                    self.fail(f"{p.workload}/{c.name}: FERRY_TLS_CERT {cert!r} beside "
                              f"FERRY_PLAINTEXT {env.get('FERRY_PLAINTEXT')!r}")
                if not cert:
                    continue
                role = "ferry-front" if argv[:2] == ["ferry-scheduler", "front"] \
                    else self.ROLES[argv[0]]
                folder = os.path.dirname(cert)
                mounts = {vm["mountPath"].rstrip("/"): vm["name"]
                          for vm in c.spec.get("volumeMounts", [])}
                vols = {v["name"]: v for v in p.spec.get("volumes", [])}
                secret = vols.get(mounts.get(folder), {}).get("secret", {}).get("secretName")
                if secret is None:
                    self.fail(f"{p.workload}/{c.name}: FERRY_TLS_CERT {cert} is not in a Secret")
                    continue
                names = issued.get(secret)
                if names is not None and role not in names:
                    self.fail(f"{p.workload}/{c.name} ({role}) presents Secret {secret}, whose "
                              f"Certificate names {names}")
                self.count("containers presenting their role's certificate")
        if len(modes) > 1:
            self.fail("mutual TLS is on in some Ferry containers and off in others")

    def check_targets(self):
        workloads = {(w["kind"], w["metadata"]["name"]) for k in ("Deployment", "StatefulSet")
                     for w in self.m.by_kind.get(k, [])}
        for h in self.m.by_kind.get("HorizontalPodAutoscaler", []):
            t = h["spec"]["scaleTargetRef"]
            if (t["kind"], t["name"]) not in workloads:
                self.fail(f"HPA {h['metadata']['name']}: target {t} missing")
            self.count("HPA targets")
        for kind in ("PodDisruptionBudget", "NetworkPolicy"):
            for o in self.m.by_kind.get(kind, []):
                sel = (o["spec"].get("selector") or o["spec"].get("podSelector"))["matchLabels"]
                if not self.m.selected(sel):
                    self.fail(f"{kind} {o['metadata']['name']} selects no pod")
                self.count(f"{kind} selectors")
        for sm in self.m.by_kind.get("ServiceMonitor", []):
            sel = sm["spec"]["selector"]["matchLabels"]
            svcs = [s for s in self.m.services.values()
                    if all(s["metadata"]["labels"].get(k) == v for k, v in sel.items())]
            names = {p.get("name") for s in svcs for p in s["spec"]["ports"]}
            for ep in sm["spec"]["endpoints"]:
                if ep["port"] not in names:
                    self.fail(f"ServiceMonitor: no selected Service has port {ep['port']}")
                self.count("ServiceMonitor endpoints")
            ferry = {s["metadata"]["name"] for s in svcs if
                     any(p.get("name") in ("probe", "kv-probe") for p in s["spec"]["ports"])}
            if not ferry:
                self.fail("ServiceMonitor scrapes no Ferry Service")

    def run(self):
        self.check_config()
        self.check_addresses()
        self.check_services()
        self.check_references()
        self.check_probes()
        self.check_etcd()
        self.check_disruption_budgets()
        self.check_spread()
        self.check_ferry_wiring()
        self.check_shards()
        self.check_models()
        self.check_data_parallel()
        self.check_tls()
        self.check_targets()
        return self.failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("manifest")
    ap.add_argument("--bin", required=True, help="folder of ferry-scheduler, ferry-executor, ferry-kv")
    ap.add_argument("--image-repo", default="ghcr.io/ferry-serving/ferry")
    ap.add_argument("--cuda-suffix", default="-cuda")
    ap.add_argument("--external-secret", action="append", default=[])
    ap.add_argument("--external-etcd", action="append", default=[])
    ap.add_argument("--secret", action="append", default=[], metavar="NAME=DIR",
                    help="a Secret's files, for flags whose files the binary reads (it is "
                         "also declared external)")
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args()
    args.secrets = dict(x.split("=", 1) for x in args.secret)
    args.external_secret += list(args.secrets)
    checker = Checker(Manifest(load(args.manifest), args.namespace), args)
    failures = checker.run()
    name = os.path.basename(args.manifest)
    for f in failures:
        print(f"check {name}: FAIL {f}")
    summary = ", ".join(f"{n} {what}" for what, n in sorted(checker.counts.items()))
    print(f"check {name}: {'FAILED' if failures else 'ok'} ({summary})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
