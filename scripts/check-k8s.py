#!/usr/bin/env python3
"""Render every Kustomize overlay under deploy/k8s/overlays offline and check it against the
gate it deploys.

    scripts/check-k8s.py [--bin PATH]       (SLACKGATE_BIN, else target/release/slackgate)

For each overlay, `kubectl kustomize DIR` (kubectl's own Kustomize; nothing reaches a cluster)
and then, reading the rendered objects and the config in the ConfigMap the Deployment mounts:

- the config passes `slackgate check FILE`, with every Secret-fed variable set to a dummy;
- the container port, the probes (readiness on /readyz, liveness on /healthz), the Service's
  target and the ServiceMonitor (/metrics) all name the port the gate listens on (the
  config's server.listen, or --listen in the args), on an address the kubelet can reach;
- replicas equals cluster.expected_replicas (1 without [cluster]);
- the admin token and every pool's api_key_env come from secretKeyRef, never a literal;
- terminationGracePeriodSeconds > server.shutdown_grace_ms + the preStop sleep;
- every container: runAsNonRoot, readOnlyRootFilesystem, no privilege escalation, ALL
  capabilities dropped, seccomp RuntimeDefault, resource requests;
- the kinds a platform team expects are there (Deployment, Service, ConfigMap,
  PodDisruptionBudget, ServiceMonitor, NetworkPolicy); a SQLite ledger sits on a
  PersistentVolumeClaim; a [cluster]'s Redis is a Service of the render whose server runs
  with appendonly yes.

Then a self-test: each check must fail on a copy of a rendered overlay broken on purpose.
Needs kubectl (client 1.27+, with Kustomize 5) and PyYAML; fails loudly without either.
"""
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

try:
    import yaml
except ImportError:
    sys.exit("check-k8s: PyYAML is missing (scripts/venv.sh installs it into .venv)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAYS = os.path.join(ROOT, "deploy", "k8s", "overlays")
REQUIRED_KINDS = ["Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
                  "ServiceMonitor", "NetworkPolicy"]


class Failure(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise Failure(msg)


def render(overlay):
    out = subprocess.run(["kubectl", "kustomize", overlay], capture_output=True, text=True,
                         timeout=120)
    need(out.returncode == 0, f"kubectl kustomize {overlay} failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(docs, kind, name=None):
    return [d for d in docs if d.get("kind") == kind
            and (name is None or d["metadata"]["name"] == name)]


def gate_deployment(docs):
    deps = find(docs, "Deployment", "slackgate")
    need(len(deps) == 1, f"one Deployment named slackgate, found {len(deps)}")
    pod = deps[0]["spec"]["template"]["spec"]
    gates = [c for c in pod["containers"] if c["name"] == "slackgate"]
    need(len(gates) == 1, "the Deployment has no container named slackgate")
    return deps[0], pod, gates[0]


def mounted_config(docs, pod, container):
    """The TOML the gate reads: --config's path, in the ConfigMap mounted there."""
    args = container.get("args", [])
    need("--config" in args, "the gate's args name no --config FILE")
    path = args[args.index("--config") + 1]
    mounts = [m for m in container.get("volumeMounts", [])
              if path.startswith(m["mountPath"].rstrip("/") + "/")]
    need(mounts, f"no volume is mounted where --config {path} is")
    vol = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]][0]
    need("configMap" in vol, f"{path} is not on a ConfigMap volume")
    cms = find(docs, "ConfigMap", vol["configMap"]["name"])
    need(cms, f"the ConfigMap {vol['configMap']['name']} is not in the render")
    key = os.path.relpath(path, mounts[0]["mountPath"])
    need(key in cms[0].get("data", {}), f"the ConfigMap has no key {key}")
    return cms[0]["data"][key]


def arg_value(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def check_config_passes(text, container, binary):
    env = dict(os.environ)
    for e in container.get("env", []):
        if "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = "dummy-secret-value-for-check"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "slackgate.toml")
        with open(path, "w") as f:
            f.write(text)
        out = subprocess.run([binary, "check", path], capture_output=True, text=True, env=env,
                             timeout=60)
    need(out.returncode == 0, f"slackgate check fails on the ConfigMap's config: "
         f"{out.stderr.strip().splitlines()[:3]}")


def port_of(container, ref):
    if isinstance(ref, int):
        return ref
    ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == ref]
    need(ports, f"the container has no port named {ref}")
    return ports[0]


def check_ports_and_probes(docs, container, cfg):
    listen = arg_value(container.get("args", []), "--listen") or \
        cfg.get("server", {}).get("listen", "127.0.0.1:8080")
    host, _, port = listen.rpartition(":")
    port = int(port)
    need(host not in ("127.0.0.1", "localhost", "[::1]"),
         f"the gate listens on {listen}: the kubelet and the Service cannot reach loopback")
    need(port in [p["containerPort"] for p in container.get("ports", [])],
         f"no containerPort is the gate's port {port}")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container.get(probe, {}).get("httpGet")
        need(get, f"{probe} is not an httpGet")
        need(get["path"] == path, f"{probe} asks {get['path']}, the gate serves {path}")
        need(port_of(container, get["port"]) == port,
             f"{probe} probes port {get['port']}, the gate listens on {port}")
    svc = find(docs, "Service", "slackgate")
    need(svc, "no Service named slackgate")
    svc_ports = svc[0]["spec"]["ports"]
    need(any(port_of(container, p.get("targetPort", p["port"])) == port for p in svc_ports),
         f"the Service targets no port {port}")
    for sm in find(docs, "ServiceMonitor"):
        for ep in sm["spec"]["endpoints"]:
            need(ep.get("path", "/metrics") == "/metrics", "the ServiceMonitor scrapes no /metrics")
            named = [p for p in svc_ports if p.get("name") == ep["port"]]
            need(named and port_of(container, named[0].get("targetPort", named[0]["port"]))
                 == port, f"the ServiceMonitor scrapes port {ep['port']}, not the gate's")
    for np in find(docs, "NetworkPolicy", "slackgate"):
        allowed = [port_of(container, p["port"]) for rule in np["spec"].get("ingress", [])
                   for p in rule.get("ports", [])]
        need(port in allowed, f"the NetworkPolicy admits no traffic to port {port}")


def check_replicas(dep, cfg):
    want = cfg.get("cluster", {}).get("expected_replicas", 1) if "cluster" in cfg else 1
    got = dep["spec"].get("replicas", 1)
    need(got == want, f"replicas is {got}, the config expects {want}")


def check_secrets(container, cfg):
    env = {e["name"]: e for e in container.get("env", [])}
    need("token" not in cfg.get("admin", {}), "the config holds the admin token itself")
    names = []
    if "admin" in cfg and "token_file" not in cfg["admin"]:
        names.append("SLACKGATE_ADMIN_TOKEN")
    for pool in cfg.get("pools", []):
        if "api_key_env" in pool.get("auth", {}):
            names.append(pool["auth"]["api_key_env"])
    need(names, "neither an admin token nor an upstream key is configured")
    for name in names:
        need(name in env, f"{name} is not set in the Deployment")
        need("secretKeyRef" in env[name].get("valueFrom", {}),
             f"{name} does not come from a Secret (secretKeyRef)")


def check_grace(pod, container, cfg):
    grace_ms = cfg.get("server", {}).get("shutdown_grace_ms", 30_000)
    sleep = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds")
    need(sleep, "no preStop sleep: the Service may still send while the gate stops")
    term = pod.get("terminationGracePeriodSeconds", 30)
    need(term * 1000 > grace_ms + sleep * 1000,
         f"terminationGracePeriodSeconds {term} s <= shutdown grace {grace_ms} ms + preStop "
         f"{sleep} s: Kubernetes would SIGKILL the gate while it drains")


def check_security(docs):
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]["spec"]
        psc = pod.get("securityContext", {})
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            who = f"{d['kind']}/{d['metadata']['name']} container {c['name']}"
            need(sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, f"{who}: runAsNonRoot")
            need(sc.get("readOnlyRootFilesystem") is True, f"{who}: readOnlyRootFilesystem")
            need(sc.get("allowPrivilegeEscalation") is False, f"{who}: allowPrivilegeEscalation")
            need(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{who}: drop ALL")
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {}))
            need(seccomp.get("type") == "RuntimeDefault", f"{who}: seccomp RuntimeDefault")
            need(c.get("resources", {}).get("requests"), f"{who}: resource requests")


def check_storage(docs, pod, container, cfg):
    kinds = {d["kind"] for d in docs}
    for k in REQUIRED_KINDS:
        need(k in kinds, f"no {k} in the render")
    if "cluster" not in cfg:
        ledger = cfg.get("server", {}).get("ledger", "slackgate-ledger.db")
        need(ledger != "memory", "a single gate with its ledger in memory loses it at restart")
        need(os.path.isabs(ledger), f"server.ledger {ledger} is relative")
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        on_pvc = [m for m in container.get("volumeMounts", []) if m["name"] in claims
                  and os.path.dirname(ledger) == m["mountPath"].rstrip("/")]
        need(on_pvc, f"the ledger {ledger} is not on a PersistentVolumeClaim")
        return
    url = cfg["cluster"]["redis"]
    host = url.split("://", 1)[1].rsplit("@", 1)[-1].split(":")[0].split("/")[0]
    svcs = find(docs, "Service", host.split(".")[0])
    need(svcs, f"cluster.redis names {host}, no such Service in the render")
    selector = svcs[0]["spec"]["selector"]
    redis = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and
             selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    need(redis, f"the Service {host} selects no workload")
    words = []
    for c in redis[0]["spec"]["template"]["spec"]["containers"]:
        words += c.get("command", []) + c.get("args", [])
    need(any(a == "--appendonly" and b == "yes" for a, b in zip(words, words[1:])),
         "Redis runs without appendonly yes: a restart loses the shared ledger")


def check_overlay(docs, binary):
    dep, pod, container = gate_deployment(docs)
    text = mounted_config(docs, pod, container)
    cfg = tomllib.loads(text)
    check_config_passes(text, container, binary)
    check_ports_and_probes(docs, container, cfg)
    check_replicas(dep, cfg)
    check_secrets(container, cfg)
    check_grace(pod, container, cfg)
    check_security(docs)
    check_storage(docs, pod, container, cfg)
    return dep, cfg


def breakages():
    """Ways to break a rendered overlay, each with words of the failure that must name it."""
    def gate(docs):
        return gate_deployment(docs)[2]

    def pod(docs):
        return gate_deployment(docs)[1]

    def set_(f):
        def apply(docs):
            f(docs)
            return docs
        return apply

    def literal_token(docs):
        for e in gate(docs)["env"]:
            if e["name"] == "SLACKGATE_ADMIN_TOKEN":
                e.pop("valueFrom")
                e["value"] = "a-literal-token-in-the-manifest"
        return docs

    def redis_without_aof(docs):
        for d in find(docs, "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                c["args"] = [a for a in c.get("args", []) if a not in ("--appendonly", "yes")]
        return docs

    def ledger_off_volume(docs):
        gate(docs)["volumeMounts"] = [m for m in gate(docs)["volumeMounts"]
                                      if m["mountPath"] != "/var/lib/slackgate"]
        return docs

    def bad_config(docs):
        for cm in find(docs, "ConfigMap"):
            for k in cm.get("data", {}):
                cm["data"][k] += "\n[[classes]]\nname = 1\n"
        return docs
    return {
        "replicas": (set_(lambda d: gate_deployment(d)[0]["spec"].update(replicas=2)),
                     "replicas is 2"),
        "readiness path": (set_(lambda d: gate(d)["readinessProbe"]["httpGet"].update(
            path="/health")), "readinessProbe asks /health"),
        "liveness port": (set_(lambda d: gate(d)["livenessProbe"]["httpGet"].update(port=9090)),
                          "livenessProbe probes port 9090"),
        "container port": (set_(lambda d: gate(d)["ports"][0].update(containerPort=8081)),
                           "no containerPort"),
        "literal secret": (literal_token, "SLACKGATE_ADMIN_TOKEN does not come from a Secret"),
        "grace": (set_(lambda d: pod(d).update(terminationGracePeriodSeconds=30)),
                  "terminationGracePeriodSeconds 30"),
        "no preStop": (set_(lambda d: gate(d).pop("lifecycle")), "no preStop sleep"),
        "root fs": (set_(lambda d: gate(d)["securityContext"].update(
            readOnlyRootFilesystem=False)), "readOnlyRootFilesystem"),
        "caps": (set_(lambda d: gate(d)["securityContext"]["capabilities"].update(
            drop=["NET_RAW"])), "drop ALL"),
        "no ServiceMonitor": (lambda d: [x for x in d if x["kind"] != "ServiceMonitor"],
                              "no ServiceMonitor"),
        "bad config": (bad_config, "slackgate check fails"),
        "redis without AOF": (redis_without_aof, "appendonly"),
        "ledger off its volume": (ledger_off_volume, "not on a PersistentVolumeClaim"),
    }


def self_test(rendered, binary):
    """Break each rendered overlay each way that applies; the right check must say so."""
    failed = caught = 0
    for name, docs in rendered.items():
        cluster = bool(find(docs, "StatefulSet"))
        for what, (breakage, words) in breakages().items():
            if (what == "redis without AOF" and not cluster) or \
                    (what == "ledger off its volume" and cluster):
                continue
            try:
                check_overlay(breakage(copy.deepcopy(docs)), binary)
                why = "still passes"
            except Failure as e:
                why = None if words in str(e) else f"fails for another reason: {e}"
            if why:
                failed += 1
                print(f"check-k8s: self-test: overlays/{name} broken ({what}) {why}",
                      file=sys.stderr)
            else:
                caught += 1
    return failed, caught


def check_examples():
    """Every metric an example under deploy/k8s/examples queries is one the gate exports (the
    table in docs/reference.md, which a test holds to a live scrape)."""
    import re
    with open(os.path.join(ROOT, "docs", "reference.md")) as f:
        exported = set(re.findall(r"^\| `(slackgate_[a-z_]+)` \|", f.read(), re.M))
    need(exported, "no metrics table in docs/reference.md")
    folder = os.path.join(ROOT, "deploy", "k8s", "examples")
    checked = 0
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for d in docs:
            for t in d.get("spec", {}).get("triggers", []):
                query = t.get("metadata", {}).get("query", "")
                for m in re.findall(r"slackgate_[a-z_]+", query):
                    need(m in exported, f"examples/{name} queries {m}, which the gate does not export")
                    checked += 1
    return checked


def main():
    binary = os.environ.get("SLACKGATE_BIN") or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "slackgate")
    if "--bin" in sys.argv:
        binary = sys.argv[sys.argv.index("--bin") + 1]
    if not shutil.which("kubectl"):
        sys.exit("check-k8s: FAILED: kubectl is not on PATH (it renders the overlays with its "
                 "Kustomize; install kubectl 1.27+, not Debian's old kubernetes-client)")
    if not os.access(binary, os.X_OK):
        sys.exit(f"check-k8s: FAILED: no slackgate binary at {binary} (cargo build --release "
                 "-p slackgate, or SLACKGATE_BIN)")
    overlays = sorted(os.listdir(OVERLAYS))
    need(overlays, "no overlays")
    failed = 0
    rendered = {}
    for name in overlays:
        try:
            docs = render(os.path.join(OVERLAYS, name))
            dep, cfg = check_overlay(docs, binary)
            rendered[name] = docs
            print(f"check-k8s: overlays/{name}: ok ({len(docs)} objects, "
                  f"{dep['spec'].get('replicas', 1)} replicas, "
                  f"{'redis ' + cfg['cluster']['redis'] if 'cluster' in cfg else 'ledger ' + cfg['server']['ledger']})")
        except Failure as e:
            failed += 1
            print(f"check-k8s: overlays/{name}: FAILED: {e}", file=sys.stderr)
    try:
        print(f"check-k8s: examples: {check_examples()} metric names in queries, all exported")
    except Failure as e:
        failed += 1
        print(f"check-k8s: examples: FAILED: {e}", file=sys.stderr)
    bad, caught = self_test(rendered, binary)
    failed += bad
    if failed:
        sys.exit(f"check-k8s: {failed} failures")
    print(f"check-k8s: self-test: {caught} breakages of the rendered overlays, each caught by "
          "the check that names it")


if __name__ == "__main__":
    main()
