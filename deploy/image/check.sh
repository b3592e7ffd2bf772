#!/usr/bin/env bash
# Checks an image archive from build.sh without running a container (this
# sandbox cannot): its config (entrypoint, user, volume, port), its files
# (the binary, its libraries, the user; no shell), and, as root, that the
# binary runs from the image's own root file system (chroot), which proves
# the libraries it needs are all there.
#
#   deploy/image/check.sh OUT_DIR/gangway-image.tar
set -euo pipefail
archive=${1:?usage: check.sh IMAGE_ARCHIVE}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "image check: $*" >&2; exit 1; }

tar -xf "$archive" -C "$work"
blob() { echo "$work/blobs/${1/://}"; }
manifest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$work/index.json")
read -r config layers < <(python3 -c '
import json, sys
m = json.load(open(sys.argv[1]))
print(m["config"]["digest"], " ".join(l["digest"] for l in m["layers"]))' "$(blob "$manifest")")
python3 - "$(blob "$config")" <<'PY' || exit 1
import json, sys
c = json.load(open(sys.argv[1]))["config"]
want = {"Entrypoint": ["/usr/bin/gangway"], "User": "10001:10001", "WorkingDir": "/var/lib/gangway"}
for k, v in want.items():
    if c.get(k) != v:
        sys.exit(f"image check: config {k} is {c.get(k)!r}, expected {v!r}")
if "/var/lib/gangway" not in c.get("Volumes", {}):
    sys.exit("image check: /var/lib/gangway is not a volume")
if "50051/tcp" not in c.get("ExposedPorts", {}):
    sys.exit("image check: port 50051 is not exposed")
PY
root="$work/rootfs"
mkdir -p "$root"
for l in $layers; do tar -xf "$(blob "$l")" -C "$root"; done
[ -x "$root/usr/bin/gangway" ] || fail "no /usr/bin/gangway"
# The unprivileged user must reach the binary and its libraries: every
# directory in the layers is readable and searchable by all.
for l in $layers; do
    python3 - "$(blob "$l")" <<'PY' || exit 1
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    for m in t.getmembers():
        if m.isdir() and m.mode & 0o005 != 0o005:
            sys.exit(f"image check: /{m.name} is not readable by every user (mode {m.mode:o})")
        if m.name.lstrip("./") in ("usr/bin/gangway",) and m.mode & 0o005 != 0o005:
            sys.exit("image check: the binary is not executable by every user")
PY
done
grep -q '^gangway:x:10001:10001:' "$root/etc/passwd" || fail "no gangway user (uid 10001) in /etc/passwd"
[ "$(stat -c %u "$root/var/lib/gangway")" = 10001 ] || fail "/var/lib/gangway is not the gangway user's"
for sh in bin/sh bin/bash usr/bin/sh; do [ ! -e "$root/$sh" ] || fail "the image has a shell ($sh)"; done
if [ "$(id -u)" -eq 0 ]; then
    version=$(chroot "$root" /usr/bin/gangway --version) || fail "the binary does not run from the image's root file system"
    echo "image check: ok ($version runs from the image; $(du -sh "$root" | cut -f1) unpacked)"
elif [ -n "${GANGWAY_TESTS_WITHOUT_ROOT:-}" ]; then
    echo "image check: the chroot run was skipped (not root, GANGWAY_TESTS_WITHOUT_ROOT): the binary's run from the image is unchecked" >&2
else
    fail "the chroot run needs root (CI runs as root); set GANGWAY_TESTS_WITHOUT_ROOT=1 to leave it out knowingly"
fi
