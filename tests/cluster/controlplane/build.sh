#!/usr/bin/env bash
# Build the pinned control-plane binaries (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok) and the real node's
# kubelet and kube-proxy from this Go module into a cache outside the
# checkout, keyed by the pinned versions. A binary that an older key's bin dir
# holds is reused when its embedded build info names exactly the modules this
# module would build it from (adding a program to tools.go changes go.mod and
# the key, but not what the other programs are made of).
#
# Usage: build.sh [--print-bin-dir]
#   --print-bin-dir  print the bin dir for the current pins and exit (no build)
#
# Progress goes to stderr; the last stdout line is the bin dir.
# Env: OMNI_CACHE_DIR (default ~/.cache/omni-operator), GO (go binary),
#      OMNI_BUILD_NICE (niceness of the compile, default 10).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${OMNI_CACHE_DIR:-$HOME/.cache/omni-operator}"

# shellcheck source=../go_build.sh
source "$here/../go_build.sh"
find_go build.sh

binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kubelet kube-proxy)

# The Go version is part of the key because binaries built by another compiler
# are different artifacts even when the pins are equal.
go_version="$("$go_bin" env GOVERSION)"
key="$(cat "$here/go.mod" "$here/go.sum" <(echo "$go_version") | sha256sum | cut -c1-16)"
bin_dir="$cache_root/controlplane/$key/bin"

cached_or_locked build.sh "${1:-}"

cd "$here"
k8s_version="$("$go_bin" list -m -f '{{.Version}}' k8s.io/kubernetes)"
k8s_minor="$(echo "$k8s_version" | cut -d. -f2)"
# Without these the binaries report v0.0.0-master, which kubectl and clients
# show as a version skew; release builds stamp them the same way.
ver_pkg=k8s.io/component-base/version
ldflags="-s -w -X $ver_pkg.gitVersion=$k8s_version -X $ver_pkg.gitMajor=1 -X $ver_pkg.gitMinor=$k8s_minor -X $ver_pkg.gitTreeState=clean"

echo "build.sh: building ${binaries[*]} (kubernetes $k8s_version, $go_version)" >&2
echo "build.sh: GOCACHE=$("$go_bin" env GOCACHE) GOMODCACHE=$("$go_bin" env GOMODCACHE)" >&2

# Build into a scratch dir and move into place at the end so an interrupted
# build never leaves a bin dir that looks complete.
tmp_dir="$(mktemp -d "$cache_root/controlplane/$key/tmp.XXXXXX")"
trap 'rm -rf "$tmp_dir"' EXIT

start_all=$SECONDS

# The modules (path and version after replacements) that `go build` would link
# into pkg, and those a built binary says it was linked from.
expected_modules() {
  "$go_bin" list -deps -f \
    '{{with .Module}}{{.Path}} {{with .Replace}}{{.Version}}{{else}}{{.Version}}{{end}}{{end}}' "$1" |
    sed '/^$/d' | sort -u
}
built_modules() {
  "$go_bin" version -m "$1" | awk -F'\t' '
    $2 == "mod" || $2 == "dep" { if (p != "") print p " " v; p = $3; v = $4; next }
    $2 == "=>" { v = $4; next }
    END { if (p != "") print p " " v }' | sort -u
}
cgo_enabled="$("$go_bin" env CGO_ENABLED)"

# Take name from another key's bin dir if it was built by this Go, with this
# cgo setting, from the very modules pkg needs now.
reuse() {
  local name="$1" pkg="$2" want old
  want="$(expected_modules "$pkg")" || return 1
  for old in "$cache_root"/controlplane/*/bin/"$name"; do
    [[ -x "$old" && "$old" != "$bin_dir/$name" ]] || continue
    "$go_bin" version "$old" | grep -qF ": $go_version" || continue
    "$go_bin" version -m "$old" | grep -qxF $'\tbuild\tCGO_ENABLED='"$cgo_enabled" || continue
    if [[ "$(built_modules "$old")" == "$want" ]]; then
      cp "$old" "$tmp_dir/$name"
      echo "build.sh: $name reused from $old (same Go, same modules)" >&2
      return 0
    fi
  done
  return 1
}

step() {
  local name="$1" pkg="$2" t0=$SECONDS
  reuse "$name" "$pkg" && return 0
  nice -n "${OMNI_BUILD_NICE:-10}" "$go_bin" build -buildvcs=false -trimpath \
    -ldflags "$ldflags" -o "$tmp_dir/$name" "$pkg"
  echo "build.sh: $name built in $((SECONDS - t0))s" >&2
}

step etcd go.etcd.io/etcd/server/v3
step kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
step kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
step kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
step kubectl k8s.io/kubernetes/cmd/kubectl
step kwok sigs.k8s.io/kwok/cmd/kwok
step kubelet k8s.io/kubernetes/cmd/kubelet
step kube-proxy k8s.io/kubernetes/cmd/kube-proxy

mkdir -p "$bin_dir"
for b in "${binaries[@]}"; do
  mv -f "$tmp_dir/$b" "$bin_dir/$b"
done
echo "build.sh: all binaries built in $((SECONDS - start_all))s into $bin_dir" >&2
echo "$bin_dir"
