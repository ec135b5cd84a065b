"""A small async Kubernetes API client over aiohttp, for the operator and the router.

Only what they need: get/list/delete, server-side apply, merge patches and watches, with
errors that carry the apiserver's own message. Credentials come from a kubeconfig or a
pod's service account (``load_kube_config``); exec plugins and auth providers are not
supported (say so rather than fail obscurely).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import ssl
import tempfile
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Bound service-account tokens rotate (kubelet refreshes the file well before expiry).
TOKEN_REREAD_SECONDS = 60.0

KIND_PLURALS: dict[str, str] = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Deployment": "deployments",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "EndpointSlice": "endpointslices",
    "Pod": "pods",
    "Event": "events",
    "OmniPipeline": "omnipipelines",
}


class KubeConfigError(Exception):
    """No usable cluster credentials; the message says what is missing and where we looked."""


class KubeApiError(Exception):
    """An API call that failed: the HTTP status, the Status reason and the apiserver's message.

    ``status`` 0 (KubeConnectionError) means the apiserver could not be reached at all.
    """

    def __init__(self, status: int, reason: str, message: str, *, method: str, path: str):
        self.status = status
        self.reason = reason
        self.message = message
        self.method = method
        self.path = path
        super().__init__(f"{method} {path}: {status} {reason}: {message}")


class KubeConnectionError(KubeApiError):
    """The apiserver could not be reached, or the connection broke mid-response."""


class WatchExpired(KubeApiError):
    """The watch's resourceVersion is too old (410 Gone): list again, then watch from there."""


@dataclass(frozen=True)
class KubeConfig:
    server: str
    source: str  # where this came from, for messages
    namespace: str | None = None
    ca_file: str | None = None
    ca_data: bytes | None = None
    client_cert_file: str | None = None
    client_cert_data: bytes | None = None
    client_key_file: str | None = None
    client_key_data: bytes | None = None
    token: str | None = None
    token_file: str | None = None  # re-read: bound tokens rotate
    insecure_skip_tls_verify: bool = False

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.server.startswith("https:"):
            return None
        try:
            ctx = ssl.create_default_context(
                cafile=self.ca_file, cadata=self.ca_data.decode() if self.ca_data else None
            )
        except (ssl.SSLError, OSError, ValueError) as e:
            raise KubeConfigError(f"{self.source}: unusable certificate authority: {e}") from e
        if self.insecure_skip_tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.client_cert_file or self.client_cert_data:
            _load_client_cert(ctx, self)
        return ctx

    def read_token(self) -> str | None:
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip()
            except OSError as e:
                raise KubeConfigError(f"cannot read token file {self.token_file}: {e}") from None
        return self.token


def _load_client_cert(ctx: ssl.SSLContext, config: KubeConfig) -> None:
    # ssl only loads certificates from files: inline data goes through a private temp dir.
    with tempfile.TemporaryDirectory(prefix="omni-kube-") as tmp:
        cert, key = config.client_cert_file, config.client_key_file
        if config.client_cert_data is not None:
            cert = os.path.join(tmp, "client.crt")
            Path(cert).write_bytes(config.client_cert_data)
        if config.client_key_data is not None:
            key = os.path.join(tmp, "client.key")
            Path(key).write_bytes(config.client_key_data)
        if cert is None or key is None:
            raise KubeConfigError(f"{config.source}: a client certificate needs a client key")
        try:
            ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise KubeConfigError(f"{config.source}: unusable client certificate/key: {e}") from e


def load_kube_config(
    kubeconfig: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """Credentials from ``kubeconfig``, else $KUBECONFIG (its first entry), else the pod's
    service account, else ~/.kube/config."""
    env = os.environ if environ is None else environ
    default = Path(env.get("HOME") or Path.home()) / ".kube" / "config"
    if kubeconfig:
        config = _from_kubeconfig(Path(kubeconfig).expanduser(), "the given kubeconfig")
    elif env.get("KUBECONFIG"):
        first = env["KUBECONFIG"].split(os.pathsep)[0]
        config = _from_kubeconfig(Path(first).expanduser(), "$KUBECONFIG")
    elif env.get("KUBERNETES_SERVICE_HOST"):
        config = _in_cluster(env, service_account_dir)
    elif default.is_file():
        config = _from_kubeconfig(default, "the default kubeconfig")
    else:
        raise KubeConfigError(
            "no Kubernetes credentials: $KUBECONFIG is not set, $KUBERNETES_SERVICE_HOST is "
            f"not set (not in a pod), and {default} does not exist"
        )
    # Unreadable certificates or token files fail here, not at the first request.
    config.ssl_context()
    config.read_token()
    return config


def _in_cluster(env: Mapping[str, str], sa_dir: Path) -> KubeConfig:
    host, port = env["KUBERNETES_SERVICE_HOST"], env.get("KUBERNETES_SERVICE_PORT", "443")
    token, ca = sa_dir / "token", sa_dir / "ca.crt"
    if not token.is_file():
        raise KubeConfigError(
            f"in-cluster config: {token} is missing (is automountServiceAccountToken off?)"
        )
    if not ca.is_file():
        raise KubeConfigError(f"in-cluster config: {ca} is missing")
    namespace_file = sa_dir / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    return KubeConfig(
        server=f"https://{f'[{host}]' if ':' in host else host}:{port}",
        source=f"in-cluster service account ({sa_dir})",
        namespace=namespace,
        ca_file=str(ca),
        token_file=str(token),
    )


def _from_kubeconfig(path: Path, how: str) -> KubeConfig:
    where = f"{path} ({how})"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise KubeConfigError(f"cannot read kubeconfig {where}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise KubeConfigError(f"kubeconfig {where} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise KubeConfigError(f"kubeconfig {where}: expected a mapping at the top")
    current = data.get("current-context")
    if not current:
        raise KubeConfigError(f"kubeconfig {where}: no current-context")
    context = _named(data, "contexts", "context", current, where)
    cluster = _named(data, "clusters", "cluster", context.get("cluster"), where)
    user = _named(data, "users", "user", context["user"], where) if context.get("user") else {}
    if not cluster.get("server"):
        raise KubeConfigError(f"kubeconfig {where}: cluster {context['cluster']!r} has no server")
    for unsupported in ("exec", "auth-provider"):
        if unsupported in user:
            raise KubeConfigError(
                f"kubeconfig {where}: user {context['user']!r} uses {unsupported}, which this "
                "client does not support; use a token or a client certificate"
            )
    base = path.parent

    def file(section: dict[str, Any], key: str) -> str | None:
        value = section.get(key)
        return str(base / str(value)) if value else None

    def blob(section: dict[str, Any], key: str) -> bytes | None:
        value = section.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except binascii.Error:
            raise KubeConfigError(f"kubeconfig {where}: {key} is not valid base64") from None

    return KubeConfig(
        server=str(cluster["server"]).rstrip("/"),
        source=where,
        namespace=context.get("namespace"),
        ca_file=file(cluster, "certificate-authority"),
        ca_data=blob(cluster, "certificate-authority-data"),
        client_cert_file=file(user, "client-certificate"),
        client_cert_data=blob(user, "client-certificate-data"),
        client_key_file=file(user, "client-key"),
        client_key_data=blob(user, "client-key-data"),
        token=user.get("token"),
        token_file=file(user, "tokenFile"),
        insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
    )


def _named(data: dict[str, Any], section: str, key: str, name: Any, where: str) -> dict[str, Any]:
    for entry in data.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if isinstance(value, dict):
                return value
    known = ", ".join(str(e.get("name")) for e in data.get(section) or [] if isinstance(e, dict))
    raise KubeConfigError(
        f"kubeconfig {where}: no {key} named {name!r} in {section} (has: {known or 'none'})"
    )


def object_path(
    api_version: str,
    plural: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection (no name) or object; namespace None: cluster-scoped."""
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
    return path


def resource_path_for(obj: Mapping[str, Any]) -> str:
    """The REST path of a manifest (apiVersion, kind, metadata.name/namespace)."""
    kind = obj.get("kind", "")
    plural = KIND_PLURALS.get(kind)
    if plural is None:
        raise ValueError(
            f"kind {kind!r} is not one this client knows; known: {sorted(KIND_PLURALS)}"
        )
    metadata = obj.get("metadata") or {}
    if not metadata.get("name") or not metadata.get("namespace"):
        raise ValueError(f"{kind}: metadata.name and metadata.namespace are required")
    return object_path(obj["apiVersion"], plural, metadata["namespace"], metadata["name"])


class KubeClient:
    """One aiohttp session to the apiserver; use ``async with`` or call ``close()``."""

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0) -> None:
        self.config = config
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._token_read_at = -float("inf")

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            ctx = self.config.ssl_context()
            connector = aiohttp.TCPConnector(ssl=ctx if ctx is not None else False)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def _headers(self, content_type: str | None, *, fresh_token: bool = False) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        now = time.monotonic()
        if fresh_token or now - self._token_read_at > TOKEN_REREAD_SECONDS:
            self._token, self._token_read_at = self.config.read_token(), now
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    async def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: Any,
        content_type: str,
        timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(2):
            try:
                response = await self._get_session().request(
                    method,
                    self.config.server + path,
                    params=params,
                    data=data,
                    headers=self._headers(
                        content_type if data is not None else None, fresh_token=attempt > 0
                    ),
                    timeout=timeout,
                )
            except (aiohttp.ClientError, TimeoutError) as e:
                raise KubeConnectionError(
                    0, "ConnectionError", f"{self.config.server}: {e!r}", method=method, path=path
                ) from e
            # A rotated token answers 401 until we read the new one.
            if response.status == 401 and attempt == 0 and self.config.token_file:
                response.release()
                continue
            if response.status >= 400:
                raise await _api_error(response, method, path)
            return response
        raise AssertionError("unreachable")

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        response = await self._send(method, path, params, body, content_type, timeout)
        async with response:
            try:
                return await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise KubeConnectionError(
                    0, "ConnectionError", repr(e), method=method, path=path
                ) from e

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self.request("GET", path)
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise
        return result

    async def list(self, path: str, *, label_selector: str | None = None) -> dict[str, Any]:
        params = {"labelSelector": label_selector} if label_selector else None
        result: dict[str, Any] = await self.request("GET", path, params=params)
        return result

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True
    ) -> dict[str, Any]:
        """Server-side apply ``obj`` (JSON is YAML, which apply-patch+yaml takes)."""
        params = {"fieldManager": field_manager, **({"force": "true"} if force else {})}
        result: dict[str, Any] = await self.request(
            "PATCH",
            resource_path_for(obj),
            params=params,
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        return result

    async def delete(self, path: str, *, propagation: str = "Background") -> bool:
        """Delete; False if it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        try:
            await self.request("DELETE", path, body=body)
        except KubeApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def patch_merge(
        self, path: str, body: Mapping[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        target = f"{path}/{subresource}" if subresource else path
        result: dict[str, Any] = await self.request(
            "PATCH", target, body=body, content_type="application/merge-patch+json"
        )
        return result

    async def watch(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        resource_version: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(type, object) per event (ADDED, MODIFIED, DELETED, BOOKMARK) until the server
        ends the watch; WatchExpired when ``resource_version`` is too old."""
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        if resource_version:
            params["resourceVersion"] = resource_version
        # No total timeout; a silent connection (bookmarks come about every minute) is dead.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 90)
        try:
            response = await self._send("GET", path, params, None, "", timeout)
        except KubeApiError as e:
            if e.status == 410:
                raise WatchExpired(410, e.reason, e.message, method="GET", path=path) from None
            raise
        async with response:
            buffer = b""
            try:
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield _watch_event(line, path)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise KubeConnectionError(
                    0, "ConnectionError", f"watch broke: {e!r}", method="GET", path=path
                ) from e
            if buffer.strip():
                yield _watch_event(buffer, path)


def _watch_event(line: bytes, path: str) -> tuple[str, dict[str, Any]]:
    try:
        event = json.loads(line)
        kind, obj = event.get("type", ""), event.get("object") or {}
    except (ValueError, AttributeError):
        raise KubeApiError(
            0, "BadWatchEvent", f"not a watch event: {line[:200]!r}", method="GET", path=path
        ) from None
    if kind == "ERROR":
        code = int(obj.get("code") or 500)
        error = WatchExpired if code == 410 else KubeApiError
        raise error(code, obj.get("reason", ""), obj.get("message", ""), method="GET", path=path)
    return kind, obj


async def _api_error(response: aiohttp.ClientResponse, method: str, path: str) -> KubeApiError:
    async with response:
        try:
            text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            text = ""
    reason, message = response.reason or "", text.strip()[:2000]
    try:
        status = json.loads(text)
        if isinstance(status, dict) and status.get("kind") == "Status":
            reason = status.get("reason") or reason
            message = status.get("message") or message
    except ValueError:
        pass
    return KubeApiError(response.status, reason, message, method=method, path=path)
