#!/usr/bin/env bash
# The web console in a real browser (part of `make test`): starts the dev
# cluster (`gangway dev`, 3 replicas, 6 simulated GPU nodes in 2 racks,
# private jobs),
# runs jobs in it with the CLI, quarantines a GPU, and has headless Chromium
# check every page against what the CLI says, cancel from the page, and log
# in as another user who may not see the admin's jobs. Screenshots of each
# page go to SCREENSHOT_DIR.
#
#   controller/tests/console/check.sh GANGWAY_BINARY SCREENSHOT_DIR
set -euo pipefail
bin=$(realpath "${1:?usage: check.sh GANGWAY_BINARY SCREENSHOT_DIR}")
shots=$(realpath -m "${2:?usage: check.sh GANGWAY_BINARY SCREENSHOT_DIR}")
here=$(cd "$(dirname "$0")" && pwd)
chromium=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium" ]; then
    echo "console check: needs Chromium (deploy/setup-debian.sh installs Debian's chromium)" >&2
    exit 1
fi
# Free ports below the kernel's ephemeral range (where other tests' client
# connections could take one meanwhile): three in a row for the replicas,
# three for their consoles.
read -r port ui < <(python3 - <<'PY'
import random, socket
def free(p):
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
low = max(int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0]), 20010)
rng = random.Random()
for _ in range(200):
    a, b = rng.randrange(20000, low - 3), rng.randrange(20000, low - 3)
    if abs(a - b) > 3 and all(free(p) for p in (a, a + 1, a + 2, b, b + 1, b + 2)):
        print(a, b)
        break
PY
)
[ -n "$port" ] && [ -n "$ui" ] || { echo "console check: found no free ports" >&2; exit 1; }
endpoints=127.0.0.1:$port,127.0.0.1:$((port + 1)),127.0.0.1:$((port + 2))
work=$(mktemp -d /tmp/gangway-console-check.XXXXXX)
dev=
stop() {
    if [ -n "$dev" ]; then
        # Jobs first (their processes outlive a stopped agent on purpose), then the cluster.
        for j in ${jobs_started:-}; do GANGWAY_ENDPOINTS=$endpoints "$bin" cancel "$j" >/dev/null 2>&1 || true; done
        sleep 1
        kill -INT "$dev" 2>/dev/null || true
        wait "$dev" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap stop EXIT
cd "$work"
"$bin" dev --port $port --metrics-port 0 --ui-port $ui --nodes 6 --private-jobs --data-dir "$work/data" \
    >"$work/dev.log" 2>&1 &
dev=$!
for _ in $(seq 1 300); do
    grep -q "console:" "$work/dev.log" && break
    kill -0 "$dev" 2>/dev/null || { cat "$work/dev.log" >&2; echo "console check: the dev cluster did not start" >&2; exit 1; }
    sleep 0.2
done
login=$(grep -o 'http://[^ ]*/ui/#token=[^ ]*' "$work/dev.log" | head -1)
tls=$(grep -o 'throwaway CA in [^ ]*' "$work/dev.log" | awk '{print $4}')
[ -n "$login" ] && [ -n "$tls" ] || { cat "$work/dev.log" >&2; echo "console check: no login link or CA in the dev cluster's banner" >&2; exit 1; }
export GANGWAY_ENDPOINTS=$endpoints
g() { "$bin" "$@"; }
# A GPU fails on the third node (the simulated agent reads its fault file).
echo '5 xid 79' >"$work/data/agent-dev-node-3/gpu-faults"
for _ in $(seq 1 100); do
    g nodes --json | grep -q '"healthy": false' && break
    sleep 0.2
done
odd_name='<img src=x onerror="window.__xss=1">'
train=$(g submit --parsable -J train-llm -N 1 --gpus-per-node h100:4 -- sleep 600)
odd=$(g submit --parsable -J "$odd_name" -N 1 --gpus-per-node h100:1 -- sleep 600)
wide=$(g submit --parsable -J pretrain-70b -N 2 --gpus-per-node h100:8 -- sleep 600)
big=$(g submit --parsable -J big-sweep -N 4 --gpus-per-node h100:8 -- sleep 600)
jobs_started="$train $odd $wide $big"
for _ in $(seq 1 100); do
    [ "$(g show "$train" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')" = RUNNING ] &&
        [ "$(g show "$odd" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')" = RUNNING ] && break
    sleep 0.2
done
other=bob
other_token=$(g token create --key "$tls/token-key.pem" --user "$other" --lifetime 30m)
python3 - "$work/config.json" <<PY
import json, sys
json.dump({
    "gangway": "$bin", "chromium": "$chromium", "endpoints": "$endpoints", "screenshots": "$shots",
    "login_url": "$login", "admin": "$(id -un)",
    "other": "$other", "other_login_url": "http://127.0.0.1:$ui/ui/#token=$other_token",
    "jobs": {"train": "$train", "odd": "$odd", "big": "$big"}, "odd_name": '''$odd_name''',
    "fault_node": "dev-node-3", "fault_gpu": "5",
}, open(sys.argv[1], "w"))
PY
python3 "$here/browser.py" "$work/config.json"
