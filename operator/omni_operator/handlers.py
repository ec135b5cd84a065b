"""The kopf handlers: when to converge a pipeline, and when to re-report its status.

Run with ``kopf run --standalone -m omni_operator.handlers --all-namespaces`` (or
``--namespace NS``); add ``--liveness=http://0.0.0.0:8080/healthz`` for a probe.

- An OmniPipeline created, changed (spec) or found at start-up is converged: rendered,
  applied with server-side apply, pruned, and its status written (reconciler.py).
- A watch on the Deployments the operator made keeps an index of them per pipeline; each
  change re-computes that pipeline's status (no polling).
- A child deleted by hand is put back, unless its pipeline is going away.
- Deleting a pipeline needs no handler: every child has an ownerReference to it, so the
  garbage collector removes them.
- One task runs the autoscaling planner of every pipeline with ``autoscaling`` every
  $OMNI_PLANNER_INTERVAL_SECONDS (15 by default; autoscaler.py).

Credentials are loaded once, by the official ``kubernetes`` client (omni_runtime.kube:
kubeconfig with exec plugins or OIDC, or the pod's service account), and kopf logs in with
the same ones (``login``), so that its watches and the operator's own calls never disagree
on who the operator is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

import httpx
import kopf

from omni_runtime.kube import (
    KubeApiError,
    KubeClient,
    KubeConfig,
    KubeConfigError,
    load_kube_config,
    object_path,
)

from .api import (
    API_VERSION,
    DEFAULT_RUNTIME_CUDA_IMAGE,
    DEFAULT_RUNTIME_IMAGE,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
)
from .autoscaler import DEFAULT_INTERVAL_S, Autoscaler
from .reconciler import EventSink, PipelineRef, Reconciler, refused_for_good
from .render.names import (
    CHILD_KINDS,
    COMPONENT_STAGES,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_PIPELINE,
    MANAGED_BY,
)

logger = logging.getLogger("omni_operator")

RUNTIME_IMAGE_ENV = "OMNI_RUNTIME_IMAGE"
# After an apiserver error that may pass (a conflict, throttling, an outage).
RETRY_DELAY_S = 5
RUNTIME_CUDA_IMAGE_ENV = "OMNI_RUNTIME_CUDA_IMAGE"
OPERATOR_NAMESPACE_ENV = "OMNI_OPERATOR_NAMESPACE"
PLANNER_INTERVAL_ENV = "OMNI_PLANNER_INTERVAL_SECONDS"
ANNOTATION_PREFIX = GROUP
_OURS = {LABEL_MANAGED_BY: MANAGED_BY}
_STAGE_PODS = {**_OURS, LABEL_COMPONENT: COMPONENT_STAGES}


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # kopf's bookkeeping goes in annotations under our own prefix, not its default one.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # The apiserver filters the watches of what the operator made (kopf's handler filters
    # alone would have every pod and Deployment of the cluster streamed to it).
    for kind in CHILD_KINDS:
        settings.watching.label_selectors[kind.plural] = _selector(_OURS)
    settings.watching.label_selectors["pods"] = _selector(_STAGE_PODS)
    logging.getLogger("kopf.objects").addFilter(_quiet_watch_handlers)
    # Our own Events say what was done; kopf's per-handler "succeeded" ones would be noise.
    settings.posting.level = logging.INFO
    settings.posting.loggers = False
    try:
        # Blocks (an exec plugin may run), and the loop is already kopf's.
        config = await asyncio.to_thread(load_kube_config)
    except KubeConfigError as e:
        # Retrying cannot fix a kubeconfig, and kopf would print a handler failure with two
        # tracebacks: exit with the message alone (it says which file and what is wrong).
        raise SystemExit(f"omni-operator: error: {e}") from None
    try:
        memo.planner_interval = planner_interval(os.environ)
    except ValueError as e:
        raise SystemExit(f"omni-operator: error: {e}") from None
    kube = KubeClient(config)
    memo.kube = kube
    memo.reconciler = Reconciler(
        kube=kube,
        default_image=os.environ.get(RUNTIME_IMAGE_ENV) or DEFAULT_RUNTIME_IMAGE,
        default_gpu_image=os.environ.get(RUNTIME_CUDA_IMAGE_ENV) or DEFAULT_RUNTIME_CUDA_IMAGE,
        operator_namespace=os.environ.get(OPERATOR_NAMESPACE_ENV) or None,
    )
    # No proxy from the environment: routers are pod IPs inside the cluster.
    memo.autoscaler = Autoscaler(kube=kube, http=httpx.AsyncClient(trust_env=False))
    memo.planner = asyncio.create_task(
        run_planner(memo.reconciler, memo.autoscaler, memo.planner_interval), name="planner"
    )


def planner_interval(env: Mapping[str, str]) -> float:
    """Seconds between the planner's looks, from $OMNI_PLANNER_INTERVAL_SECONDS."""
    raw = env.get(PLANNER_INTERVAL_ENV)
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0.1 <= value <= 600:
        raise ValueError(
            f"${PLANNER_INTERVAL_ENV}={raw!r}: give the seconds between the planner's looks, "
            "from 0.1 to 600 (default 15)"
        )
    return value


_WATCH_HANDLER_SUCCEEDED = re.compile(
    r"Handler '(stage_pod_changed|deployment_changed|pipeline_gone|[A-Za-z]+-deleted)' "
    r"succeeded\."
)


def _quiet_watch_handlers(record: logging.LogRecord) -> bool:
    """Drops kopf's "Handler ... succeeded." of the handlers that run on every watch event
    (each pod's every status change): one line per event says nothing. Their failures,
    and every other handler's lines, are kept."""
    return not _WATCH_HANDLER_SUCCEEDED.fullmatch(record.getMessage())


@kopf.on.cleanup()
async def stop(memo: Any, **_: Any) -> None:
    planner: asyncio.Task[None] | None = getattr(memo, "planner", None)
    if planner is not None:
        planner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await planner
    kube: KubeClient | None = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()
    autoscaler: Autoscaler | None = getattr(memo, "autoscaler", None)
    if autoscaler is not None:
        await autoscaler.http.aclose()


@kopf.on.login()
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials: those the operator's client loaded at startup (startup runs
    before the first login). kopf asks again only after the apiserver refused them (401),
    and then both load afresh: an exec plugin runs again, a token file is read again."""
    kube: KubeClient = memo.kube
    try:
        config = await kube.reload() if getattr(memo, "logged_in", False) else kube.config
    except KubeConfigError as e:
        raise kopf.PermanentError(str(e)) from None
    memo.logged_in = True
    return await asyncio.to_thread(connection_info, config)


def connection_info(config: KubeConfig) -> kopf.ConnectionInfo:
    """What kopf's own client needs of the official client's configuration. Blocks: a
    token due for renewal (an exec plugin's, a rotated service-account one) is renewed."""
    c = config.configuration
    # Either name holds the token, depending on the client version that loaded it.
    header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization")
    scheme, _, token = str(header or "").partition(" ")
    if not token:  # a bare token, no scheme
        scheme, token = "", scheme
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert or None,
        insecure=not c.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=c.cert_file or None,
        private_key_path=c.key_file or None,
        default_namespace=config.namespace,
        proxy_url=c.proxy or None,
    )


@kopf.index("apps", "v1", "deployments", labels=_OURS)
def deployments_by_pipeline(
    namespace: str | None, name: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, pipeline) -> the Deployment's name, labels, replicas and status."""
    return _by_pipeline(
        namespace,
        labels,
        {
            "metadata": {
                "name": name,
                "labels": dict(labels),
                "generation": body.metadata.get("generation", 0),
            },
            "spec": {"replicas": body.spec.get("replicas", 1)},
            "status": dict(body.status),
        },
    )


@kopf.index("", "v1", "pods", labels=_STAGE_PODS)
def stage_pods_by_pipeline(
    namespace: str | None, name: str, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, pipeline) -> what the readiness gate needs of each stage pod."""
    return _by_pipeline(
        namespace,
        labels,
        {
            "metadata": {
                "name": name,
                "labels": dict(labels),
                "annotations": dict(body.metadata.annotations),
                "deletionTimestamp": body.metadata.get("deletionTimestamp"),
            },
            "status": {"conditions": list(body.status.get("conditions") or [])},
        },
    )


def _by_pipeline(
    namespace: str | None, labels: Mapping[str, str], summary: dict[str, Any]
) -> dict[tuple[str, str], dict[str, Any]]:
    """An index entry: ``summary`` under the object's (namespace, pipeline), if it has one."""
    pipeline = labels.get(LABEL_PIPELINE)
    if not pipeline or namespace is None:
        return {}
    return {(namespace, pipeline): summary}


@kopf.on.event("", "v1", "pods", labels=_STAGE_PODS)
async def stage_pod_changed(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **kwargs: Any
) -> None:
    pipeline = labels.get(LABEL_PIPELINE)
    if not pipeline or namespace is None:
        return
    reconciler: Reconciler = memo.reconciler
    ref = reconciler.known(namespace, pipeline)
    if ref is not None:
        await _release(reconciler, ref, kwargs)


async def _release(reconciler: Reconciler, ref: PipelineRef, kwargs: Mapping[str, Any]) -> None:
    """Open the readiness gate of ``ref``'s pods if their revision is whole; kwargs are a
    handler's (kopf passes each index as a keyword argument named after its function)."""
    index: kopf.Index[tuple[str, str], dict[str, Any]] = kwargs["stage_pods_by_pipeline"]
    pods = list(index.get((ref.namespace, ref.name), []))
    try:
        await reconciler.release_revision(ref, pods, _events(_pipeline_body(ref)))
    except KubeApiError as e:
        # The next change of any of its pods tries again; so does the next converge.
        logger.warning("%s/%s: releasing pods: %s", ref.namespace, ref.name, e)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def converge(
    body: kopf.Body,
    name: str,
    namespace: str | None,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: Any,
    **kwargs: Any,
) -> None:
    assert namespace is not None  # OmniPipelines are namespaced
    reconciler: Reconciler = memo.reconciler
    ref = PipelineRef(name, namespace, uid, int(body.metadata.get("generation", 0)))
    try:
        await reconciler.converge(ref, spec, status, _events(body))
    except KubeApiError as e:
        if refused_for_good(e):
            # The status says why; a new spec (an update) is what can fix it.
            raise kopf.PermanentError(str(e)) from None
        raise kopf.TemporaryError(str(e), delay=RETRY_DELAY_S) from None
    # Pods that became ready while the operator was away (or before this spec was
    # applied) send no event of their own any more.
    await _release(reconciler, ref, kwargs)


@kopf.on.event(GROUP, VERSION, PLURAL)
def pipeline_gone(
    event: kopf.RawEvent, name: str, namespace: str | None, memo: Any, **_: Any
) -> None:
    if event.get("type") == "DELETED" and namespace is not None:
        reconciler: Reconciler = memo.reconciler
        reconciler.forget(namespace, name)
        autoscaler: Autoscaler = memo.autoscaler
        autoscaler.forget(namespace, name)


async def run_planner(reconciler: Reconciler, autoscaler: Autoscaler, interval: float) -> None:
    """The autoscaling planner, for every pipeline with autoscaling, every ``interval``
    seconds, for the operator's life. One task of the operator's own rather than a kopf
    daemon or timer per pipeline: those put a finalizer on every pipeline, which would
    block its deletion whenever the operator is down."""
    while True:
        await asyncio.sleep(interval)
        refs = [ref for ref in reconciler.known_refs() if reconciler.autoscaled(ref)]
        await asyncio.gather(*(_plan_pipeline(reconciler, autoscaler, ref) for ref in refs))


async def _plan_pipeline(reconciler: Reconciler, autoscaler: Autoscaler, ref: PipelineRef) -> None:
    spec = reconciler.applied_spec(ref.namespace, ref.name)
    if spec is None:
        return
    events = _api_events(autoscaler.kube, ref)
    try:
        async with reconciler.replicas_lock(ref):
            deployments = await reconciler.deployments(ref)
            result = await autoscaler.tick(ref.namespace, ref.name, spec, deployments, events)
        reconciler.set_scaling(ref, result.stages, result.scaled_up_from, result.scaled_generations)
        await reconciler.report(ref, deployments, None, events)
    except KubeApiError as e:
        # The next look tries again; an Event named a failed scale.
        logger.warning("%s/%s: autoscaling: %s", ref.namespace, ref.name, e)
    except Exception:
        # One pipeline's surprise must not stop the planner of every other.
        logger.exception("%s/%s: autoscaling failed", ref.namespace, ref.name)


@kopf.on.event("apps", "v1", "deployments", labels=_OURS)
async def deployment_changed(
    event: kopf.RawEvent,
    namespace: str | None,
    labels: Mapping[str, str],
    memo: Any,
    **kwargs: Any,
) -> None:
    # kopf passes each index as a keyword argument named after its function.
    index: kopf.Index[tuple[str, str], dict[str, Any]] = kwargs["deployments_by_pipeline"]
    pipeline = labels.get(LABEL_PIPELINE)
    if not pipeline or namespace is None:
        return
    reconciler: Reconciler = memo.reconciler
    ref = reconciler.known(namespace, pipeline)
    if ref is None:
        return
    store: Iterable[dict[str, Any]] = index.get((namespace, pipeline), [])
    deployments = {item["metadata"]["name"]: item for item in store}
    await reconciler.report(ref, deployments, None, _events(_pipeline_body(ref)))
    if event.get("type") == "DELETED":
        await _put_back(reconciler, ref)


def _child_deleted(kind: str) -> Any:
    async def handler(
        event: kopf.RawEvent,
        namespace: str | None,
        labels: Mapping[str, str],
        memo: Any,
        **_: Any,
    ) -> None:
        if event.get("type") != "DELETED" or not labels.get(LABEL_PIPELINE) or namespace is None:
            return
        reconciler: Reconciler = memo.reconciler
        ref = reconciler.known(namespace, labels[LABEL_PIPELINE])
        if ref is not None:
            await _put_back(reconciler, ref)

    handler.__name__ = f"{kind.lower()}_deleted"
    return handler


for _kind in CHILD_KINDS:
    if _kind.kind == "Deployment":
        continue
    _group, _, _version = _kind.api_version.rpartition("/")
    kopf.on.event(_group, _version, _kind.plural, labels=_OURS, id=f"{_kind.kind}-deleted")(
        _child_deleted(_kind.kind)
    )


async def _put_back(reconciler: Reconciler, ref: PipelineRef) -> None:
    """Converge again after a child was deleted, unless the pipeline itself is going."""
    if not await reconciler.still_wants(ref.namespace, ref.name, ref.uid):
        return
    await reconciler.reconverge(ref, _events(_pipeline_body(ref)))


def _pipeline_body(ref: PipelineRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
    }


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def _events(body: Mapping[str, Any]) -> EventSink:
    def post(type_: str, reason: str, message: str) -> None:
        log = logger.warning if type_ == "Warning" else logger.info
        meta = body.get("metadata", {})
        log("%s/%s: %s: %s", meta.get("namespace"), meta.get("name"), reason, message)
        if type_ == "Warning":
            kopf.warn(kopf.Body(cast(kopf.RawBody, dict(body))), reason=reason, message=message)
        else:
            kopf.info(kopf.Body(cast(kopf.RawBody, dict(body))), reason=reason, message=message)

    return post


# Events posted outside kopf's handlers (kopf.info works only within them), kept
# referenced until sent.
_posting: set[asyncio.Task[None]] = set()
EVENT_MESSAGE_LIMIT = 1024


def _api_events(kube: KubeClient, ref: PipelineRef) -> EventSink:
    """An EventSink for the planner's task: each Event is created through the API, as
    kopf's are, in a task of its own; a failure is logged, never raised."""

    def post(type_: str, reason: str, message: str) -> None:
        log = logger.warning if type_ == "Warning" else logger.info
        log("%s/%s: %s: %s", ref.namespace, ref.name, reason, message)
        task = asyncio.get_running_loop().create_task(
            _post_event(kube, ref, type_, reason, message)
        )
        _posting.add(task)
        task.add_done_callback(_posting.discard)

    return post


async def _post_event(
    kube: KubeClient, ref: PipelineRef, type_: str, reason: str, message: str
) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
        },
        "type": type_,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": MANAGED_BY},
        "reportingComponent": MANAGED_BY,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await kube.request("POST", object_path("v1", "events", ref.namespace), body=body)
    except KubeApiError as e:
        logger.warning("%s/%s: posting Event %s: %s", ref.namespace, ref.name, reason, e)


@kopf.on.probe(id="pipelines")
def pipelines_known(memo: Any, **_: Any) -> int:
    """The liveness endpoint's payload: how many pipelines this operator converges."""
    reconciler: Reconciler | None = getattr(memo, "reconciler", None)
    return reconciler.count() if reconciler is not None else 0
