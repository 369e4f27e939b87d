"""/v1/strata/blend, answered alike by both node servers (Strata's own engine server and the status
server beside vLLM), behind the node's admin key: GET reports fragment reuse (the settings, the
counters, every namespace's r and mode), POST takes an operator's decision for one namespace:
{namespace, percent} sets r and resumes blending, {namespace, reset: true} returns it to its
configured r with its history forgotten. A bad field is answered 400 naming it; a node with
fragment reuse off, 409."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from worker.dataplane.blend.options import BlendError, BlendOptions, check_namespace_key, check_percent
from worker.dataplane.blend.tuner import BlendTuner

PATH = "/v1/strata/blend"


def _refused(status: HTTPStatus, message: str, param: str) -> tuple[HTTPStatus, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def control(
    body: Mapping[str, Any], *, node: str, model: str, tuner: BlendTuner | None
) -> tuple[HTTPStatus, dict[str, Any]]:
    """The status and JSON body answering an operator's POST (the caller has checked the admin key)."""
    unknown = sorted(set(body) - {"namespace", "percent", "reset"})
    if unknown:
        return _refused(
            HTTPStatus.BAD_REQUEST,
            f"unknown field(s) {', '.join(unknown)}; expected namespace and percent, or namespace and reset",
            unknown[0],
        )
    namespace = body.get("namespace")
    if not isinstance(namespace, str):
        return _refused(HTTPStatus.BAD_REQUEST, "namespace is required (a namespace name)", "namespace")
    try:
        check_namespace_key("namespace", namespace)
    except BlendError as exc:
        return _refused(HTTPStatus.BAD_REQUEST, str(exc), "namespace")
    if "/" in namespace:
        return _refused(
            HTTPStatus.BAD_REQUEST, "namespace: a namespace of this node's model, without a model name", "namespace"
        )
    reset = body.get("reset", False)
    if not isinstance(reset, bool):
        return _refused(HTTPStatus.BAD_REQUEST, f"reset must be true or false, got {reset!r}", "reset")
    if reset == ("percent" in body):
        return _refused(
            HTTPStatus.BAD_REQUEST,
            "give either percent (the new r) or reset: true, not both or neither",
            "percent" if not reset else "reset",
        )
    if tuner is None:
        return _refused(HTTPStatus.CONFLICT, "fragment reuse is off on this node (STRATA_BLEND)", "namespace")
    if reset:
        state = tuner.reset(namespace)
    else:
        try:
            percent = check_percent("percent", body["percent"])
        except BlendError as exc:
            return _refused(HTTPStatus.BAD_REQUEST, str(exc), "percent")
        state = tuner.set_percent(namespace, percent)
    return HTTPStatus.OK, {"node": node, "model": model, "namespace": namespace, **state}


def report(
    *, node: str, model: str, tuner: BlendTuner | None, options: BlendOptions, counts: Mapping[str, int]
) -> dict[str, Any]:
    """Fragment reuse of a node: settings, counters, and the state of every namespace."""
    prefix = counts.get("reused_tokens.prefix", 0)
    fragment = counts.get("reused_tokens.fragment", 0)
    return {
        "node": node,
        "model": model,
        "enabled": tuner is not None,
        "default_recompute_percent": options.model_default(model),
        "settings": {
            "recompute_percent": options.recompute_percent,
            "namespace_percent": dict(options.namespace_percent),
            "model_percent": dict(options.model_percent),
            "selection": options.selection,
            "check_layer": options.check_layer,
            "sample_rate": options.sample_rate,
            "agreement_threshold": options.agreement_threshold,
            "max_kl": options.max_kl,
            "min_samples": options.min_samples,
            "raise_step_percent": options.raise_step_percent,
            "max_percent": options.max_percent,
            "min_fragment_blocks": options.min_fragment_blocks,
            "reprobe_seconds": options.reprobe_seconds,
        },
        "reused_tokens": {"prefix": prefix, "fragment": fragment},
        "recomputed_tokens": counts.get("blend.recomputed_tokens", 0),
        "recompute_ratio": counts.get("blend.recomputed_tokens", 0) / fragment if fragment else 0.0,
        "requests": counts.get("blend.requests", 0),
        "failures": counts.get("blend.failures", 0),
        "quality_samples": {
            result: counts.get(f"blend.samples_{result}", 0) for result in ("agreed", "disagreed", "dropped")
        },
        "adjustments": {
            "raised": counts.get("blend.ratio_raised", 0),
            "fallback": counts.get("blend.fallbacks", 0),
            "reprobe": counts.get("blend.reprobes", 0),
            "operator": counts.get("blend.operator_changes", 0),
        },
        "namespaces": tuner.snapshot() if tuner is not None else {},
    }
