# Sourced by controlplane/build.sh and node/build.sh: what both do around their Go builds.
# Each sets `binaries` (the names it builds) before calling these.

# find_go NAME: set go_bin to $GO, else go on PATH, else /usr/local/go/bin/go.
find_go() {
  go_bin="${GO:-}"
  if [[ -z "$go_bin" ]]; then
    if command -v go >/dev/null 2>&1; then
      go_bin="$(command -v go)"
    elif [[ -x /usr/local/go/bin/go ]]; then
      go_bin=/usr/local/go/bin/go
    else
      echo "$1: no Go toolchain found (set GO or put go on PATH)" >&2
      exit 2
    fi
  fi
  if ! [[ -x "$go_bin" ]] && ! command -v "$go_bin" >/dev/null 2>&1; then
    echo "$1: Go toolchain $go_bin is not executable" >&2
    exit 2
  fi
}

all_present() {
  local b
  for b in "${binaries[@]}"; do
    [[ -x "$bin_dir/$b" ]] || return 1
  done
}

# cached_or_locked NAME ARG: with ARG --print-bin-dir, print $bin_dir and exit; if every
# binary is in $bin_dir, print it and exit; else take the build lock of its key dir (two
# test sessions may build at once: the second waits, then finds the binaries present
# instead of compiling the same thing twice) and return, holding it, to build.
cached_or_locked() {
  if [[ "$2" == "--print-bin-dir" ]]; then
    echo "$bin_dir"
    exit 0
  fi
  if all_present; then
    echo "$1: binaries up to date in $bin_dir" >&2
    echo "$bin_dir"
    exit 0
  fi
  mkdir -p "$(dirname "$bin_dir")"
  exec 9>"$(dirname "$bin_dir")/build.lock"
  flock 9
  if all_present; then
    echo "$1: binaries up to date in $bin_dir (built by another process)" >&2
    echo "$bin_dir"
    exit 0
  fi
}
