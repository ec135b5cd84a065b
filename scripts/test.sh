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
