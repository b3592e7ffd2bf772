#!/usr/bin/env bash
# Checks the Debian package (part of `make test`) without installing it on
# this host: its fields and files, that its dependencies name every library
# the binary links, that it unpacks into a throwaway dpkg root where the
# binary and its Slurm names run, that the hardened controller unit parses
# cleanly and rates 2.0 or less ("OK") in `systemd-analyze security`, and that
# every flag the units and option files pass exists in the binary's --help.
# (No systemd runs in this sandbox: the units are checked offline.)
#
#   deploy/deb/check.sh BINARY
set -euo pipefail
bin=$(realpath "${1:?usage: check.sh BINARY}")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "deb check: $*" >&2; exit 1; }

deb=$("$here/build.sh" "$bin" "$work/out")
field() { dpkg-deb -f "$deb" "$1"; }
[ "$(field Package)" = gangway ] || fail "Package is $(field Package)"
[ "$(field Version)" = "$("$bin" --version | awk '{print $2}')" ] || fail "Version $(field Version) is not the binary's"
depends=$(field Depends)

# Every library the binary links comes from a package the .deb depends on.
for lib in $(ldd "$bin" | grep -o '/[^ ]*' | sort -u); do
    pkg=$(dpkg -S "$(realpath "$lib")" 2>/dev/null | head -1 | cut -d: -f1) || true
    [ -z "$pkg" ] && pkg=$(dpkg -S "$lib" 2>/dev/null | head -1 | cut -d: -f1) || true
    [ -n "$pkg" ] || fail "no package owns $lib, which the binary links"
    case ", $depends," in *", $pkg,"* | *", $pkg ("*) ;; *) fail "the binary links $lib from $pkg, which Depends ($depends) does not name" ;; esac
done

# The files, their modes, the links.
contents=$(dpkg-deb -c "$deb")
for f in ./usr/bin/gangway ./lib/systemd/system/gangway-controller.service ./lib/systemd/system/gangway-agent.service \
    ./etc/default/gangway-controller ./etc/default/gangway-agent ./usr/share/doc/gangway/operations.md; do
    grep -q " $f\( \|$\)" <<<"$contents" || fail "$f is not in the package"
done
for tool in sbatch srun salloc squeue scancel sinfo scontrol sacct sreport seff; do
    grep -q " ./usr/bin/$tool -> gangway$" <<<"$contents" || fail "/usr/bin/$tool is not a link to gangway"
done
grep -q "^-rwxr-xr-x root/root .* ./usr/bin/gangway$" <<<"$contents" || fail "/usr/bin/gangway is not root's 0755"
if grep -v "^d" <<<"$contents" | grep -v " root/root " >/dev/null; then fail "a file not owned by root"; fi
dpkg-deb --ctrl-tarfile "$deb" | tar -x -C "$work" ./conffiles ./postinst ./prerm ./postrm
for f in /etc/default/gangway-controller /etc/default/gangway-agent; do
    grep -qx "$f" "$work/conffiles" || fail "$f is not a conffile"
done
for script in postinst prerm postrm; do
    sh -n "$work/$script" || fail "$script is not valid sh"
done
# Versioned library dependencies (a newer build system's package must not install on an older one).
grep -q "libc6 (>= " <<<"$depends" || fail "Depends names no minimum libc6 version: $depends"

# Unpacked by dpkg into a throwaway root: the binary runs there, and so do Slurm's names.
root="$work/root"
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" "$root/var/lib/dpkg/triggers"
touch "$root/var/lib/dpkg/status"
dpkg --root="$root" --force-depends --force-not-root --unpack "$deb" >/dev/null 2>&1 || fail "dpkg could not unpack it"
"$root/usr/bin/gangway" --version >/dev/null || fail "the unpacked binary does not run"
"$root/usr/bin/squeue" --help | grep -q "^Usage: gangway squeue" || fail "squeue does not answer as squeue (argv[0] dispatch)"

# The units, offline: no unknown or malformed setting, and the controller's sandbox rated.
sec="$work/security"
systemd-analyze security --offline=yes --root="$root" --threshold=20 gangway-controller.service >"$sec" 2>"$sec.err" ||
    { cat "$sec" "$sec.err" >&2; fail "the controller's unit rates above 2.0 in systemd-analyze security"; }
systemd-analyze security --offline=yes --root="$root" gangway-agent.service >"$sec.agent" 2>>"$sec.err" || true
if grep -Ei "unknown|failed|invalid|ignoring" "$sec.err"; then fail "systemd did not take every setting of the units"; fi
echo "deb check: $(basename "$deb"): $(grep -o 'exposure level for gangway-controller.service: .*' "$sec"); agent (root, by design): $(grep -o 'exposure level for gangway-agent.service: .*' "$sec.agent" | cut -d: -f2)"

# Every flag the units and option files pass, against the binary's own --help.
python3 - "$bin" "$here" "$(dirname "$here")/systemd" <<'PY'
import re, shlex, subprocess, sys
bin, here, units = sys.argv[1:4]
fail = []
def flags_of(words, cmd):
    help_text = subprocess.run([bin, cmd, "--help"], capture_output=True, text=True).stdout
    for w in words:
        if w.startswith("--"):
            f = w.split("=")[0]
            if not re.search(r"\s" + re.escape(f) + r"[\s,=<]", help_text):
                fail.append(f"{cmd}: {f} is not a flag of `gangway {cmd}`")
for name, cmd, var in [("gangway-controller", "controller", "GANGWAY_CONTROLLER_OPTS"), ("gangway-agent", "agent", "GANGWAY_AGENT_OPTS")]:
    opts = open(f"{here}/default/{name}").read()
    m = re.search(var + r'="([^"]*)"', opts)
    if not m:
        fail.append(f"/etc/default/{name} sets no {var}")
        continue
    flags_of(shlex.split(m.group(1)), cmd)
    unit = open(f"{units}/{name}.service").read()
    start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    words = shlex.split(start.replace("$" + var, ""))
    flags_of(words[words.index(cmd) + 1:], cmd)
    # Metrics name the jobs on each GPU: plaintext only on loopback.
    args = shlex.split(m.group(1))
    for i, w in enumerate(args):
        if w.split("=")[0] == "--metrics-listen":
            addr = w.split("=", 1)[1] if "=" in w else args[i + 1]
            host = addr.rsplit(":", 1)[0]
            loopback = host in ("[::1]", "localhost") or re.fullmatch(r"127(\.\d{1,3}){3}", host)
            if not loopback and "--metrics-tls" not in args:
                fail.append(f"/etc/default/{name}: metrics on {addr} in plaintext (loopback, or --metrics-tls)")
if fail:
    print("\n".join(fail), file=sys.stderr)
    sys.exit(1)
PY
