#!/usr/bin/env bash
# Builds the CPU image from the Dockerfile without Docker: buildah (chroot isolation,
# vfs storage) on a Debian bookworm base made by debootstrap. `make image` runs it.
#
#   1. apt-get installs buildah and debootstrap if they are missing;
#   2. the base: `debootstrap --variant=minbase` of bookworm with Debian's python3 (3.11,
#      like the official python:3.11-slim-bookworm), cached as a tarball in $CACHE keyed
#      by the bookworm point release, the mirror and the package list, and imported
#      into buildah's storage as localhost/shardwise-base:<key>;
#   3. `buildah bud` with BASE set to that image. Every RUN step sees this machine's pip
#      configuration read-only: one pip.conf merged from `pip config list` (the files
#      and the PIP_* variables) at /etc/pip.conf, and every local path it names (wheel
#      folders, file:// indexes, constraint files, the CA bundle) at the same path.
#      CPU_INDEX and PIP_INDEX_URL are this machine's index (PyPI unless pip is
#      configured otherwise): the CPU torch wheel (torch==2.13.0+cpu) must come from
#      there or from the configured wheel folders and extra indexes. The log goes to
#      out/image/build.log;
#   4. the empty mount points buildah 1.28 leaves in the final image go, in one layer.
#
# Needs root (debootstrap, buildah). Prints the build time and the image's size.
# Environment: IMAGE (default localhost/shardwise:cpu), SHARDWISE_CACHE (default
# ~/.cache/shardwise), DEBIAN_MIRROR (default: the one apt uses, else deb.debian.org),
# CPU_INDEX, PIP_INDEX_URL (override the machine's index for the build), PYTHON (the
# python whose pip configuration is used, default python3).
# Inspect the result with `buildah --storage-driver vfs images`; scripts/image-smoke.sh
# tests it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-localhost/shardwise:cpu}"
CACHE="${SHARDWISE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardwise}"
PYTHON="${PYTHON:-python3}"
SUITE=bookworm
# python-is-python3: the Dockerfile runs `python`, as the official image has it.
# ca-certificates and netbase: what the official slim image carries besides Python.
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates,netbase
# Bump when the way the base is made changes (the cleanup below), to rebuild the cache.
BASE_RECIPE=1
BUILDAH=(buildah --storage-driver vfs)
ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"

say() { echo "build-image: $*"; }
die() {
    echo "build-image: $*" >&2
    exit 1
}

start=$SECONDS
[[ "$(id -u)" == 0 ]] || die "needs root (debootstrap and buildah): run it as root or with sudo"

# 1. buildah and debootstrap, from apt like scripts/install-tools.sh installs prometheus.
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
# (the key debootstrap checks bookworm's Release with; Debian has it, derivatives may not)
[[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || missing+=(debian-archive-keyring)
if ((${#missing[@]})); then
    command -v apt-get >/dev/null ||
        die "no apt-get here: install ${missing[*]} (buildah 1.28 or later) and run again"
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        apt-get update -qq
    fi
    say "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
fi
say "$(buildah --version)"

# 2. The base image.
if [[ -z "${DEBIAN_MIRROR:-}" ]]; then
    DEBIAN_MIRROR="$(
        grep -rhoE '^(URIs:|deb)([[:space:]]+\[[^]]*\])?[[:space:]]+https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
            /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
            grep -oE 'https?://[^[:space:]]+' | head -1 || true
    )"
    DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
fi
DEBIAN_MIRROR="${DEBIAN_MIRROR%/}"
# The suite's point release (e.g. 12.15): the packages debootstrap installs change only
# with it, so it keys the cache.
release="$(
    "$PYTHON" - "$DEBIAN_MIRROR/dists/$SUITE/Release" <<'EOF'
import sys
import urllib.request

with urllib.request.urlopen(sys.argv[1], timeout=60) as response:
    text = response.read(65536).decode()
fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
print(fields["Version"])
EOF
)" || die "cannot read $DEBIAN_MIRROR/dists/$SUITE/Release (set DEBIAN_MIRROR)"
recipe="$SUITE $release $ARCH $DEBIAN_MIRROR $PACKAGES $BASE_RECIPE"
key="$SUITE-$release-$(sha256sum <<<"$recipe" | cut -c1-12)"
BASE="localhost/shardwise-base:$key"
tarball="$CACHE/base/$key.tar"

if "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
    say "base $BASE already in buildah's storage"
else
    if [[ -f "$tarball" ]]; then
        say "base from the cache: $tarball"
    else
        mkdir -p "$CACHE/base"
        work="$(mktemp -d "$CACHE/base/.debootstrap.XXXXXX")"
        trap 'rm -rf "$work"' EXIT
        say "debootstrap $SUITE ($release, $ARCH) from $DEBIAN_MIRROR with $PACKAGES"
        t0=$SECONDS
        if ! nice debootstrap --variant=minbase --arch="$ARCH" --include="$PACKAGES" \
            "$SUITE" "$work/root" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1; then
            tail -20 "$work/debootstrap.log" >&2
            die "debootstrap failed (the log's end is above)"
        fi
        # What a container base does not carry: apt's package cache and lists, manuals,
        # documentation other than the copyright files, the host's resolver and id.
        rm -rf "$work"/root/var/cache/apt/archives/*.deb "$work"/root/var/cache/apt/*.bin \
            "$work"/root/var/lib/apt/lists/* "$work"/root/usr/share/man \
            "$work"/root/usr/share/info "$work"/root/var/log/*.log \
            "$work"/root/var/log/apt/* "$work"/root/debootstrap
        find "$work/root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
        find "$work/root/usr/share/doc" -mindepth 1 -type d -empty -delete
        : >"$work/root/etc/resolv.conf"
        : >"$work/root/etc/machine-id"
        echo localhost >"$work/root/etc/hostname"
        tar --numeric-owner --sort=name --exclude='./dev/*' --exclude='./proc/*' \
            --exclude='./sys/*' -C "$work/root" -cf "$work/base.tar" .
        rm -f "$CACHE"/base/"$SUITE"-*.tar # older point releases or recipes
        mv "$work/base.tar" "$tarball"
        rm -rf "$work"
        trap - EXIT
        say "debootstrap took $((SECONDS - t0)) s; cached $tarball ($(du -h "$tarball" | cut -f1))"
    fi
    ctr="$("${BUILDAH[@]}" from scratch)"
    "${BUILDAH[@]}" add "$ctr" "$tarball" / >/dev/null
    "${BUILDAH[@]}" config --os linux --arch "$ARCH" \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /bin/bash \
        --label "dev.shardwise.base=debootstrap $SUITE $release $PACKAGES" "$ctr"
    "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
    say "base $BASE imported"
    # Bases of older point releases or recipes.
    "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}}' |
        grep '^localhost/shardwise-base:' | grep -vxF "$BASE" |
        xargs -r "${BUILDAH[@]}" rmi >/dev/null || true
fi

# 3. The build, with this machine's pip configuration.
pipconf="$(mktemp /tmp/shardwise-pip.XXXXXX.conf)"
trap 'rm -f "$pipconf"' EXIT
mapfile -t pipinfo < <(
    "$PYTHON" - "$pipconf" <<'EOF'
"""Merge `pip config list` into one [global] section (the PIP_* variables win, as in
pip); print the index, then every local path the configuration names."""
import os
import subprocess
import sys
from urllib.parse import urlparse

out = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"],
    capture_output=True, text=True, check=True,
).stdout
files: dict[str, str] = {}
env: dict[str, str] = {}
for line in out.splitlines():
    name, _, value = line.partition("=")
    section, _, key = name.rpartition(".")
    value = value.strip().strip("'\"")
    if section == ":env:":
        env[key] = value
    elif section in ("global", "install", "download", "wheel"):
        files.setdefault(key, value)
merged = {**files, **env}
# Pip's own defaults are fine inside the image; these never matter to it.
for key in ("index-url", "user", "target", "prefix", "root", "cache-dir", "no-cache-dir",
            "require-virtualenv", "break-system-packages"):
    merged.pop(key, None)
index = {**files, **env}.get("index-url", "https://pypi.org/simple")
with open(sys.argv[1], "w") as f:
    f.write("[global]\n")
    for key, value in sorted(merged.items()):
        f.write(f"{key} = {value}\n")
print(index)
paths: set[str] = set()
for key in ("cert", "client-cert", "constraint", "requirement", "find-links",
            "extra-index-url"):
    for item in merged.get(key, "").split():
        url = urlparse(item)
        if url.scheme not in ("", "file"):
            continue
        path = os.path.realpath(url.path if url.scheme else item)
        # A file:// simple index links its files beside it (PEP 503 trees).
        if key == "extra-index-url" and os.path.basename(path) == "simple":
            path = os.path.dirname(path)
        if os.path.exists(path):
            paths.add(path)
for path in sorted(paths):
    print(path)
EOF
)
((${#pipinfo[@]})) || die "could not read pip's configuration with $PYTHON -m pip"
index="${pipinfo[0]}"
volumes=(--volume "$pipconf:/etc/pip.conf:ro")
for path in "${pipinfo[@]:1}"; do
    volumes+=(--volume "$path:$path:ro")
done
say "pip inside the build: index ${PIP_INDEX_URL:-$index}; mounted: ${pipinfo[*]:1}"

log="$ROOT/out/image/build.log"
mkdir -p "$(dirname "$log")"
say "buildah bud -t $IMAGE (CPU variant; log: ${log#"$ROOT"/})"
t0=$SECONDS
if ! nice "${BUILDAH[@]}" bud --isolation chroot --pull=never \
    --build-arg "BASE=$BASE" \
    --build-arg "CPU_INDEX=${CPU_INDEX:-$index}" \
    --build-arg "PIP_INDEX_URL=${PIP_INDEX_URL:-$index}" \
    "${volumes[@]}" -f "$ROOT/Dockerfile" -t "$IMAGE" "$ROOT" >"$log" 2>&1; then
    tail -30 "$log" >&2
    die "buildah bud failed after $((SECONDS - t0)) s (the log's end is above)"
fi
build_s=$((SECONDS - t0))

# buildah 1.28 leaves the mount points of --volume behind in every stage that has a RUN
# step: empty files and folders (/etc/pip.conf, /opt/wheels, ...). Those the base does
# not have come out of the final image in one more layer, after a check that they are
# empty.
t0=$SECONDS
base_ctr="$("${BUILDAH[@]}" from --pull=never "$BASE")"
ctr="$("${BUILDAH[@]}" from --pull=never "$IMAGE")"
base_root="$("${BUILDAH[@]}" mount "$base_ctr")"
root="$("${BUILDAH[@]}" mount "$ctr")"
strays=()
for path in /etc/pip.conf "${pipinfo[@]:1}"; do
    top=""
    while [[ "$path" != / && ! -e "$base_root$path" && ! -L "$base_root$path" ]]; do
        top="$path"
        path="$(dirname "$path")"
    done
    if [[ -n "$top" && -e "$root$top" ]] && ! printf '%s\n' "${strays[@]}" | grep -qxF "$top"; then
        if [[ -n "$(find "$root$top" ! -type d ! -empty -print -quit)" ]]; then
            die "$top in the image is not an empty mount point left by the build"
        fi
        strays+=("$top")
        rm -rf "${root:?}$top"
    fi
done
"${BUILDAH[@]}" umount "$base_ctr" "$ctr" >/dev/null
"${BUILDAH[@]}" rm "$base_ctr" >/dev/null
if ((${#strays[@]})); then
    "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
    say "removed the build's mount points ${strays[*]} ($((SECONDS - t0)) s)"
else
    "${BUILDAH[@]}" rm "$ctr" >/dev/null
fi
# The image this tag pointed at before, and the build stage, are left dangling.
"${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true

size="$("${BUILDAH[@]}" images --format '{{.Size}}' "$IMAGE" | head -1)"
say "built $IMAGE: $size (uncompressed); buildah bud ${build_s} s, all of it $((SECONDS - start)) s"
