#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs every check of the project: lint,
# formatting, types, the import-layer contracts, then the whole test suite: unit,
# integration (real processes) and cluster (a real control plane built from pinned Go
# modules, or the cluster $KUBECONFIG names), and the images (built here with podman).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not integration".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/setup.sh >/dev/null
py=.venv/bin/python
# Mooncake's engine needs four system libraries its wheel lacks; the loader reads
# LD_LIBRARY_PATH only at process start, so it is set before pytest starts.
LD_LIBRARY_PATH=$(scripts/mooncake_libs.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
export OMNI_REQUIRE_MOONCAKE=1   # fail, not skip, if the engine cannot load
# BAGEL's reference code (../shared/reference/bagel, outside the repository) is the oracle
# of tests/integration/test_bagel.py: a clone without it skips those tests and says why;
# CI, which has it, requires it (.ci/run sets OMNI_REQUIRE_BAGEL_REFERENCE=1).

echo "== system packages"; scripts/host_packages.sh
if [ "$(id -u)" -eq 0 ]; then
    # host_packages.sh installed redis-server: the video job store's tests must run.
    export OMNI_REQUIRE_REDIS=1
fi
# The project's images, built from the Dockerfiles with podman as users build them (cold:
# about 20 min for the three, mostly pip downloading and unpacking; warm: seconds), for
# the image tests and the real node. They build in the background while the checks and
# the Go compile (CPU-bound) run, and are waited for before pytest.
images_pid=
images_log=$(mktemp)
if [ "$(id -u)" -eq 0 ]; then
    scripts/images.sh >/dev/null 2>"$images_log" &
    images_pid=$!
    export OMNI_REQUIRE_IMAGES=1   # fail, not skip, if they cannot be built or run
fi
trap '[ -n "$images_pid" ] && kill "$images_pid" 2>/dev/null; rm -f "$images_log"' EXIT

echo "== ruff"; "$py" -m ruff check . && "$py" -m ruff format --check .
echo "== mypy"; "$py" -m mypy
echo "== import contracts"
"$py" -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
if [ -z "${KUBECONFIG:-}" ]; then
    # The cluster suite runs against a control plane built from pinned Go modules; built
    # once per pin set into ~/.cache/omni-operator/controlplane (about 7 min cold).
    echo "== control plane binaries"; tests/cluster/controlplane/build.sh >/dev/null
    # The real node beside the kwok nodes: containerd, its runc shim, ctr and crictl from
    # their pinned modules (kubelet and kube-proxy come with the control plane's build).
    echo "== real node binaries"; tests/cluster/node/build.sh >/dev/null
    if [ "$(id -u)" -eq 0 ]; then
        export OMNI_REQUIRE_REAL_NODE=1   # fail, not skip, if the node cannot run
    fi
fi
if [ -n "$images_pid" ]; then
    echo "== images"
    if ! wait "$images_pid"; then
        images_pid=
        cat "$images_log" >&2
        exit 1
    fi
    images_pid=
    grep -E "built|made" "$images_log" || true
fi
if [ "$#" -gt 0 ]; then
    echo "== pytest"; exec "$py" -m pytest "$@"
fi
# The whole suite runs as two pytest sessions side by side: the cluster suite with the unit
# tests, the images' tests (the images the real node runs) and a few integration modules,
# and the rest of tests/integration. One session alone leaves a core idle much of the time
# (one process waiting on another: an engine loading, a pod rolling; the tests' engines are
# single-threaded, tests/conftest.py); the integration modules named here keep the two
# sessions' lengths close (README.md has the figures). The first session's output is
# printed after the other's.
beside=(
    tests/integration/test_images.py
    tests/integration/test_main_job.py
    tests/integration/test_drain_and_revisions.py
)
echo "== pytest: tests/integration, with tests/cluster, tests/unit and ${beside[*]} beside it"
cluster_log=$(mktemp)
"$py" -m pytest tests/cluster tests/unit "${beside[@]}" >"$cluster_log" 2>&1 &
cluster_pid=$!
# SIGINT, not SIGTERM: pytest tears its fixtures down (the control plane) on an interrupt.
trap '[ -n "$cluster_pid" ] && kill -INT "$cluster_pid" 2>/dev/null && wait "$cluster_pid"; rm -f "$cluster_log" "$images_log"' EXIT
rc=0
"$py" -m pytest tests/integration "${beside[@]/#/--ignore=}" || rc=$?
cluster_rc=0
wait "$cluster_pid" || cluster_rc=$?
cluster_pid=
echo "== pytest: tests/cluster, tests/unit, ${beside[*]}"
cat "$cluster_log"
[ "$rc" -eq 0 ] && [ "$cluster_rc" -eq 0 ]
