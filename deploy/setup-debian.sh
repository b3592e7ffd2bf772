#!/usr/bin/env bash
# Installs what building Gangway needs on a fresh Debian/Ubuntu machine:
# a C/C++ toolchain and libclang (RocksDB's bindings are generated with bindgen
# and its C++ is compiled from source), iproute2 and iptables for the chaos
# tests, Prometheus for the metrics tests, tmux for the interactive ones,
# buildah for the OCI image, Chromium for the console's browser tests.
# protoc comes from a vendored crate.
# Safe to run again: it only installs what is missing.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v clang >/dev/null 2>&1 || need+=(clang)
if ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 && ! ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1; then
  need+=(libclang-dev)
fi
command -v make >/dev/null 2>&1 || need+=(make)
# The chaos tests build test hosts from network namespaces and iptables.
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
# The metrics tests check the exposition with promtool and scrape it with a real Prometheus.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# The interactive-step tests type into `srun --pty` through a real terminal.
command -v tmux >/dev/null 2>&1 || need+=(tmux)
# The image is built with buildah from scratch and checked with Python.
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v python3 >/dev/null 2>&1 || need+=(python3)
# The Kubernetes check installs its Python tools into a virtualenv of its own.
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# The accounting tests run a private PostgreSQL server from Debian's binaries.
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
# The package check rates its systemd units offline.
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
# The web console's tests drive a real, headless browser.
command -v chromium >/dev/null 2>&1 || need+=(chromium)

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo is missing. Install Rust (rustup) first; rust-toolchain.toml pins the version." >&2
  exit 1
fi

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${need[*]}" >&2
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "setup: need root to install ${need[*]} (apt-get install -y ${need[*]})" >&2
    exit 1
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
