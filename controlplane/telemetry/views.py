"""Health and metrics endpoints: /livez, /readyz, /metrics."""

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST

from controlplane.directory.choices import NodeState
from controlplane.directory.models import Node
from controlplane.telemetry.health import readiness
from controlplane.telemetry.metrics import READINESS_FAILURES, render_metrics


@never_cache
@require_GET
def livez(request: HttpRequest) -> HttpResponse:
    """The process answers; no dependency is checked."""
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request: HttpRequest) -> HttpResponse:
    """Database, Redis and migrations: 200 when all pass, else 503 naming what failed."""
    results = readiness()
    failed = {name: problem for name, problem in results.items() if problem}
    for name in failed:
        READINESS_FAILURES.labels(check=name).inc()
    if failed:
        return JsonResponse({"status": "unavailable", "failed": failed}, status=503)
    return JsonResponse({"status": "ok", "checks": sorted(results)})


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE_LATEST)


@never_cache
@require_GET
def prometheus_nodes(request: HttpRequest) -> HttpResponse:
    """Prometheus HTTP service discovery: the Strata endpoints of every node that is not down, and
    the engine's own server where it is not Strata's (vLLM's /metrics), labelled with the node's
    name (the engine's with `exporter` too), so a new node is scraped without editing prometheus.yml."""
    nodes = Node.objects.exclude(address="").exclude(state=NodeState.DOWN).order_by("name")
    targets = [{"targets": [node.address], "labels": {"node": node.name}} for node in nodes]
    targets += [
        {"targets": [node.engine_address], "labels": {"node": node.name, "exporter": node.engine}}
        for node in nodes
        if node.engine_address
    ]
    return JsonResponse(targets, safe=False)
