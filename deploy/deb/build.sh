#!/usr/bin/env bash
# Builds Gangway's Debian package with dpkg-deb from a built binary: the
# binary (controller, agent and CLI in one), Slurm's command names as links
# to it, hardened systemd units for a controller and an agent, their option
# files in /etc/default, the example policy and the operator's guide. The
# package starts nothing: a host is configured first (its id, peers and
# certificates), then its unit is enabled.
#
#   deploy/deb/build.sh BINARY OUT_DIR
#
# Writes OUT_DIR/gangway_VERSION_ARCH.deb and prints its path.
set -euo pipefail
umask 022
bin=${1:?usage: build.sh BINARY OUT_DIR}
out=${2:?usage: build.sh BINARY OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
deploy=$(dirname "$here")
repo=$(dirname "$deploy")
command -v dpkg-deb >/dev/null || { echo "deb: dpkg-deb is missing (apt-get install dpkg-dev)" >&2; exit 1; }
[ -x "$bin" ] || { echo "deb: $bin is not an executable" >&2; exit 1; }
version=$("$bin" --version | awk '{print $2}')
arch=$(dpkg --print-architecture)
root=$(mktemp -d)
trap 'rm -rf "$root" "$root.shlibs"' EXIT
chmod 0755 "$root"

install -D -m 0755 "$bin" "$root/usr/bin/gangway"
strip --strip-debug "$root/usr/bin/gangway"
# The Slurm commands: the binary answers as the name it is run by.
for tool in sbatch srun salloc squeue scancel sinfo scontrol sacct sreport seff; do
    ln -s gangway "$root/usr/bin/$tool"
done
install -D -m 0644 "$deploy/systemd/gangway-controller.service" "$root/lib/systemd/system/gangway-controller.service"
install -D -m 0644 "$deploy/systemd/gangway-agent.service" "$root/lib/systemd/system/gangway-agent.service"
install -D -m 0644 "$here/default/gangway-controller" "$root/etc/default/gangway-controller"
install -D -m 0644 "$here/default/gangway-agent" "$root/etc/default/gangway-agent"
install -D -m 0644 "$deploy/policy.example.toml" "$root/usr/share/doc/gangway/examples/policy.toml"
install -D -m 0644 "$deploy/prometheus.example.yml" "$root/usr/share/doc/gangway/examples/prometheus.yml"
install -D -m 0644 "$repo/docs/operations.md" "$root/usr/share/doc/gangway/operations.md"
install -D -m 0644 "$repo/docs/security.md" "$root/usr/share/doc/gangway/security.md"
install -d -m 0755 "$root/DEBIAN"
# The C libraries the binary links, with the oldest versions that have every
# symbol it uses (dpkg-shlibdeps reads them from this host's packages): a
# package built on a newer system refuses to install where it cannot run.
command -v dpkg-shlibdeps >/dev/null || { echo "deb: dpkg-shlibdeps is missing (apt-get install dpkg-dev)" >&2; exit 1; }
mkdir -p "$root.shlibs/debian"
printf 'Source: gangway\n\nPackage: gangway\nArchitecture: any\n' >"$root.shlibs/debian/control"
libs=$(cd "$root.shlibs" && dpkg-shlibdeps -O "$root/usr/bin/gangway" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
rm -rf "$root.shlibs"
[ -n "$libs" ] || { echo "deb: dpkg-shlibdeps found no libraries for the binary" >&2; exit 1; }
cat >"$root/DEBIAN/conffiles" <<CONF
/etc/default/gangway-controller
/etc/default/gangway-agent
CONF
# Depends: the C libraries (libc, and libstdc++ and libgcc for RocksDB's
# C++); adduser makes the controller's user.
cat >"$root/DEBIAN/control" <<CTL
Package: gangway
Version: $version
Architecture: $arch
Maintainer: Gangway developers <gangway@localhost>
Section: admin
Priority: optional
Depends: $libs, adduser
Conflicts: slurm-client, slurm-wlm
Installed-Size: $(du -sk "$root" | cut -f1)
Description: workload manager for GPU and HPC clusters, without a single point of failure
 Gangway runs Slurm-style batch jobs on GPU clusters. Three or five controller
 replicas replicate the job and node state through Raft; node agents launch
 jobs and report GPU health. One binary is the controller
 (gangway-controller.service), the node agent (gangway-agent.service), the
 gangway command and Slurm's commands (sbatch, srun, squeue, ...).
CTL
install -m 0755 "$here/postinst" "$root/DEBIAN/postinst"
install -m 0755 "$here/prerm" "$root/DEBIAN/prerm"
install -m 0755 "$here/postrm" "$root/DEBIAN/postrm"
mkdir -p "$out"
deb="$out/gangway_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "$deb"
