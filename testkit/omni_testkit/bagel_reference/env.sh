#!/usr/bin/env bash
# Builds, or reuses, the Python environment that runs BAGEL's official reference inference
# code (../shared/reference/bagel: inferencer.py, modeling/, data/) for the integration
# tests that compare the project's BAGEL stages with it (harness.py, run_reference.py).
#
# The reference vendors transformers 4.49 internals, which the project's transformers no
# longer has, so it gets a venv of its own, outside the checkout:
#   ${OMNI_CACHE_DIR:-~/.cache/omni-operator}/bagel-reference-<key>
# holding only transformers 4.49 and what 4.49 needs that differs from the project's base
# environment (tokenizers 0.21, huggingface-hub < 1.0, einops). torch, torchvision, numpy,
# pillow, safetensors, cv2, ... come from the project's base environment (scripts/setup.sh)
# through a .pth file, so no second torch is installed; the venv's own site-packages
# precede .pth entries on sys.path, so its transformers 4.49 wins over the base's.
#
# <key> hashes the pins, this file, the Python version and the base environment's
# site-packages path, so a warm call costs well under a second. A build goes into a
# temporary directory renamed into place when complete (an interrupted build never looks
# complete), under a flock so that concurrent pytest sessions build it once.
#
# Usage: testkit/omni_testkit/bagel_reference/env.sh   (prints the env's python last on stdout)
# Env:   OMNI_CACHE_DIR; OMNI_BAGEL_BASE_PYTHON (default: the checkout's .venv/bin/python)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
CACHE_DIR=${OMNI_CACHE_DIR:-$HOME/.cache/omni-operator}
BASE_PYTHON=${OMNI_BAGEL_BASE_PYTHON:-$ROOT/.venv/bin/python}
# transformers 4.49.0 is the authors' pin (the reference's requirements.txt); 4.49 needs
# tokenizers>=0.21,<0.22 and huggingface-hub>=0.26,<1.0 (0.29.1 is the authors' pin);
# einops is imported by modeling/autoencoder.py (0.8.1, the authors' pin).
PINS=(transformers==4.49.0 tokenizers==0.21.4 huggingface-hub==0.29.1 einops==0.8.1)
# data/transforms.py imports cv2 (never calls it at inference); installed only where the
# base environment lacks it.
CV2_PIN=opencv-python-headless==4.11.0.86

log() { printf '[bagel-reference-env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ ! -x "$BASE_PYTHON" ]; then
    log "no base python at $BASE_PYTHON: run scripts/setup.sh first"
    exit 1
fi
# The base environment's site-packages: where torch lies (found without importing it).
BASE_SITE=$("$BASE_PYTHON" -c '
import importlib.util, os
spec = importlib.util.find_spec("torch")
assert spec is not None and spec.submodule_search_locations, "torch is not installed"
print(os.path.dirname(list(spec.submodule_search_locations)[0]))
')
PY_VERSION=$("$BASE_PYTHON" -c 'import sys; print(sys.version)')

KEY=$({
    echo "$PY_VERSION"
    echo "$BASE_SITE"
    printf '%s\n' "${PINS[@]}" "$CV2_PIN"
    cat "${BASH_SOURCE[0]}"
} | sha256sum | cut -c1-16)
DEST=$CACHE_DIR/bagel-reference-$KEY
PY=$DEST/bin/python

if [ -x "$PY" ]; then
    echo "$PY"
    exit 0
fi

mkdir -p "$CACHE_DIR"
exec 9>"$DEST.lock"
if ! flock -n 9; then
    log "another process is building $DEST; waiting for it"
    flock 9
fi
if [ -x "$PY" ]; then  # built while we waited
    echo "$PY"
    exit 0
fi

rm -rf "$DEST".tmp.*  # left by an interrupted build (we hold the lock: no one else builds)
TMP=$(mktemp -d "$DEST.tmp.XXXXXX")
LOG=$DEST.log
: >"$LOG"
trap 'rm -rf "$TMP"' EXIT
log "building $DEST (once per key; log: $LOG)"

step() {
    local what=$1
    shift
    log "$what"
    if ! "$@" >>"$LOG" 2>&1; then
        log "failed: $what (tail of $LOG:)"
        tail -n 30 "$LOG" >&2
        exit 1
    fi
}

# No pip of its own: the base environment's pip installs into it (pip --python). A venv is
# not relocatable in general, but its bin/python is (it finds its prefix from where it
# lies), and nothing runs the venv's other scripts, whose shebangs name the temporary path.
step "creating the venv with $BASE_PYTHON's interpreter" "$BASE_PYTHON" -m venv --without-pip "$TMP"
SITE=$("$TMP/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$BASE_SITE" >"$SITE/_omni_base_env.pth"
pip=("$BASE_PYTHON" -m pip --python "$TMP/bin/python" --disable-pip-version-check --no-input)
# --no-deps: everything else transformers 4.49 needs (numpy, packaging, pyyaml, regex,
# requests, safetensors, tqdm, filelock, fsspec) comes from the base environment; the
# import check below is what decides that it does.
step "installing ${PINS[*]}" "${pip[@]}" install --no-deps "${PINS[@]}"
if ! "$TMP/bin/python" -c 'import cv2' >>"$LOG" 2>&1; then
    step "installing $CV2_PIN (the base environment has no cv2)" \
        "${pip[@]}" install --no-deps "$CV2_PIN"
fi
step "checking the environment's imports" "$TMP/bin/python" -c '
import sys
import cv2, einops, huggingface_hub, numpy, PIL, safetensors, tokenizers, torch, torchvision
import transformers
from transformers.modeling_utils import PreTrainedModel
from transformers.models.qwen2 import Qwen2Tokenizer
assert transformers.__version__ == "4.49.0", transformers.__version__
assert transformers.__file__.startswith(sys.prefix), transformers.__file__
print("torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "huggingface_hub", huggingface_hub.__version__)
'

mv "$TMP" "$DEST"
trap - EXIT
log "built $DEST"
echo "$PY"
