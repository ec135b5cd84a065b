"""Kubernetes API access for the operator and the router, over the official ``kubernetes``
package.

The official client does the HTTP, TLS and authentication: kubeconfig client certificates
and tokens, exec credential plugins (``aws eks get-token``, ``gke-gcloud-auth-plugin``,
``kubelogin``) re-run when their credential expires, OIDC and GCP auth providers, and a
pod's service account, whose token file it re-reads as kubelet rotates it. What this module
adds is what the operator and the router need on top:

- ``load_kube_config``: where credentials come from ($KUBECONFIG, the pod, ~/.kube/config),
  and every way a configuration can be broken as a one-line ``KubeConfigError`` that names
  the file, found before the first request rather than at it;
- ``KubeClient``: asyncio calls on plain dicts by REST path (server-side apply of any
  manifest, no generated models). The official client is synchronous, so each call runs
  on the client's own small thread pool; a watch abandoned mid-read has its socket shut
  down, and ``close()`` returns only once no thread of the client is left;
- errors that carry the apiserver's Status message (``KubeApiError``), and 410 Gone as
  ``WatchExpired``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import urllib3
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.config.incluster_config import InClusterConfigLoader
from kubernetes.watch.watch import iter_resp_lines

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_LOADER_FILE = Path(k8s_config.kube_config.__file__).resolve()
CONNECT_TIMEOUT_S = 10.0

KIND_PLURALS: dict[str, str] = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Deployment": "deployments",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
    "EndpointSlice": "endpointslices",
    "Pod": "pods",
    "Event": "events",
    "OmniPipeline": "omnipipelines",
}

T = TypeVar("T")


class KubeConfigError(Exception):
    """No usable cluster credentials; the message (one line) says what is wrong and where."""

    def __init__(self, message: str) -> None:
        # Loader, YAML and plugin messages span lines; a CLI error must not.
        super().__init__(" ".join(message.split()))


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
    """Loaded credentials: the official client's Configuration, and where it came from."""

    configuration: Any  # kubernetes.client.Configuration
    source: str  # where this came from, for messages
    namespace: str | None = None
    # Loads the same source again: new exec plugin output, a rotated token file.
    reload: Callable[[], KubeConfig] | None = field(default=None, repr=False, compare=False)

    @property
    def server(self) -> str:
        host: str = self.configuration.host
        return host


def load_kube_config(
    kubeconfig: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConfig:
    """Credentials from ``kubeconfig``, else $KUBECONFIG (its files merged, as kubectl
    does), else the pod's service account, else ~/.kube/config. Blocks: an exec plugin
    runs here."""
    env = dict(os.environ if environ is None else environ)

    def again() -> KubeConfig:
        return load_kube_config(kubeconfig, environ=env, service_account_dir=service_account_dir)

    default = Path(env.get("HOME") or Path.home()) / ".kube" / "config"
    if kubeconfig:
        config = _from_kubeconfig([Path(kubeconfig).expanduser()], "the given kubeconfig")
    elif env.get("KUBECONFIG"):
        paths = [Path(p).expanduser() for p in env["KUBECONFIG"].split(os.pathsep) if p]
        config = _from_kubeconfig(paths, "$KUBECONFIG")
    elif env.get("KUBERNETES_SERVICE_HOST"):
        config = _in_cluster(env, service_account_dir)
    elif default.is_file():
        config = _from_kubeconfig([default], "the default kubeconfig")
    else:
        raise KubeConfigError(
            "no Kubernetes credentials: $KUBECONFIG is not set, $KUBERNETES_SERVICE_HOST is "
            f"not set (not in a pod), and {default} does not exist"
        )
    # Unreadable certificates fail here, not at the first request.
    _check_tls(config)
    return KubeConfig(config.configuration, config.source, config.namespace, reload=again)


def _in_cluster(env: Mapping[str, str], sa_dir: Path) -> KubeConfig:
    token, ca = sa_dir / "token", sa_dir / "ca.crt"
    source = f"in-cluster service account ({sa_dir})"
    if not token.is_file():
        raise KubeConfigError(
            f"in-cluster config: {token} is missing (is automountServiceAccountToken off?)"
        )
    if not ca.is_file():
        raise KubeConfigError(f"in-cluster config: {ca} is missing")
    configuration = k8s_client.Configuration()
    # The official loader re-reads the token file every minute (bound tokens rotate).
    loader = InClusterConfigLoader(
        token_filename=str(token),
        cert_filename=str(ca),
        try_refresh_token=True,
        environ={"KUBERNETES_SERVICE_PORT": "443", **env},
    )
    try:
        loader.load_and_set(configuration)
    except (k8s_config.ConfigException, OSError) as e:
        raise KubeConfigError(f"{source}: {e}") from None
    namespace_file = sa_dir / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    return KubeConfig(configuration, source, namespace or None)


def _from_kubeconfig(paths: list[Path], how: str) -> KubeConfig:
    readable: list[Path] = []
    problems: list[str] = []
    for path in paths:
        try:
            path.open("rb").close()
        except OSError as e:
            problems.append(f"{path}: {e.strerror}")
        else:
            readable.append(path)
    if not readable:
        if len(paths) == 1:
            raise KubeConfigError(
                f"cannot read kubeconfig {paths[0]} ({how}): {problems[0].split(': ', 1)[1]}"
            )
        raise KubeConfigError(f"cannot read any kubeconfig of {how}: {'; '.join(problems)}")
    files = os.pathsep.join(map(str, readable))
    where = f"kubeconfig {files} ({how})"
    configuration = k8s_client.Configuration()
    try:
        # Also checks current-context and the context it names, with the loader's words.
        _, current = k8s_config.list_kube_config_contexts(files)
        with _loader_errors() as errors:
            # persist_config: an auth provider's refreshed token goes back into the file,
            # as kubectl does (refresh tokens are often single-use).
            k8s_config.load_kube_config(
                config_file=files, client_configuration=configuration, persist_config=True
            )
    except (k8s_config.ConfigException, yaml.YAMLError, OSError, ValueError) as e:
        raise KubeConfigError(f"{where}: {_loader_message(e)}") from None
    except (KeyError, TypeError, AttributeError) as e:
        # The loader indexes sections it has not checked the shape of.
        raise KubeConfigError(f"{where}: malformed ({type(e).__name__}: {e})") from None
    context = (current or {}).get("context") or {}
    if errors:
        # The loader logs a failing exec plugin and carries on without credentials.
        said = "; ".join(e if e.startswith("exec") else f"exec: {e}" for e in errors)
        raise KubeConfigError(f"{where}: user {context.get('user')!r}: {said}")
    if not configuration.host:
        raise KubeConfigError(f"{where}: cluster {context.get('cluster')!r} has no server")
    return KubeConfig(configuration, where, context.get("namespace") or None)


@contextlib.contextmanager
def _loader_errors() -> Iterator[list[str]]:
    """Collects (and keeps off stderr) what the kubeconfig loader logs as errors."""
    errors: list[str] = []

    def capture(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and Path(record.pathname).resolve() == _LOADER_FILE:
            errors.append(record.getMessage())
            return False
        return True

    root = logging.getLogger()
    root.addFilter(capture)
    try:
        yield errors
    finally:
        root.removeFilter(capture)


def _loader_message(error: Exception) -> str:
    message = str(error)
    prefix = "Invalid kube-config file. "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _check_tls(config: KubeConfig) -> None:
    c = config.configuration
    if not str(c.host).startswith("https:"):
        return
    try:
        ctx = ssl.create_default_context(cafile=c.ssl_ca_cert)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise KubeConfigError(f"{config.source}: unusable certificate authority: {e}") from None
    if c.cert_file or c.key_file:
        if not (c.cert_file and c.key_file):
            raise KubeConfigError(f"{config.source}: a client certificate needs a client key")
        try:
            ctx.load_cert_chain(c.cert_file, c.key_file)
        except (ssl.SSLError, OSError) as e:
            raise KubeConfigError(
                f"{config.source}: unusable client certificate/key: {e}"
            ) from None


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
    """The official ApiClient behind asyncio methods; use ``async with`` or call ``close()``.

    ``max_workers`` bounds the calls in flight at once (each holds a thread and a pooled
    connection while it runs); a watch holds one for as long as it is followed.
    """

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0, max_workers: int = 16):
        self.config = config
        self.timeout = timeout
        self.max_workers = max_workers
        self._api = self._api_client(config)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="kube-client"
        )
        self._watches: set[Any] = set()  # urllib3 responses being read
        self._closed = False

    def _api_client(self, config: KubeConfig) -> Any:
        configuration = config.configuration
        # One pooled connection per worker: more would be dropped after each use.
        configuration.connection_pool_maxsize = self.max_workers
        return k8s_client.ApiClient(configuration)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Abandon open watches, wait for every call in flight, and drop the connections."""
        if self._closed:
            return
        self._closed = True
        for response in list(self._watches):
            _shutdown(response)
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._api.close()

    async def reload(self) -> KubeConfig:
        """Load the credentials again from where they came from (after a 401: an exec
        plugin's token revoked, a token file replaced); later calls use them."""
        if self.config.reload is None:
            return self.config
        config = await self._run(self.config.reload)
        previous, self._api = self._api, self._api_client(config)
        self.config = config
        # Calls under the old credentials were failing anyway (this follows a 401); its
        # connections go with it rather than staying open until exit.
        previous.close()
        return config

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("KubeClient is closed")
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: Any,
        content_type: str,
        timeout: tuple[float, float],
    ) -> Any:
        """The response (a urllib3 one, body unread) of a 2xx answer; KubeApiError else."""
        api = self._api
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        _, url, headers, _, _ = api.param_serialize(
            method,
            path,
            query_params=list((params or {}).items()),
            header_params=headers,
            auth_settings=["BearerToken"],
        )
        try:
            response = api.call_api(
                method, url, header_params=headers, body=body, _request_timeout=timeout
            ).response
        except k8s_client.ApiException as e:  # status 0: the TLS handshake failed
            raise KubeConnectionError(
                0, "ConnectionError", f"{self.config.server}: {e.reason}", method=method, path=path
            ) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise _connection_error(e, self.config.server, method, path) from None
        if response.status >= 400:
            raise _api_error(response, method, path)
        return response

    def _call(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: Any,
        content_type: str,
    ) -> Any:
        timeout = (CONNECT_TIMEOUT_S, self.timeout)
        response = self._send(method, path, params, body, content_type, timeout)
        try:
            data = response.data
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise _connection_error(e, self.config.server, method, path) from None
        finally:
            response.release_conn()
        try:
            return json.loads(data) if data else None
        except ValueError:
            raise KubeApiError(
                response.status,
                "BadResponse",
                f"not JSON: {data[:200]!r}",
                method=method,
                path=path,
            ) from None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        return await self._run(self._call, method, path, params, body, content_type)

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
            body=dict(obj),
            content_type="application/apply-patch+yaml",
        )
        return result

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create ``obj``; False, and nothing changed, if an object of its name exists.
        The created object is not returned: it may hold what the caller must not keep
        around (a Secret's data)."""
        collection = resource_path_for(obj).rsplit("/", 1)[0]
        try:
            await self.request("POST", collection, body=dict(obj))
        except KubeApiError as e:
            if e.status == 409:
                return False
            raise
        return True

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
            "PATCH", target, body=dict(body), content_type="application/merge-patch+json"
        )
        return result

    async def patch_strategic(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of a built-in kind: lists with a merge key (a pod's
        conditions, by type) are merged item by item, not replaced as a merge patch would."""
        result: dict[str, Any] = await self.request(
            "PATCH", path, body=dict(body), content_type="application/strategic-merge-patch+json"
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
        # A silent connection (bookmarks come about every minute) is a dead one.
        timeout = (CONNECT_TIMEOUT_S, float(timeout_seconds + 90))
        try:
            response = await self._run(self._send, "GET", path, params, None, "", timeout)
        except KubeApiError as e:
            if e.status == 410:
                raise WatchExpired(410, e.reason, e.message, method="GET", path=path) from None
            raise
        self._watches.add(response)
        lines = iter_resp_lines(response)
        reading: concurrent.futures.Future[str | None] | None = None
        try:
            while True:
                reading = self._pool.submit(next, lines, None)
                try:
                    line = await asyncio.wrap_future(reading)
                except (urllib3.exceptions.HTTPError, OSError) as e:
                    raise KubeConnectionError(
                        0, "ConnectionError", f"watch broke: {e!r}", method="GET", path=path
                    ) from e
                if line is None:
                    return
                if line.strip():
                    yield _watch_event(line, path)
        finally:
            self._watches.discard(response)
            if reading is not None and not reading.done():
                # Cancelled mid-read: unblock the thread, and close once it has let go.
                _shutdown(response)
                reading.add_done_callback(lambda _: response.close())
            else:
                response.close()


def _shutdown(response: Any) -> None:
    # Shutting the socket down (not closing it) wakes a thread blocked reading it.
    with contextlib.suppress(ValueError, RuntimeError, OSError):
        response.shutdown()


def _connection_error(error: Exception, server: str, method: str, path: str) -> KubeApiError:
    cause = getattr(error, "reason", None) or error  # MaxRetryError wraps the real one
    return KubeConnectionError(0, "ConnectionError", f"{server}: {cause}", method=method, path=path)


def _watch_event(line: str, path: str) -> tuple[str, dict[str, Any]]:
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


def _api_error(response: Any, method: str, path: str) -> KubeApiError:
    try:
        text = response.data.decode(errors="replace")
    except (urllib3.exceptions.HTTPError, OSError):
        text = ""
    finally:
        response.release_conn()
    reason, message = response.reason or "", text.strip()[:2000]
    try:
        status = json.loads(text)
        if isinstance(status, dict) and status.get("kind") == "Status":
            reason = status.get("reason") or reason
            message = status.get("message") or message
    except ValueError:
        pass
    return KubeApiError(response.status, reason, message, method=method, path=path)
