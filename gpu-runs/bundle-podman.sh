#!/usr/bin/env bash
# Make podman.tar.xz: podman, conmon and runc from Debian 12, with the shared
# libraries they need beyond the C library, and the configuration to run them
# from a folder (gpu-runs/gpu-host-podman.sh unpacks and uses it). For a GPU host
# without Docker and without a network: Ubuntu 24.04's glibc 2.39 runs Debian 12
# binaries (built against 2.36). Run it on a Debian 12 machine that reaches
# Debian's archive:
#
#   bash gpu-runs/bundle-podman.sh DIR
#
# DIR receives podman.tar.xz, laid out as:
#   bin/podman       a wrapper: the bundle's libraries and configuration, state under $PODMAN_HOME
#   libexec/         podman, conmon, runc themselves
#   lib/             their shared libraries, except the C library's own
#   etc/             containers.conf, storage.conf (overlay), registries.conf, policy.json
# Nothing here needs a network on the GPU host: images come from `docker save`
# archives or a local registry (`podman load`, `podman pull --tls-verify=false`).
set -euo pipefail
dest=${1:?usage: bundle-podman.sh DIR}
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/debs" "$tmp/root" \
  "$tmp/pkg/bin" "$tmp/pkg/libexec" "$tmp/pkg/lib" "$tmp/pkg/etc"
# A private apt state: the packages are downloaded and unpacked, never installed here.
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
for suite in bookworm bookworm-updates; do
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main"
done >"$tmp/sources.list"
: >"$tmp/status"  # what this machine has installed must not pick the versions
apt_opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "Dir::State::status=$tmp/status"
          -o Debug::NoLocking=1)
apt-get "${apt_opts[@]}" update -q 2>&1 | grep -v "unsandboxed" >&2 || true
# The binaries and every library package they link against (glibc's own left to the host).
pkgs=(podman conmon runc libgpgme11 libassuan0 libgpg-error0 libseccomp2 libsubid4 libdevmapper1.02.1
      libselinux1 libsemanage2 libsepol2 libpcre2-8-0 libaudit1 libcap-ng0 libcap2 libbz2-1.0 libsystemd0
      liblz4-1 liblzma5 libzstd1 libgcrypt20 libudev1 libglib2.0-0 libpam0g libcrypt1)
(cd "$tmp/debs" && apt-get "${apt_opts[@]}" download "${pkgs[@]}" >/dev/null)
for deb in "$tmp"/debs/*.deb; do dpkg -x "$deb" "$tmp/root"; done
install -m 0755 "$tmp/root/usr/bin/podman" "$tmp/root/usr/bin/conmon" "$tmp/root/usr/sbin/runc" "$tmp/pkg/libexec/"
# podman starts conmon (and conmon starts runc) with an environment of its own, without the wrapper's
# LD_LIBRARY_PATH: each is a small script that names the bundle's libraries, then runs the binary (.bin).
# Found on the GPU host (2026-12-03): conmon could not load libglib-2.0 there, podman said "write child: broken pipe".
for b in conmon runc; do
  mv "$tmp/pkg/libexec/$b" "$tmp/pkg/libexec/$b.bin"
  cat >"$tmp/pkg/libexec/$b" <<WRAP
#!/bin/sh
# $b with the bundle's libraries: podman does not pass its own environment on.
dir=\$(cd "\$(dirname "\$0")/.." && pwd)
LD_LIBRARY_PATH=\$dir/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec "\$dir/libexec/$b.bin" "\$@"
WRAP
  chmod 0755 "$tmp/pkg/libexec/$b"
done
# Every library the three binaries load, found in the unpacked packages (not on this machine).
for lib in $(LD_LIBRARY_PATH="$tmp/root/lib/x86_64-linux-gnu:$tmp/root/usr/lib/x86_64-linux-gnu" \
             ldd "$tmp"/pkg/libexec/*.bin "$tmp"/pkg/libexec/podman | awk '/=>/ {print $1}' | sort -u); do
  case "$lib" in libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|ld-linux*) continue ;; esac
  found=$(find "$tmp/root" -name "$lib" | head -1)
  [ -n "$found" ] || { echo "no $lib in the downloaded packages" >&2; exit 1; }
  cp -L "$found" "$tmp/pkg/lib/$lib"
done
cat >"$tmp/pkg/etc/storage.conf" <<'CONF'
[storage]
driver = "overlay"
# Replaced by the wrapper with folders under $PODMAN_HOME.
graphroot = "@HOME@/storage"
runroot = "@HOME@/run"
CONF
cat >"$tmp/pkg/etc/containers.conf" <<'CONF'
[containers]
# Only `--network none` is used: no network plugins are carried.
netns = "none"
# Empty: podman's own (the host's maximum). A host that runs nested may need less (PODMAN_ULIMITS).
default_ulimits = [@ULIMITS@]
[engine]
conmon_path = ["@DIR@/libexec/conmon"]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "@HOME@/tmp"
static_dir = "@HOME@/storage/libpod"
volume_path = "@HOME@/storage/volumes"
[engine.runtimes]
runc = ["@DIR@/libexec/runc"]
[network]
network_backend = "cni"
cni_plugin_dirs = ["@DIR@/libexec"]
network_config_dir = "@HOME@/cni"
CONF
printf 'unqualified-search-registries = []\n' >"$tmp/pkg/etc/registries.conf"
# Images reach this host as archives or from a registry the operator runs: no signatures to check.
printf '{"default": [{"type": "insecureAcceptAnything"}]}\n' >"$tmp/pkg/etc/policy.json"
cat >"$tmp/pkg/bin/podman" <<'WRAP'
#!/usr/bin/env bash
# podman from this folder: its own libraries and configuration, state under $PODMAN_HOME.
set -euo pipefail
dir=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
home=${PODMAN_HOME:-/var/lib/vllm-hotfix-podman}
etc=$home/etc
# e.g. PODMAN_ULIMITS='"nofile=1024:1024", "nproc=4096:4096"'
ulimits=${PODMAN_ULIMITS:-}
if [ ! -f "$etc/.from" ] || [ "$(cat "$etc/.from")" != "$dir $ulimits" ]; then
  mkdir -p "$etc" "$home/storage" "$home/run" "$home/tmp" "$home/cni"
  for f in containers.conf storage.conf registries.conf policy.json; do
    sed -e "s|@DIR@|$dir|g" -e "s|@HOME@|$home|g" -e "s|@ULIMITS@|$ulimits|g" "$dir/etc/$f" >"$etc/$f"
  done
  echo "$dir $ulimits" >"$etc/.from"
fi
export CONTAINERS_CONF=$etc/containers.conf CONTAINERS_STORAGE_CONF=$etc/storage.conf \
  CONTAINERS_REGISTRIES_CONF=$etc/registries.conf
# podman's own children (conmon, runc) find the libraries the same way.
export LD_LIBRARY_PATH=$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
case "${1:-}" in
  load|pull|push|save|import|build) exec "$dir/libexec/podman" "$1" --signature-policy "$etc/policy.json" "${@:2}" ;;
esac
exec "$dir/libexec/podman" "$@"
WRAP
chmod 0755 "$tmp/pkg/bin/podman"
tar -C "$tmp/pkg" -cf - . | xz -T0 -6 >"$dest/podman.tar.xz"
du -sh "$dest/podman.tar.xz" | sed 's/^/  /'
