"""LoRA adapters: where an adapter's files come from, and which ones a replica holds.

A pipeline declares its adapters (``PipelineConfig.adapters``: a name, the stage it applies
to, a source, a scale); a request names one per stage at most, and the stage request
carries it as a :class:`~omni_runtime.engine.stage.stage_core_types.StageAdapter`. The stage
that runs the request resolves the source to local files here, once, and keeps at most
``maxLoras`` adapters loaded (:class:`AdapterLRU`), loading on first use.

Sources (``ADAPTER_SOURCE_FORMS``):

- an absolute path in the stage's pod: a directory (PEFT's ``adapter_config.json`` and
  ``adapter_model.safetensors``, which vLLM reads; a diffusion stage also takes a directory
  holding one ``.safetensors`` file) or one ``.safetensors`` file (diffusers' LoRA format,
  diffusion stages only). A PersistentVolumeClaim or an OCI image volume mounted into the
  pod is how a cluster gets them there;
- a hub id (``org/name``), fetched with the hub's client into its cache (``HF_HOME``);
- an ``https://`` URL of one ``.safetensors`` file (diffusion stages), fetched once into the
  stage's cache directory.

Standard library only at import time: the pipeline schema's rules (``omni_runtime.config``,
which the operator image runs) use the name and source checks.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections import OrderedDict
from pathlib import Path

from omni_runtime.paths import cache_dir

__all__ = [
    "ADAPTER_NAME_PATTERN",
    "ADAPTER_SOURCE_FORMS",
    "AdapterLRU",
    "AdapterSourceError",
    "adapter_cache_dir",
    "resolve_source",
    "source_issue",
]

# An adapter's name: what a request's ``model`` names (``<pipeline>:<adapter>``), so no ':'
# or '+' (which joins one adapter per stage), and a Prometheus label value as it is.
ADAPTER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_.]{0,62}[a-z0-9])?$"
ADAPTER_NAME_RULE = (
    "1-64 lower-case letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
)
ADAPTER_SOURCE_FORMS = (
    "an absolute path in the stage's pod (/models/loras/pixel-art), a hub id "
    "(org/name), or an https:// URL of one .safetensors file"
)
_HUB_ID = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*")
# A URL fetch gives up after this long without progress.
_FETCH_TIMEOUT_S = 60.0
_SAFETENSORS = ".safetensors"


class AdapterSourceError(ValueError):
    """An adapter's source that cannot be read: says which, and why."""


def source_issue(source: str) -> str | None:
    """Why ``source`` is not an adapter source (its form only: nothing is read), or None."""
    if source.startswith("/"):
        if "\x00" in source or "/../" in f"{source}/":
            return f"{source!r} is not a plain absolute path ('..' and NUL are refused)"
        return None
    if source.startswith(("https://", "http://")):
        url = urllib.parse.urlsplit(source)
        if url.scheme != "https":
            return f"{source!r}: fetch adapters over https, not {url.scheme}"
        if not url.hostname:
            return f"{source!r} has no host"
        if url.username or url.password:
            return f"{source!r} holds credentials, which would sit in the pipeline's ConfigMap"
        if not url.path.endswith(_SAFETENSORS):
            return f"{source!r}: a URL must name one {_SAFETENSORS} file"
        return None
    if _HUB_ID.fullmatch(source):
        return None
    return f"{source!r} is not {ADAPTER_SOURCE_FORMS}"


def is_url(source: str) -> bool:
    return source.startswith("https://")


def adapter_cache_dir() -> Path:
    """Where fetched adapters are kept: ``$OMNI_CACHE_DIR/adapters``."""
    return cache_dir() / "adapters"


def resolve_source(source: str, cache_dir: Path | None = None) -> Path:
    """The local path of ``source`` (a directory or a ``.safetensors`` file), fetching a hub
    id or a URL once. AdapterSourceError names the source and what was wrong; blocking I/O,
    so callers on an event loop run it in a thread."""
    issue = source_issue(source)
    if issue is not None:
        raise AdapterSourceError(issue)
    if source.startswith("/"):
        path = Path(source)
        if not path.exists():
            raise AdapterSourceError(f"{source}: no such file or directory in this pod")
        if path.is_file() and path.suffix != _SAFETENSORS:
            raise AdapterSourceError(
                f"{source}: an adapter file must be {_SAFETENSORS} (no pickled .bin files)"
            )
        return path
    if is_url(source):
        return _fetch_url(source, cache_dir or adapter_cache_dir())
    return _fetch_hub(source)


def _fetch_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        # Only the adapter's config and safetensors weights: never pickled .bin files.
        path = snapshot_download(repo_id, allow_patterns=["*.json", f"*{_SAFETENSORS}"])
    except Exception as e:  # the hub's client raises many kinds; all mean "not fetched"
        raise AdapterSourceError(f"{repo_id}: fetching it from the hub failed: {e}") from None
    return Path(path)


def _fetch_url(url: str, cache_dir: Path) -> Path:
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    name = Path(urllib.parse.urlsplit(url).path).name
    target = cache_dir / key / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its place and renamed: a fetch cut short never leaves a partial file
    # that a later load would read as the adapter.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".part")
    try:
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(  # https only: source_issue refuses other schemes
                url, timeout=_FETCH_TIMEOUT_S
            ) as answer,
        ):
            shutil.copyfileobj(answer, out, length=1 << 20)
        os.replace(partial, target)
    except OSError as e:
        Path(partial).unlink(missing_ok=True)
        raise AdapterSourceError(f"{url}: fetching it failed: {e}") from None
    return target


class AdapterLRU:
    """The names of the adapters a replica holds, least recently used first, at most
    ``capacity``: ``use`` says which to evict to make room for a new one."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least 1 adapter, not {capacity}")
        self.capacity = capacity
        self._names: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def names(self) -> list[str]:
        """The names held, least recently used first."""
        return list(self._names)

    def use(self, name: str) -> list[str]:
        """Mark ``name`` used (held from now on); the names to evict for it, oldest first,
        which are no longer held."""
        if name in self._names:
            self._names.move_to_end(name)
            return []
        evicted: list[str] = []
        while len(self._names) >= self.capacity:
            oldest, _ = self._names.popitem(last=False)
            evicted.append(oldest)
        self._names[name] = None
        return evicted

    def discard(self, name: str) -> bool:
        """Forget ``name`` (unloaded, or its load failed); whether it was held."""
        return self._names.pop(name, 0) is None
