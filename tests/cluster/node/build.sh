#!/usr/bin/env bash
# Build what the cluster tests' real node runs besides the kubelet and
# kube-proxy (those come from ../controlplane/build.sh): containerd, its runc
# shim, ctr and crictl from this Go module, cluster-dns (CoreDNS, ../dns),
# omni-probe (probe/, the whole of
# the tests' tiny image) and the pause binary compiled with gcc -static from
# the kubernetes module the control plane pins, into a cache outside the
# checkout keyed by the pins.
#
# Usage: build.sh [--print-bin-dir]
#   --print-bin-dir  print the bin dir for the current pins and exit (no build)
#
# Progress goes to stderr; the last stdout line is the bin dir.
# Env: OMNI_CACHE_DIR (default ~/.cache/omni-operator), GO (go binary),
#      CC (C compiler, default gcc), OMNI_BUILD_NICE (niceness, default 10).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${OMNI_CACHE_DIR:-$HOME/.cache/omni-operator}"

# shellcheck source=../go_build.sh
source "$here/../go_build.sh"
find_go node/build.sh
cc="${CC:-gcc}"

binaries=(containerd containerd-shim-runc-v2 ctr crictl omni-probe pause cluster-dns)

# btrfs needs cgo headers this machine lacks; the CLI docs are dead weight.
go_tags="no_btrfs urfave_cli_no_docs"
containerd_version="$(sed -n 's/^\tgithub.com\/containerd\/containerd\/v2 \(v[^ ]*\)$/\1/p' "$here/go.mod")"
crictl_version="$(sed -n 's/^\tsigs.k8s.io\/cri-tools \(v[^ ]*\)$/\1/p' "$here/go.mod")"
k8s_mod="$(sed -n 's/^\tk8s.io\/kubernetes \(v[^ ]*\)$/\1/p' "$here/../controlplane/go.mod")"
go_version="$("$go_bin" env GOVERSION)"
cc_version="$("$cc" --version | head -1)"
# Everything that changes the artifacts is in the key: the pins, the sources
# of omni-probe, the compilers and the flags below.
key="$(cat "$here/go.mod" "$here/go.sum" "$here"/probe/*.go \
  "$here/../dns/go.mod" "$here/../dns/go.sum" "$here/../dns/main.go" \
  <(echo "$go_version|$cc_version|$go_tags|$k8s_mod") | sha256sum | cut -c1-16)"
bin_dir="$cache_root/node/$key/bin"

cached_or_locked node/build.sh "${1:-}"

tmp_dir="$(mktemp -d "$cache_root/node/$key/tmp.XXXXXX")"
trap 'rm -rf "$tmp_dir"' EXIT
start_all=$SECONDS
nice_cmd=(nice -n "${OMNI_BUILD_NICE:-10}")

cd "$here"
cd_ver_pkg=github.com/containerd/containerd/v2/version
go_step() {
  local name="$1" pkg="$2" ldflags="$3" t0=$SECONDS
  # Static (no cgo) like containerd's release shims: the shim and ctr then
  # run anywhere, including inside the node's mount namespace.
  CGO_ENABLED=0 "${nice_cmd[@]}" "$go_bin" build -buildvcs=false -trimpath -tags "$go_tags" \
    -ldflags "-s -w $ldflags" -o "$tmp_dir/$name" "$pkg"
  echo "node/build.sh: $name built in $((SECONDS - t0))s" >&2
}
cd_ldflags="-X $cd_ver_pkg.Version=$containerd_version -X $cd_ver_pkg.Package=github.com/containerd/containerd/v2"
go_step containerd github.com/containerd/containerd/v2/cmd/containerd "$cd_ldflags"
go_step containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 "$cd_ldflags"
go_step ctr github.com/containerd/containerd/v2/cmd/ctr "$cd_ldflags"
go_step crictl sigs.k8s.io/cri-tools/cmd/crictl "-X sigs.k8s.io/cri-tools/pkg/version.Version=$crictl_version"
go_step omni-probe ./probe ""
# The cluster's DNS: a module of its own (../dns), so that CoreDNS's pins never move
# containerd's.
t0=$SECONDS
(cd "$here/../dns" && CGO_ENABLED=0 "${nice_cmd[@]}" "$go_bin" build -buildvcs=false -trimpath \
  -ldflags "-s -w" -o "$tmp_dir/cluster-dns" .)
echo "node/build.sh: cluster-dns built in $((SECONDS - t0))s" >&2

# pause.c ships inside the kubernetes module; take it from the module cache
# of the control plane's pins rather than from a copy in this tree.
k8s_dir="$(cd "$here/../controlplane" && "$go_bin" list -m -f '{{.Dir}}' k8s.io/kubernetes)"
if [[ -z "$k8s_dir" || ! -f "$k8s_dir/build/pause/linux/pause.c" ]]; then
  (cd "$here/../controlplane" && "$go_bin" mod download k8s.io/kubernetes)
  k8s_dir="$(cd "$here/../controlplane" && "$go_bin" list -m -f '{{.Dir}}' k8s.io/kubernetes)"
fi
# The flags of build/pause/Makefile; VERSION is a bare token there too.
"${nice_cmd[@]}" "$cc" -Os -Wall -Werror -static -DVERSION="${k8s_mod}-omni-test" \
  -o "$tmp_dir/pause" "$k8s_dir/build/pause/linux/pause.c"
strip "$tmp_dir/pause"
echo "node/build.sh: pause compiled" >&2

mkdir -p "$bin_dir"
for b in "${binaries[@]}"; do
  mv -f "$tmp_dir/$b" "$bin_dir/$b"
done
echo "node/build.sh: all built in $((SECONDS - start_all))s into $bin_dir" >&2
echo "$bin_dir"
