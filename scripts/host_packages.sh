#!/usr/bin/env bash
# Install the Debian packages the image builds and the real node of the cluster suite need,
# when they are missing (a no-op on a machine that has them all). Root only: elsewhere it
# says what is missing, and the tests that need it skip saying why.
#
#   podman, buildah, runc, uidmap   build and run the project's images (runc: crun cannot run
#                                   in this machine's cgroup setup)
#   mmdebstrap                      the base image, made from Debian's packages
#   containernetworking-plugins     the real node's pod network (bridge, loopback, host-local)
#   iptables                        kube-proxy's Service rules, inside the node's own netns
#   socat                           joins the node's network namespace to the control plane
#   redis-server                    the video job store's tests run against a real Redis
set -euo pipefail

packages=(podman buildah runc uidmap mmdebstrap containernetworking-plugins iptables socat
    redis-server)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "host_packages.sh: missing ${missing[*]} (needs root and apt-get to install)" >&2
    exit 0
fi
echo "host_packages.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq "${missing[@]}" >/dev/null
