"""The pipeline's credentials in its pods: the stage-keys Secret (made once by the
reconciler, never rendered again) and the read-only Secret volumes of each pod's role."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..api import SecretKeyRef
from .context import RenderContext
from .names import COMPONENT_STAGE_KEYS, child_labels, child_metadata, stage_keys_secret_name

# Where pods find their credentials (names in omni_runtime.config.credentials).
STAGE_KEYS_DIR = "/var/run/omni/stage-keys"
API_KEYS_DIR = "/var/run/omni/api-keys"
API_KEYS_FILE = "api-keys"
# Owner and group may read (the pod's fsGroup is the runtime's group); nobody may write.
_SECRET_FILE_MODE = 0o440


@dataclass(frozen=True)
class SecretVolume:
    """A Secret mounted read-only: the pod's volume and where the container sees it."""

    volume: dict[str, Any]
    mount_path: str


def stage_keys_secret(
    name: str, namespace: str, uid: str, keys: Mapping[str, str]
) -> dict[str, Any]:
    """The Secret of pipeline ``name``'s stage keys (``stage_keys.generate_stage_keys``).

    Not among ``render``'s objects: its keys are random, so the reconciler creates it once
    and never applies it again (a new pair would lock out every pod running on the old
    one). Owned by the pipeline, so it goes with it; immutable, as nothing ever rewrites it.
    """
    return credentials_secret(
        name, namespace, uid, stage_keys_secret_name(name), COMPONENT_STAGE_KEYS, keys
    )


def credentials_secret(
    pipeline: str,
    namespace: str,
    uid: str,
    secret_name: str,
    component: str,
    data: Mapping[str, str],
) -> dict[str, Any]:
    """A Secret of credentials the reconciler makes once for ``pipeline``: owned by it (so
    it goes with it) and immutable (nothing ever rewrites it)."""
    labels = child_labels(pipeline, component)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(pipeline, namespace, uid, secret_name, labels),
        "type": "Opaque",
        "immutable": True,
        "stringData": dict(sorted(data.items())),
    }


def stage_keys_volume(ctx: RenderContext, files: Sequence[str]) -> SecretVolume:
    # Only the files of the pod's role: a stage pod cannot pose as a router, nor a router
    # pod as a stage.
    volume = {
        "name": "omni-stage-keys",
        "secret": {
            "secretName": stage_keys_secret_name(ctx.name),
            "items": [{"key": name, "path": name} for name in files],
            "defaultMode": _SECRET_FILE_MODE,
        },
    }
    return SecretVolume(volume, STAGE_KEYS_DIR)


def api_keys_volume(ref: SecretKeyRef) -> SecretVolume:
    # A whole volume, never a subPath: only then does the kubelet update the file when
    # the Secret changes, which is how a rotated key reaches the router.
    volume = {
        "name": "omni-api-keys",
        "secret": {
            "secretName": ref.name,
            "items": [{"key": ref.key, "path": API_KEYS_FILE}],
            "defaultMode": _SECRET_FILE_MODE,
        },
    }
    return SecretVolume(volume, API_KEYS_DIR)
