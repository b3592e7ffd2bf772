#!/usr/bin/env bash
# Builds Gangway's OCI image with buildah, from scratch: the `gangway` binary
# (controller, agent and CLI in one), the shared libraries it links and their
# loader, an unprivileged `gangway` user (uid 10001) and nothing else: no
# shell, no package manager. No registry is needed or contacted.
#
#   deploy/image/build.sh BINARY OUT_DIR [TAG]
#
# Writes OUT_DIR/gangway-image.tar (an OCI archive: `podman load -i`, `skopeo
# copy oci-archive:...`, or `ctr images import`) and tags the image TAG
# (default localhost/gangway:dev) in buildah's local storage.
set -euo pipefail
# Files readable by every user of the image, whatever the caller's umask.
umask 022
bin=${1:?usage: build.sh BINARY OUT_DIR [TAG]}
out=${2:?usage: build.sh BINARY OUT_DIR [TAG]}
tag=${3:-localhost/gangway:dev}
# The unprivileged user the controller runs as; the agent's pod runs as root
# (it starts jobs as their users), so the image's default is the controller's.
uid=10001

command -v buildah >/dev/null || { echo "image: buildah is missing (apt-get install buildah)" >&2; exit 1; }
[ -x "$bin" ] || { echo "image: $bin is not an executable" >&2; exit 1; }
mkdir -p "$out"
root=$(mktemp -d)
chmod 0755 "$root"
trap 'rm -rf "$root"; [ -n "${ctr:-}" ] && buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT

# The root file system: the binary, every library `ldd` names (with its
# directory), /etc/passwd and /etc/group for the user, a writable /var/lib.
install -D -m 0755 "$bin" "$root/usr/bin/gangway"
# Debug information stays with the build, not in every pull.
strip --strip-debug "$root/usr/bin/gangway"
ldd "$bin" | grep -o '/[^ ]*' | sort -u | while read -r lib; do
    install -D -m 0755 "$lib" "$root$lib"
done
mkdir -p "$root/etc" "$root/var/lib/gangway" "$root/tmp"
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\ngangway:x:%d:%d:gangway:/var/lib/gangway:/usr/sbin/nologin\n' "$uid" "$uid" >"$root/etc/passwd"
printf 'root:x:0:\ngangway:x:%d:\n' "$uid" >"$root/etc/group"
chown -R "$uid:$uid" "$root/var/lib/gangway"

ctr=$(buildah from scratch)
# Added as one archive: it keeps the files' owners (a copy would make them root's).
tar -C "$root" -cf "$root.tar" .
buildah add --quiet "$ctr" "$root.tar" / >/dev/null
rm -f "$root.tar"
buildah config \
    --entrypoint '["/usr/bin/gangway"]' \
    --cmd '["--help"]' \
    --user "$uid:$uid" \
    --workingdir /var/lib/gangway \
    --volume /var/lib/gangway \
    --port 50051/tcp \
    --label org.opencontainers.image.title=gangway \
    --label "org.opencontainers.image.version=$("$bin" --version | awk '{print $2}')" \
    "$ctr"
buildah commit --quiet --format oci "$ctr" "$tag" >/dev/null
rm -f "$out/gangway-image.tar"
buildah push --quiet "$tag" "oci-archive:$out/gangway-image.tar:$tag" >/dev/null
echo "image: $tag, $(du -h "$out/gangway-image.tar" | cut -f1) in $out/gangway-image.tar"
