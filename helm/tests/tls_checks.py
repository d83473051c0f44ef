"""The smoke run's checks of mutual TLS: every internal port answers the role that may call it
and refuses plaintext and other roles; etcd refuses plaintext and certificate-less clients."""

import concurrent.futures
import http.client
import os
import socket
import ssl
import urllib.request

from smokelog import log, sh


def check_service_tls(run):
    """Under TLS, each internal port refuses plaintext and a caller whose role may not
    call it, and answers the role that may (so the refusals mean something). The calls
    run at once: a refused one takes grpcurl seconds to give up."""
    if not run.tls:
        return
    calls = []  # (whether it must answer, what a failure means, flags, target)
    for p in run.m.pods:
        for c in p.containers:
            if (c.init and not c.sidecar) or c.image.split(":")[0] != run.args.image_repo:
                continue
            argv = p.argv(c)
            server, caller, stranger = {
                "ferry-executor": ("ferry-executor", "scheduler", "executor"),
                "ferry-kv": ("ferry-kv", "executor", "client"),
                "ferry-scheduler": ("ferry-scheduler", "client", "executor"),
            }[argv[0]]
            if argv[:2] == ["ferry-scheduler", "front"]:
                server = "ferry-front"
            port = int(next(a for a in argv if a.startswith("--listen=")).rsplit(":", 1)[1])
            target, where = f"{run.ips[p.name]}:{port}", f"{p.name}/{c.name}"
            calls += [(True, f"{where} refused {caller}", run.grpc_flags(server, caller), target),
                      (False, f"{where} answered plaintext", ["-plaintext"], target),
                      (False, f"{where} took a {stranger} certificate",
                       run.grpc_flags(server, stranger), target)]

    # Reflection is under the API keys where the front wants one; other ports ignore it.
    auth = ["-H", f"authorization: Bearer {run.args.api_key}"] if run.args.api_key else []

    def lists(call):
        _, _, flags, target = call
        return sh(run.args.grpcurl, "-connect-timeout", "3", *flags, *auth, target, "list",
                  check=False).returncode == 0

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        answered = list(pool.map(lists, calls))
    for (must, failure, _, _), did in zip(calls, answered):
        assert did == must, failure
    log(f"mutual TLS: {len(calls) // 3} service ports answer their callers' roles and refuse "
        "plaintext and other roles")


def check_etcd_tls(run):
    """With TLS to etcd, the members refuse plaintext clients (so the services that work
    spoke TLS)."""
    etcd = run.pods_of("etcd")
    tls = any(p.env(c).get("FERRY_ETCD_CACERT") for p in run.m.pods for c in p.containers)
    if not (etcd and tls):
        return
    port = etcd[0].container("etcd").ports()["client"]
    try:
        urllib.request.urlopen(f"http://{run.ips[etcd[0].name]}:{port}/version", timeout=5)
        raise AssertionError("etcd answered a plaintext request")
    except (OSError, http.client.HTTPException) as e:
        plain = type(e).__name__
    # Over TLS, a client without a certificate is refused; with the Secret's, it answers.
    tls = os.path.join(run.root, etcd[0].name, "etcd-tls")
    host = f"{etcd[0].name}.{etcd[0].service_name}"  # a name the certificate holds
    ctx = ssl.create_default_context(cafile=os.path.join(tls, "ca.crt"))
    target = (run.ips[etcd[0].name], port)
    def get(context):
        with socket.create_connection(target, timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname=host) as conn:
                conn.sendall(f"GET /version HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                return conn.recv(4096).decode(errors="replace")
    try:
        answer = get(ctx)
        refused = "HTTP/1.1 200" not in answer
    except (OSError, ssl.SSLError):
        refused = True
    assert refused, "etcd answered a TLS client without a certificate"
    ctx.load_cert_chain(os.path.join(tls, "tls.crt"), os.path.join(tls, "tls.key"))
    answer = get(ctx)
    assert "HTTP/1.1 200" in answer and "etcdserver" in answer, answer
    log(f"etcd refuses plaintext ({plain}) and TLS without a client certificate, answers "
        "with one: the services reach it over mutual TLS")
