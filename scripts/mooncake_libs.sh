#!/usr/bin/env bash
# Fetches the shared libraries Mooncake's transfer engine links against but its wheel does
# not bring (libibverbs.so.1, librdmacm.so.1, libnl-3.so.200, libnl-route-3.so.200), without
# root: `apt-get download` the Debian packages and `dpkg -x` them into a cache outside the
# checkout. An image that can `apt-get install libibverbs1 librdmacm1 libnl-3-200
# libnl-route-3-200` does not need this.
#
# The cache is keyed by the packages' candidate versions and the architecture, so an apt
# update that moves a version extracts a fresh copy beside the old one; a second run with the
# same versions only checks a marker. `<cache>/current` points at the newest complete copy:
# omni_runtime.connectors.mooncake.mooncake_library_path() reads it to give child processes
# the same LD_LIBRARY_PATH.
#
# Usage: LD_LIBRARY_PATH=$(scripts/mooncake_libs.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Prints one line: the directories to put on LD_LIBRARY_PATH, joined by ':'.
# Env:   OMNI_CACHE_DIR (default ~/.cache/omni-operator)
set -euo pipefail

PACKAGES=(libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200)
LIBRARIES=(libibverbs.so.1 librdmacm.so.1 libnl-3.so.200 libnl-route-3.so.200)
CACHE=${OMNI_CACHE_DIR:-$HOME/.cache/omni-operator}/mooncake-libs

log() { printf '[mooncake-libs] %s\n' "$*" >&2; }

multiarch() {
    case $(dpkg --print-architecture) in
        amd64) echo x86_64-linux-gnu ;;
        arm64) echo aarch64-linux-gnu ;;
        *) log "unsupported architecture $(dpkg --print-architecture)"; exit 1 ;;
    esac
}

cache_key() {
    # One apt-cache call (each costs most of a second): "pkg:" lines, then "  Candidate: v".
    local versions pkg
    versions=$(apt-cache policy "${PACKAGES[@]}" \
        | awk '/^[^ ].*:$/ {pkg = substr($0, 1, length($0) - 1)} /Candidate:/ {print pkg "=" $2}')
    for pkg in "${PACKAGES[@]}"; do
        if ! grep -qx "$pkg=[^(].*" <<<"$versions"; then
            log "apt knows no candidate version of $pkg (run apt-get update, or install it)"
            exit 1
        fi
    done
    printf '%s\n' "$(dpkg --print-architecture)" "$versions" | sha256sum | cut -c1-16
}

library_path() {
    local root=$1 arch
    arch=$(multiarch)
    echo "$root/usr/lib/$arch:$root/lib/$arch"
}

complete() {
    # The marker alone would trust a half-deleted cache; the libraries are what matter.
    local root=$1 lib
    [ -f "$root/.complete" ] || return 1
    for lib in "${LIBRARIES[@]}"; do
        [ -e "$root/usr/lib/$(multiarch)/$lib" ] || [ -e "$root/lib/$(multiarch)/$lib" ] || return 1
    done
}

extract() {
    local root=$1 work deb lib
    work=$(mktemp -d "$CACHE/.work.XXXXXX")
    # apt-get download writes into the current directory. Its output (and, as root, its
    # "W: Download is performed unsandboxed" notice, harmless here) goes to a log, shown
    # only when the download fails.
    if ! (cd "$work" && apt-get download -q "${PACKAGES[@]}") >"$CACHE/download.log" 2>&1; then
        rm -rf "$work"
        log "apt-get download ${PACKAGES[*]} failed:"
        tail -n 20 "$CACHE/download.log" >&2
        exit 1
    fi
    mkdir -p "$work/root"
    for deb in "$work"/*.deb; do
        dpkg -x "$deb" "$work/root"
    done
    touch "$work/root/.complete"
    rm -rf "$root"
    mv "$work/root" "$root"
    rm -rf "$work"
    complete "$root" || {
        for lib in "${LIBRARIES[@]}"; do
            find "$root" -name "$lib" | grep -q . || log "missing after extraction: $lib"
        done
        exit 1
    }
}

main() {
    local key root
    mkdir -p "$CACHE"
    key=$(cache_key)
    root=$CACHE/$key
    if ! complete "$root"; then
        exec 9>"$CACHE/.lock"
        flock 9
        if ! complete "$root"; then
            log "extracting ${PACKAGES[*]} into $root"
            extract "$root"
        fi
        # A relative link, so that the cache can move with OMNI_CACHE_DIR's filesystem.
        ln -sfn "$key" "$CACHE/current.tmp" && mv -T "$CACHE/current.tmp" "$CACHE/current"
        exec 9>&-
    elif [ "$(readlink "$CACHE/current" 2>/dev/null)" != "$key" ]; then
        exec 9>"$CACHE/.lock"
        flock 9
        ln -sfn "$key" "$CACHE/current.tmp" && mv -T "$CACHE/current.tmp" "$CACHE/current"
        exec 9>&-
    fi
    library_path "$root"
}

main "$@"
