"""Admission metrics, a metric source for :class:`gpud.metrics.Collector`::

    gpud_admission_queue_length{feasibility}          queued jobs: quotable / unfeasible
    gpud_admission_wait_seconds                       histogram of waits, runs started since gpud started
    gpud_admission_quote_error_seconds                mean of (observed - quoted) wait over
                                                      the window's queued runs
    gpud_admission_quote_error_runs                   queued runs that mean is over
    gpud_admission_littles_law_residual_ratio         |L - lambda W| / L since gpud started

A positive quote error means waits ran longer than quoted (the quotes are meant to err the
other way).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from gpud.admission.service import AdmissionService
from gpud.metrics import histogram_family


class AdmissionMetrics:
    """``collector.add_source(AdmissionMetrics(service))``."""

    def __init__(self, service: AdmissionService) -> None:
        self._service = service

    def __call__(self) -> Iterator[Metric]:
        length = GaugeMetricFamily(
            "gpud_admission_queue_length", "Jobs in the admission queue.", labels=("feasibility",)
        )
        quotable, unfeasible = self._service.lengths()
        length.add_metric(["quotable"], float(quotable))
        length.add_metric(["unfeasible"], float(unfeasible))
        yield length
        yield histogram_family(
            "gpud_admission_wait_seconds",
            "Time from asking to starting, per job run started since gpud started.",
            self._service.waits.counts(),
            lambda bound: f"{bound:g}",
        )
        mean, quoted = self._service.quote_error()
        error = GaugeMetricFamily(
            "gpud_admission_quote_error_seconds",
            "Mean observed minus quoted wait of queued runs in the history window.",
        )
        error.add_metric([], mean)
        runs = GaugeMetricFamily(
            "gpud_admission_quote_error_runs", "Queued runs with a quote in the history window."
        )
        runs.add_metric([], float(quoted))
        yield from (error, runs)
        residual = self._service.littles_residual()
        if residual is not None:
            little = GaugeMetricFamily(
                "gpud_admission_littles_law_residual_ratio",
                "Relative gap between the mean queue length and arrival rate times mean wait.",
            )
            little.add_metric([], residual)
            yield little
