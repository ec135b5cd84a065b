#!/usr/bin/env bash
# Build the project's images here the way users build them: `podman build` of the
# Dockerfiles, unmodified. No container registry is reachable here, so the base image the
# Dockerfiles name (python:3.11-slim-bookworm) is made locally from Debian's packages and
# tagged with that name: a stand-in with the same Debian release, Python minor version,
# venv and headers.
#
# Usage: scripts/images.sh [IMAGE...]          IMAGE: operator, runtime, runtime-cuda (default: all)
#        scripts/images.sh --containers-conf   print the containers.conf podman must be run with
#
#   REGISTRY=registry.example.com/team scripts/images.sh      also tag each image under REGISTRY
#   REGISTRY=registry.example.com/team PUSH=1 scripts/images.sh   ... and push it there
#
# Images are named omni-operator/omni-operator:0.1.0, omni-operator/omni-runtime:0.1.0 and
# omni-operator/omni-runtime:0.1.0-cuda (podman stores them as localhost/omni-operator/...).
# With REGISTRY set, each is also tagged REGISTRY/omni-operator:0.1.0,
# REGISTRY/omni-runtime:0.1.0 and REGISTRY/omni-runtime:0.1.0-cuda, and that name is the one
# printed; PUSH=1 then runs `podman push` of it (log in first: `podman login HOST`).
# REGISTRY=docker.io/omni-operator gives the names the manifests use, as a cluster's
# container runtime spells them: the tag to load an image into a cluster under
# (`podman save`, then `kind load image-archive` or `k3s ctr images import`).
#
# Each image is cached in podman's storage (outside the checkout), labelled with a key of its
# Dockerfile, its build arguments, the base image and every file the build copies: a warm run
# with nothing changed builds nothing; a change to the sources rebuilds only the layers after
# the COPY of the sources (the Dockerfiles install dependencies first).
# Prints one line per image: NAME TAG. Progress and build logs go to stderr and to
# ${OMNI_CACHE_DIR:-~/.cache/omni-operator}/images/logs/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cache="${OMNI_CACHE_DIR:-$HOME/.cache/omni-operator}/images"
mkdir -p "$cache/logs"
say() { echo "[images $(date +%T)] $*" >&2; }

# podman's defaults do not run here: its ulimits (nofile and nproc at 1048576) need
# CAP_SYS_RESOURCE, crun cannot run in this cgroup setup, and there is no systemd. A file of
# our own, named by CONTAINERS_CONF, leaves the machine's /etc/containers alone.
conf="$cache/containers.conf"
cat > "$conf.tmp" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
mv -f "$conf.tmp" "$conf"
export CONTAINERS_CONF="$conf"
if [[ "${1:-}" == "--containers-conf" ]]; then
    echo "$conf"
    exit 0
fi

wanted=("$@")
[[ ${#wanted[@]} -gt 0 ]] || wanted=(operator runtime runtime-cuda)
for image in "${wanted[@]}"; do
    case "$image" in
        operator | runtime | runtime-cuda) ;;
        *) echo "images.sh: no image '$image' (operator, runtime, runtime-cuda)" >&2; exit 2 ;;
    esac
done

registry="${REGISTRY:-}"
registry="${registry%/}"
if [[ -n "${PUSH:-}" && -z "$registry" ]]; then
    echo "images.sh: PUSH needs REGISTRY, the registry (and path) to push to" >&2
    exit 2
fi
if [[ "$registry" =~ [[:space:]] || ( -n "$registry" && ! "$registry" =~ ^[a-z0-9] ) ]]; then
    echo "images.sh: REGISTRY must be a registry host and path, e.g. registry.example.com/team (got '$registry')" >&2
    exit 2
fi

for tool in podman mmdebstrap; do
    command -v "$tool" >/dev/null || {
        echo "images.sh: $tool not found (scripts/host_packages.sh installs it)" >&2
        exit 2
    }
done

exec 9>"$cache/lock"
flock 9

label() {  # label IMAGE KEY -> the label's value, or nothing if there is no such image
    podman image inspect --format "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true
}

# --- the base image ---------------------------------------------------------------------------
base=docker.io/library/python:3.11-slim-bookworm
packages=ca-certificates,python3,python3-venv,python3-dev,python-is-python3
# pip and apt inside a build reach the package registries as this machine does only with its
# pip configuration and extra CA certificates: copied into the base from the host when it is
# made, never committed.
host_config=()
[[ -f /etc/pip.conf ]] && host_config+=(/etc/pip.conf)
while IFS= read -r -d '' cert; do host_config+=("$cert"); done \
    < <(find /usr/local/share/ca-certificates -name '*.crt' -print0 2>/dev/null | sort -z)
base_key=$( { echo "$packages"; sed -n '/^# --- the base image/,/^# --- the project/p' "$0";
              cat "${host_config[@]}" /dev/null; } | sha256sum | cut -c1-16)
if [[ "$(label "$base" omni.dev/base-key)" != "$base_key" ]]; then
    say "making $base from Debian bookworm (minbase + python3)"
    t0=$SECONDS
    tar="$cache/base-$base_key.tar"
    hook='mkdir -p "$1/usr/local/share/ca-certificates"'
    for f in "${host_config[@]}"; do
        case "$f" in
            /etc/pip.conf) hook+="; cp /etc/pip.conf \"\$1/etc/pip.conf\"" ;;
            *) hook+="; cp '$f' \"\$1/usr/local/share/ca-certificates/\"" ;;
        esac
    done
    hook+='; chroot "$1" update-ca-certificates >/dev/null'
    mmdebstrap --quiet --variant=minbase --include="$packages" --customize-hook="$hook" \
        bookworm "$tar" >"$cache/logs/base.log" 2>&1 || {
        tail -30 "$cache/logs/base.log" >&2
        exit 1
    }
    podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        --change "LABEL omni.dev/base-key=$base_key" \
        "$tar" "$base" >/dev/null
    rm -f "$tar"
    say "made $base in $((SECONDS - t0)) s"
fi
base_id=$(podman image inspect --format '{{.Id}}' "$base")

# --- the project's images ---------------------------------------------------------------------
# The files a build copies: what .dockerignore lets through (a test keeps the two in step).
context_key() {
    find pyproject.toml README.md requirements runtime operator -type f \
        ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' -print0 \
        | sort -z | xargs -0 sha256sum
}

# While an image is rebuilt, its old build and the new one's layers are both on disk: for
# the CUDA runtime (10 GB) that is 25 GB at the peak. With less free than that, the old
# build goes first: its layers would spare a rebuild of the dependencies, but a full disk
# fails the build outright.
min_free_gb=30
make_room() {  # make_room NAME TAG
    local store free_gb
    store=$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || true)
    [[ -d "$store" ]] || return 0
    free_gb=$(df --output=avail -BG "$store" | tail -1 | tr -dc 0-9)
    if [[ "$free_gb" -lt "$min_free_gb" ]] && podman image exists "$2"; then
        say "$1: ${free_gb} GB free, under ${min_free_gb}: removing the old $2 first"
        podman rmi "$2" >/dev/null
        podman image prune -f >/dev/null
    fi
}

build() {  # build NAME DOCKERFILE TAG [BUILD-ARG...]
    local name=$1 dockerfile=$2 tag=$3
    shift 3
    local args=() a
    for a in "$@"; do args+=(--build-arg "$a"); done
    local key
    key=$( { cat "$dockerfile"; printf '%s\n' "$@" "$base_id"; context_key; } \
        | sha256sum | cut -c1-16)
    if [[ "$(label "$tag" omni.dev/build-key)" == "$key" ]]; then
        say "$name: $tag is up to date"
    else
        make_room "$name" "$tag"
        say "$name: building $tag (log: $cache/logs/$name.log)"
        local t0=$SECONDS
        # --format docker: buildah drops SHELL (and with it pipefail) in the OCI format.
        podman build --pull=never --format docker -f "$dockerfile" "${args[@]}" \
            --label "omni.dev/build-key=$key" -t "$tag" . >"$cache/logs/$name.log" 2>&1 || {
            tail -40 "$cache/logs/$name.log" >&2
            echo "images.sh: building $name failed; its log: $cache/logs/$name.log" >&2
            exit 1
        }
        say "$name: built $tag in $((SECONDS - t0)) s"
        # The image this one replaces, and layers nothing tagged uses any more: gigabytes
        # each time the dependencies change.
        podman image prune -f >/dev/null
    fi
    publish "$name" "$tag"
}

publish() {  # publish NAME TAG: print NAME and the image's name (under REGISTRY, if set)
    local name=$1 tag=$2
    if [[ -z "$registry" ]]; then
        echo "$name $tag"
        return
    fi
    local remote="$registry/${tag#*/}"
    podman tag "$tag" "$remote"
    if [[ -n "${PUSH:-}" ]]; then
        say "$name: pushing $remote"
        podman push "$remote" >"$cache/logs/$name-push.log" 2>&1 || {
            tail -20 "$cache/logs/$name-push.log" >&2
            echo "images.sh: pushing $remote failed; its log: $cache/logs/$name-push.log" >&2
            exit 1
        }
        say "$name: pushed $remote"
    fi
    echo "$name $remote"
}

for image in "${wanted[@]}"; do
    case "$image" in
        operator) build operator Dockerfile.operator omni-operator/omni-operator:0.1.0 ;;
        runtime) build runtime Dockerfile.runtime omni-operator/omni-runtime:0.1.0 TARGET=cpu ;;
        runtime-cuda)
            build runtime-cuda Dockerfile.runtime omni-operator/omni-runtime:0.1.0-cuda TARGET=cuda
            ;;
    esac
done
