#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs every check of the project: lint,
# formatting, types, the import-layer contracts, then the whole test suite: unit,
# integration (real processes) and cluster (a real control plane built from pinned Go
# modules, or the cluster $KUBECONFIG names).
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

echo "== ruff"; "$py" -m ruff check . && "$py" -m ruff format --check .
echo "== mypy"; "$py" -m mypy
echo "== import contracts"
"$py" -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
if [ -z "${KUBECONFIG:-}" ]; then
    # The cluster suite runs against a control plane built from pinned Go modules; built
    # once per pin set into ~/.cache/omni-operator/controlplane (about 7 min cold).
    echo "== control plane binaries"; tests/cluster/controlplane/build.sh >/dev/null
fi
echo "== pytest"; "$py" -m pytest "$@"
