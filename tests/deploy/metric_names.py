"""The Prometheus series names Strata's code exports, read from its metric definitions, and the
metric names a PromQL expression refers to."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# prometheus_client's classes and the series each exposes beside the family's own name.
_SERIES_SUFFIXES = {
    "Counter": ("_total", "_created"),
    "CounterMetricFamily": ("_total", "_created"),
    "Gauge": ("",),
    "GaugeMetricFamily": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
    "Summary": ("_sum", "_count", "_created"),
    "SummaryMetricFamily": ("_sum", "_count"),
}


def exported_series() -> set[str]:
    """Every series name a metric defined in controlplane/ or worker/ (a literal name given to
    one of prometheus_client's classes) is exposed under."""
    names: set[str] = set()
    for package in ("controlplane", "worker"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                func = node.func
                kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                first = node.args[0]
                if kind in _SERIES_SUFFIXES and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    family = first.value.removesuffix("_total") if kind.startswith("Counter") else first.value
                    names.update(family + suffix for suffix in _SERIES_SUFFIXES[kind])
    return names


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGES = re.compile(r"\[[^\]]*\]")
_SELECTORS = re.compile(r"\{[^}]*\}")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PROMQL_WORDS = set(
    """
    sum min max avg count stddev stdvar topk bottomk quantile count_values
    rate irate increase delta idelta deriv changes resets histogram_quantile predict_linear
    abs ceil floor round clamp_min clamp_max absent vector scalar time label_replace label_join sort sort_desc
    max_over_time min_over_time avg_over_time sum_over_time count_over_time last_over_time
    and or unless bool offset inf nan
    """.split()
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label matchers,
    groupings, durations and numbers left out)."""
    text = _STRINGS.sub(" ", expr)
    text = _SELECTORS.sub(" ", _RANGES.sub(" ", _GROUPINGS.sub(" ", text)))
    return {word for word in _IDENTIFIER.findall(text) if word not in _PROMQL_WORDS and not word[0].isdigit()}
