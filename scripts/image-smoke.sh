#!/usr/bin/env bash
# Smoke test of the image scripts/build-image.sh built (`make image` runs both), without
# a container engine: the image's root filesystem (a buildah working container) runs
# each command in fresh mount, PID, UTS, IPC and network namespaces, chrooted, as the
# image's USER (10001:10001, no supplementary groups, no capabilities, no_new_privs),
# with the image's ENV, WORKDIR and ENTRYPOINT, a /dev, /proc, a read-only /sys, only
# loopback networking, and volumes where the pods have them:
#
#   read-only root filesystem with /tmp writable (the operator Deployment's
#   securityContext and its /tmp emptyDir):
#     - the image's default command (ENTRYPOINT + CMD: `shardwise --help`);
#     - `shardwise operator --help`;
#     - who runs and what it can write: uid/gid 10001, /app, /opt/shardwise, $HOME and
#       / refuse writes, /tmp takes them; torch is the CPU build 2.13.0+cpu, FBGEMM's
#       CPU kernels and TorchRec import; no pip configuration of the build is left;
#     - `shardwise tables generate` (10 tables) and `shardwise plan` (NeuroShard, the
#       bundled cost model) for 2 ranks, into /tmp;
#   read-only root filesystem and no writable /tmp (the chart's `helm test` pod):
#     - its Python imports (kubernetes client);
#   writable root filesystem (worker pods), the plan mounted read-only at
#   /etc/shardwise as the operator mounts its ConfigMap, a checkpoint volume:
#     - a 2-rank CPU training run through the worker launcher
#       (`python -m shardwise.runtime.launch --standalone --nproc_per_node=2
#       -m shardwise.runtime.train`, the operator's default entry; 3 steps, gloo)
#       with SHARDWISE_PLAN and SHARDWISE_PLAN_HASH injected: it must exit 0, write
#       its summary and its final checkpoint.
#
# Not checked here: a Kubernetes API (the operator only prints its help), cgroup
# limits, seccomp, the GPU variant.
#
# Needs root. Environment: IMAGE (default localhost/shardwise:cpu). Prints each
# check's time.
set -euo pipefail

IMAGE="${IMAGE:-localhost/shardwise:cpu}"
BUILDAH=(buildah --storage-driver vfs)
HOSTNAME_IN=shardwise-smoke
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

say() { echo "image-smoke: $*"; }
die() {
    echo "image-smoke: FAILED: $*" >&2
    exit 1
}

# The last step into the container: chroot, the image's WORKDIR, USER and ENV, exec.
DROP_TO_USER='
import ctypes
import os
import sys

root, user, workdir, envfile, *argv = sys.argv[1:]
env = dict(line.split("=", 1) for line in open(envfile).read().splitlines() if "=" in line)
uid, gid = (int(x) for x in user.split(":"))
os.chroot(root)
os.chdir(workdir)
os.setgroups([])
os.setgid(gid)
os.setuid(uid)  # drops every capability (not root, no keep-caps)
PR_SET_NO_NEW_PRIVS = 38
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    sys.exit("image-smoke: prctl(PR_SET_NO_NEW_PRIVS) failed")
os.execvpe(argv[0], argv, env)
'

# ----------------------------------------------------------------------------- inside
# `image-smoke.sh --inside ROOT MODE USER WORKDIR ENVFILE BINDS -- CMD…` runs in the new
# namespaces (see run_in_image): it builds the container's mounts, then drops to USER.
if [[ "${1:-}" == --inside ]]; then
    root="$2" mode="$3" user="$4" workdir="$5" envfile="$6" binds="$7"
    shift 8
    mount --make-rprivate /
    hostname "$HOSTNAME_IN"
    ip link set lo up
    mount --bind "$root" "$root"
    mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
    mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
    mount -t tmpfs -o nosuid,noexec,mode=755 tmpfs "$root/dev"
    for node in null zero full random urandom tty; do
        touch "$root/dev/$node"
        mount --bind "/dev/$node" "$root/dev/$node"
    done
    mkdir "$root/dev/shm" "$root/dev/pts"
    mount -t tmpfs -o nosuid,nodev,mode=1777,size=64m tmpfs "$root/dev/shm"
    ln -s /proc/self/fd "$root/dev/fd"
    for i in 0 1 2; do ln -s "/proc/self/fd/$i" "$root/dev/$(sed -n "$((i + 1))p" <<<$'stdin\nstdout\nstderr')"; done
    # host:container[:ro] pairs, as a pod's volumeMounts (the kubelet's /etc/hosts too).
    IFS=, read -r -a pairs <<<"$binds"
    for pair in "${pairs[@]}"; do
        IFS=: read -r src dst opt <<<"$pair"
        [[ -e "$root$dst" ]] || { [[ -d "$src" ]] && mkdir -p "$root$dst"; } || touch "$root$dst"
        mount --bind "$src" "$root$dst"
        [[ "$opt" != ro ]] || mount -o remount,bind,ro "$root$dst"
    done
    [[ "$mode" != ro ]] || mount -o remount,bind,ro "$root"
    # (python3 -c, not a here-document: the command keeps this script's stdin)
    exec python3 -c "$DROP_TO_USER" "$root" "$user" "$workdir" "$envfile" "$@"
fi

# ----------------------------------------------------------------------------- outside
[[ "$(id -u)" == 0 ]] || die "needs root (buildah, mount namespaces): run it as root or with sudo"
for tool in buildah:buildah unshare:util-linux ip:iproute2 python3:python3; do
    command -v "${tool%%:*}" >/dev/null ||
        die "${tool%%:*} is not installed (Debian package ${tool#*:}; \`make image\` installs buildah)"
done
"${BUILDAH[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1 ||
    die "no image $IMAGE in buildah's storage: build it with \`make image\`"
start=$SECONDS
work="$(mktemp -d /tmp/shardwise-smoke.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# The image's configuration: config/{user,workdir,entrypoint,cmd,env} (one value a line).
mkdir -p "$work/config"
"${BUILDAH[@]}" inspect --type image "$IMAGE" | python3 -c '
import json, pathlib, sys
config = json.load(sys.stdin)["OCIv1"]["config"]
out = pathlib.Path(sys.argv[1])
for key in ("User", "WorkingDir", "Entrypoint", "Cmd", "Env"):
    value = config.get(key)
    lines = value if isinstance(value, list) else [value] if value else []
    (out / key.lower()).write_text("".join(f"{line}\n" for line in lines))
' "$work/config"
user="$(<"$work/config/user")"
workdir="$(<"$work/config/workingdir")"
mapfile -t entrypoint <"$work/config/entrypoint"
mapfile -t cmd <"$work/config/cmd"
[[ "$user" == 10001:10001 ]] || die "the image's USER is '$user', the chart runs 10001:10001"
[[ "${entrypoint[*]}" == shardwise ]] || die "ENTRYPOINT is '${entrypoint[*]}', not shardwise"
[[ "$workdir" == /app ]] || die "WORKDIR is '$workdir', not /app"
say "config: USER $user, WORKDIR $workdir, ENTRYPOINT ${entrypoint[*]}, CMD ${cmd[*]}"

ctr=""
cleanup() {
    if [[ -n "$ctr" ]]; then
        "${BUILDAH[@]}" umount "$ctr" >/dev/null 2>&1 || true
        "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
t0=$SECONDS
ctr="$("${BUILDAH[@]}" from --pull=never "$IMAGE")"
root="$("${BUILDAH[@]}" mount "$ctr")"
say "working container from $IMAGE in $((SECONDS - t0)) s"

# /tmp (an emptyDir: kept between the commands, so the plan made in one is trained
# with in the next), the plan ConfigMap's folder, a checkpoint volume, /etc/hosts.
mkdir -p "$work"/{tmp,plan,ckpt}
chown 10001:10001 "$work/tmp" "$work/ckpt"
chmod 1777 "$work/tmp"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t%s\n' "$HOSTNAME_IN" >"$work/hosts"
cp "$work/config/env" "$work/env"
echo "HOSTNAME=$HOSTNAME_IN" >>"$work/env"

# run_in_image NAME MODE BINDS [VAR=VALUE…] -- CMD…: MODE ro or rw root filesystem; the
# output goes to $work/NAME.log (shown when the command fails).
run_in_image() {
    local name="$1" mode="$2" binds="$3"
    shift 3
    local envfile="$work/$name.env"
    cp "$work/env" "$envfile"
    while [[ "$1" != -- ]]; do
        echo "$1" >>"$envfile"
        shift
    done
    shift
    local t0=$SECONDS
    if ! nice unshare --mount --uts --ipc --net --pid --fork --kill-child -- \
        bash "$SELF" --inside "$root" "$mode" "$user" "$workdir" "$envfile" \
        "$work/hosts:/etc/hosts:ro${binds:+,$binds}" -- "$@" >"$work/$name.log" 2>&1; then
        tail -40 "$work/$name.log" >&2
        die "$name: \`$*\` failed ($mode root filesystem; its output's end is above)"
    fi
    say "ok  $name ($mode root, $((SECONDS - t0)) s)"
}
expect() { # expect NAME REGEX: NAME's output matches
    grep -qE "$2" "$work/$1.log" || {
        cat "$work/$1.log" >&2
        die "$1: no line matches /$2/ in its output (above)"
    }
}
TMP="$work/tmp:/tmp"

run_in_image default-command ro "$TMP" -- "${entrypoint[@]}" "${cmd[@]}"
expect default-command 'Usage: shardwise'
expect default-command '\boperator\b'
run_in_image operator-help ro "$TMP" -- shardwise operator --help
expect operator-help 'Usage: shardwise operator'

run_in_image identity ro "$TMP" -- python - <<'EOF'
import errno
import os
import sys

assert (os.getuid(), os.getgid(), os.getgroups()) == (10001, 10001, []), (
    os.getuid(), os.getgid(), os.getgroups())
assert open("/proc/self/status").read().count("CapEff:\t0000000000000000") == 1
# $HOME belongs to the user: only the read-only root filesystem refuses the write.
for path in (os.environ["HOME"], "/app", "/opt/shardwise/bin", "/"):
    try:
        open(os.path.join(path, ".smoke"), "w").close()
    except OSError as e:
        assert e.errno == errno.EROFS, (path, e)
    else:
        sys.exit(f"{path} is writable")
assert os.stat(os.environ["HOME"]).st_uid == 10001
open("/tmp/.smoke", "w").close()
for path in ("/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels"):
    assert not os.path.exists(path), f"{path}: left over from the build"

import fbgemm_gpu  # noqa: E402,F401
import torch  # noqa: E402
import torchrec  # noqa: E402,F401
import shardwise.runtime.trainer  # noqa: E402,F401

assert torch.__version__ == "2.13.0+cpu" and torch.version.cuda is None, torch.__version__
assert hasattr(torch.ops.fbgemm, "split_embedding_codegen_lookup_rowwise_adagrad_function_cpu")
print("identity ok:", sys.version.split()[0], torch.__version__, sys.executable)
EOF
run_in_image helm-test-imports ro "" PYTHONDONTWRITEBYTECODE=1 -- \
    python -c 'import json, os, sys, time; from kubernetes import client, config'

run_in_image tables ro "$TMP" -- shardwise tables generate --count 10 --seed 0 --out /tmp/tables.yaml
run_in_image plan ro "$TMP" -- shardwise plan /tmp/tables.yaml --gpus 2 --gpu-memory 2GiB \
    --target-device cpu --batch-per-rank 256 --out /tmp/plan.json
# NeuroShard's plan, unless refinement timed a runner-up's plan faster on this machine
# and said so: then the plan written is that runner-up's (a decision under load).
made="$(python3 - "$work/tmp/plan.json" "$work/plan.log" 2>&1 <<'EOF'
import json, re, sys
planner = json.load(open(sys.argv[1]))["planner"]
said = " ".join(open(sys.argv[2]).read().split())  # rich wraps long lines
if planner != "neuroshard" and not re.search(
        rf"refine: runner-up {re.escape(planner)}'s plan[^│]*?: kept\b", said):
    sys.exit(f"the plan is {planner}'s, and refinement did not say it kept that runner-up")
print(planner)
EOF
)" || { cat "$work/plan.log" >&2; die "plan: $made"; }
expect plan "^ *$made: 10 tables on 2 GPUs"
cp "$work/tmp/plan.json" "$work/tmp/tables.yaml" "$work/plan/"
plan_hash="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["hash"])' "$work/plan/plan.json")"

run_in_image worker rw "$work/plan:/etc/shardwise:ro,$work/ckpt:/ckpt" \
    SHARDWISE_PLAN=/etc/shardwise/plan.json "SHARDWISE_PLAN_HASH=$plan_hash" \
    SHARDWISE_JOB=smoke SHARDWISE_NAMESPACE=smoke -- \
    python -m shardwise.runtime.launch --standalone --nproc_per_node=2 \
    -m shardwise.runtime.train --tables /etc/shardwise/tables.yaml --steps 3 \
    --log-every 1 --checkpoint-dir /ckpt --summary /ckpt/summary.json
python3 - "$work/ckpt" <<'EOF' || die "worker: no summary or checkpoint of step 3 (see above)"
import json
import pathlib
import sys

ckpt = pathlib.Path(sys.argv[1])
summary = json.loads((ckpt / "summary.json").read_text())
assert summary["world_size"] == 2 and summary["end_step"] == 3, summary
assert summary["device"] == "cpu" and len(summary["losses"]) > 0, summary
assert (ckpt / "step-000000003").is_dir(), sorted(p.name for p in ckpt.iterdir())
print(f"image-smoke: worker: 3 steps on 2 ranks, plan {summary['plan_hash'][:8]}, "
      f"losses {summary['losses']}, checkpoints {summary['checkpoints']}")
EOF

say "all passed in $((SECONDS - start)) s ($IMAGE, $("${BUILDAH[@]}" images --format '{{.Size}}' "$IMAGE" | head -1))"
