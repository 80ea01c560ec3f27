#!/usr/bin/env bash
# `./dev image-test`: build the CPU variant of deployments/image/Containerfile here and prove ckptflow runs in it
# with the same output as outside.
#   1. a Debian base image made locally (debootstrap minbase of this machine's release + python3; podman import),
#      reused while it exists: no container registry is needed;
#   2. `podman build --isolation chroot` of the CPU variant, passing pip's CA bundle and local wheel folder
#      (from `pip config list`) as build-time volumes;
#   3. inside the image (`buildah from` + `buildah run --isolation chroot`; containers cannot be started on
#      machines without cgroup v2 delegation, a chroot can): write a demo checkpoint, `ckptflow merge` it,
#      `ckptflow verify` it against the reference with logits, run bench/gpu_check.py (on the CPU); outside: merge the same checkpoint with the same
#      flags; every output file's sha256 must be identical.
# Any missing tool or failed step: one line `image-test: error: ...` on stderr and a non-zero exit.
# Environment: HOST_PYTHON (a Python with ckptflow installed, default .venv/bin/python),
#   CKPTFLOW_IMAGE (default localhost/ckptflow:cpu), CKPTFLOW_BASE_IMAGE (skip debootstrap: use this base),
#   IMAGE_TEST_KEEP=1 (keep the built image; by default it stays too, intermediate layers are pruned).
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() { echo "image-test: error: $*" >&2; exit 1; }
say() { echo "image-test: $*"; }

HOST_PYTHON="${HOST_PYTHON:-.venv/bin/python}"
IMAGE="${CKPTFLOW_IMAGE:-localhost/ckptflow:cpu}"
WORK="$(pwd)/.image-test"

# Tools: installed from Debian's packages when this is a Debian machine we are root on, else named and refused.
missing=()
for tool in podman buildah; do command -v "$tool" > /dev/null || missing+=("$tool"); done
[ -n "${CKPTFLOW_BASE_IMAGE:-}" ] || command -v debootstrap > /dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        say "installing ${missing[*]} (apt-get)"
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
            > /tmp/ckptflow-image-apt.log 2>&1 || fail "apt-get install ${missing[*]} failed (log: /tmp/ckptflow-image-apt.log)"
    else
        fail "${missing[*]} not installed: install them (Debian/Ubuntu: sudo apt-get install -y podman buildah debootstrap)"
    fi
fi
[ -x "$HOST_PYTHON" ] || fail "$HOST_PYTHON not found: run ./dev test once (it makes .venv) or set HOST_PYTHON"

# Sandboxes without setrlimit refuse podman's default ulimits: a config of our own instead of /etc's edits.
mkdir -p "$WORK"
printf '[containers]\ndefault_ulimits = []\n' > "$WORK/containers.conf"
export CONTAINERS_CONF="$WORK/containers.conf"
podman info > "$WORK/podman-info.log" 2>&1 || fail "podman cannot run here: $(tail -1 "$WORK/podman-info.log")"

# 1. The base image.
. /etc/os-release
BASE="${CKPTFLOW_BASE_IMAGE:-localhost/ckptflow-base:${VERSION_CODENAME:-bookworm}}"
if ! podman image exists "$BASE"; then
    [ -z "${CKPTFLOW_BASE_IMAGE:-}" ] || fail "base image $BASE not found in podman's storage"
    [ "${ID:-}" = debian ] || fail "making the base image needs a Debian machine (debootstrap of its release); set CKPTFLOW_BASE_IMAGE"
    say "making $BASE with debootstrap (Debian ${VERSION_CODENAME})"
    rootfs="$WORK/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd "$VERSION_CODENAME" "$rootfs" \
        > "$WORK/debootstrap.log" 2>&1 || fail "debootstrap failed: $(tail -1 "$WORK/debootstrap.log") (log: $WORK/debootstrap.log)"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$BASE" > /dev/null \
        || fail "podman import of $rootfs failed"
    rm -rf "$rootfs"
fi

# 2. The CPU variant, with this machine's pip configuration lent as build-time volumes (not kept in the image).
pip_setting() {  # the first value pip is configured with for NAME (cert, find-links, index-url)
    "$HOST_PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | head -1 | cut -d' ' -f1
}
build_args=(--build-arg "BASE=$BASE" --build-arg TORCH=cpu)
cert="$(pip_setting cert)"
if [ -n "$cert" ] && [ -f "$cert" ]; then build_args+=(-v "$cert:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt); fi
wheels="$(pip_setting find-links)"
if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    # The CPU torch wheel lies there: no extra index (PyTorch's may be unreachable).
    build_args+=(-v "$wheels:/run/host-wheels:ro" --build-arg PIP_FIND_LINKS=/run/host-wheels --build-arg TORCH_INDEX_URL=none)
fi
index="$(pip_setting index-url)"
[ -z "$index" ] || [[ "$index" == file:* ]] || build_args+=(--build-arg "PIP_INDEX_URL=$index")
say "building $IMAGE (podman build --isolation chroot, base $BASE)"
start=$(date +%s)
podman build --isolation chroot --layers --force-rm -f deployments/image/Containerfile "${build_args[@]}" -t "$IMAGE" . \
    > "$WORK/build.log" 2>&1 || fail "podman build failed: $(grep -v '^\s*$' "$WORK/build.log" | tail -1) (log: $WORK/build.log)"
build_seconds=$(( $(date +%s) - start ))
podman image prune -f > /dev/null 2>&1 || true  # dangling layers of earlier builds
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE in ${build_seconds}s: $(( size / 1000000 )) MB"

# 3. Inside the image, as its non-root user, with the work folder at the same path (the manifest records paths).
data="$WORK/run"
rm -rf "$data"
mkdir -p "$data"
chmod 0777 "$data"
ctr=$(buildah from --pull=never "$IMAGE") || fail "buildah from $IMAGE failed"
trap 'buildah rm "$ctr" > /dev/null 2>&1 || true' EXIT
inside() {
    buildah run --isolation chroot -v "$data:$data" "$ctr" -- "$@" >> "$WORK/inside.log" 2>&1 \
        || fail "inside the image, '$*' failed: $(grep -v '^\s*$' "$WORK/inside.log" | tail -1) (log: $WORK/inside.log)"
}
: > "$WORK/inside.log"
user=$(buildah run --isolation chroot "$ctr" -- id -u) || fail "buildah run cannot start a command in $IMAGE"
[ "$user" != 0 ] || fail "$IMAGE runs as root; the Containerfile must end with a non-root USER"
if buildah run --isolation chroot "$ctr" -- sh -c 'command -v gcc cc make' > /dev/null 2>&1; then
    fail "$IMAGE has build tools on PATH; the final stage must not install them"
fi
say "inside (uid $user): demo-checkpoint, merge, verify --reference --logits, bench/gpu_check.py"
inside ckptflow demo-checkpoint "$data/ckpt" --world-size 2
inside ckptflow merge --local-dir "$data/ckpt/global_step_1/actor" --target-dir "$data/inside" --dtype bf16
inside ckptflow verify "$data/inside" --reference "$data/ckpt/reference" --logits
inside python bench/gpu_check.py --checkpoint "$data/ckpt/global_step_1/actor" --work "$data/gpu_check" --seq-len 8
grep -q '^gpu_check: ok$' "$WORK/inside.log" || fail "bench/gpu_check.py inside the image did not end with 'gpu_check: ok' (log: $WORK/inside.log)"
say "outside: the same merge with $HOST_PYTHON"
"$HOST_PYTHON" -m ckptflow.flows.cli merge --local-dir "$data/ckpt/global_step_1/actor" --target-dir "$data/outside" --dtype bf16 \
    > "$WORK/outside.log" 2>&1 || fail "the merge outside the image failed: $(tail -1 "$WORK/outside.log")"

# Every file identical but the manifest, whose creation time, timings and mtimes differ; its weights id and
# file hashes must be equal too.
(cd "$data/inside" && find . -type f ! -name ckptflow_manifest.json -print0 | sort -z | xargs -0 sha256sum) > "$WORK/inside.sha256"
(cd "$data/outside" && find . -type f ! -name ckptflow_manifest.json -print0 | sort -z | xargs -0 sha256sum) > "$WORK/outside.sha256"
diff "$WORK/inside.sha256" "$WORK/outside.sha256" > /dev/null \
    || fail "outputs differ inside and outside the image: diff $WORK/inside.sha256 $WORK/outside.sha256"
"$HOST_PYTHON" - "$data/inside" "$data/outside" <<'PY' || fail "the manifests' weights_id or file hashes differ inside and outside the image"
import json, sys
def hashes(folder):  # mtimes differ by design; names, sizes and sha256 may not
    manifest = json.load(open(f"{folder}/ckptflow_manifest.json"))
    return manifest["weights_id"], {name: (e["sha256"], e["size"]) for name, e in manifest["files"].items()}
sys.exit(0 if hashes(sys.argv[1]) == hashes(sys.argv[2]) else 1)
PY
weights=$(grep safetensors "$WORK/inside.sha256" | grep -v index | head -1)
say "identical: $(wc -l < "$WORK/inside.sha256") files + manifest hashes (${weights%% *} ${weights##* })"
say "ok: $IMAGE $(( size / 1000000 )) MB, built in ${build_seconds}s"
