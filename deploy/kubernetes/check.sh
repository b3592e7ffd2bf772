#!/usr/bin/env bash
# Checks the Kubernetes manifests without a cluster (none can run here):
# the core resources against Kubernetes' own schemas (kubernetes-validate,
# strict: no unknown fields), a policy scan (checkov: every deliberate
# exception is a `checkov.io/skipN: CHECK=reason` annotation with its
# reason), the cert-manager and Prometheus ones for the fields they must
# have, and every flag the containers pass against the binary's own --help
# (so a renamed flag fails here, not in a pod).
#
#   deploy/kubernetes/check.sh GANGWAY_BINARY
set -euo pipefail
bin=${1:?usage: check.sh GANGWAY_BINARY}
dir=$(cd "$(dirname "$0")" && pwd)
# The Kubernetes version the manifests target (its schemas ship with the tool).
k8s=1.30.0
# The tools live in a virtualenv of their own (never the system's Python,
# whose packages they would replace), kept between runs.
venv=${GANGWAY_TOOLS_VENV:-$HOME/.cache/gangway/tools-venv}
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/checkov" ]; then
    echo "kubernetes check: installing kubernetes-validate and checkov into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check kubernetes-validate checkov
fi
PATH="$venv/bin:$PATH"
kubernetes-validate --strict --quiet -k "$k8s" "$dir/controller.yaml" "$dir/agent.yaml"
scan=$(mktemp)
trap 'rm -f "$scan"' EXIT
checkov --directory "$dir" --framework kubernetes --compact --quiet >"$scan" 2>&1 || {
    cat "$scan" >&2
    echo "kubernetes check: checkov found a failed check (fix it, or annotate a deliberate exception with its reason)" >&2
    exit 1
}
python3 - "$bin" "$dir" <<'PY'
import subprocess, sys, yaml
bin, d = sys.argv[1], sys.argv[2]
fail = []
docs = [doc for f in ("controller.yaml", "agent.yaml", "certificates.yaml") for doc in yaml.safe_load_all(open(f"{d}/{f}"))]
for doc in docs:
    kind = doc["kind"]
    for k, v in (doc["metadata"].get("annotations") or {}).items():
        if k.startswith("checkov.io/skip") and len(v.partition("=")[2].strip()) < 10:
            fail.append(f"{kind} {doc['metadata']['name']}: {k} gives no reason")
    if kind in ("StatefulSet", "DaemonSet"):
        for c in doc["spec"]["template"]["spec"]["containers"]:
            args = c["args"]
            help_text = subprocess.run([bin, args[0], "--help"], capture_output=True, text=True).stdout
            for a in args[1:]:
                flag = a.split("=")[0]
                if flag.startswith("--") and f"{flag} " not in help_text and f"{flag}\n" not in help_text:
                    fail.append(f"{kind} {doc['metadata']['name']}: `gangway {args[0]}` has no {flag}")
    if kind == "Certificate":
        s = doc["spec"]
        n = doc["metadata"]["name"].rsplit("-", 1)[1]
        if s.get("uris") != [f"spiffe://gangway/server/{n}"] or s.get("secretName") != doc["metadata"]["name"]:
            fail.append(f"Certificate {doc['metadata']['name']}: its URI must name server {n}, its secret itself")
    if kind == "StatefulSet":
        sources = doc["spec"]["template"]["spec"]["volumes"][0]["projected"]["sources"]
        names = {s["secret"]["name"] for s in sources}
        want = {f"gangway-server-{i}" for i in range(1, doc["spec"]["replicas"] + 1)}
        if names != want:
            fail.append(f"StatefulSet: it mounts {sorted(names)}, its {doc['spec']['replicas']} replicas need {sorted(want)}")
if fail:
    sys.exit("kubernetes check: " + "; ".join(fail))
print(f"kubernetes check: ok ({len(docs)} resources)")
PY
