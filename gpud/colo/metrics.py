"""Co-location metrics, a metric source for :class:`gpud.metrics.Collector`::

gpud_colo_price{gpu,resource}                    shadow price per GPU and resource
gpud_colo_price_iterations                       price iterations in the latest plan
gpud_colo_price_residual_ratio                   the latest plan's residual
gpud_colo_sm_share_ratio{job}                    MPS SM share (thread % / 100) per job
gpud_colo_duty_ratio{job}                        duty cycle a training job is told
gpud_colo_predicted_speed_ratio{job}             predicted speed over alone
gpud_colo_observed_speed_ratio{job}              observed speed over alone (training:
                                                 iterations per running second; inference:
                                                 M/M/1 service rate from latency and load)
gpud_colo_guard_duty_ratio{job}                  an inference job's guard setting
gpud_colo_guard_p99_latency_seconds{job}         its latest windowed p99
gpud_colo_slo_attainment_ratio{job}              windows within the SLO so far
gpud_colo_predictor_mean_abs_error_ratio         interference predictor error
gpud_colo_predictor_samples                      slowdowns it has learned from
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from gpud.colo.service import ColoService


class ColoMetrics:
    """``collector.add_source(ColoMetrics(service))``."""

    def __init__(self, service: ColoService) -> None:
        self._service = service

    def __call__(self) -> Iterator[Metric]:
        v = self._service.show()
        price = GaugeMetricFamily(
            "gpud_colo_price", "Shadow price per GPU and resource.", labels=("gpu", "resource")
        )
        iters = GaugeMetricFamily("gpud_colo_price_iterations", "Price iterations, latest plan.")
        resid = GaugeMetricFamily("gpud_colo_price_residual_ratio", "Price residual, latest plan.")
        share = GaugeMetricFamily(
            "gpud_colo_sm_share_ratio", "MPS SM share per job.", labels=("job",)
        )
        duty = GaugeMetricFamily(
            "gpud_colo_duty_ratio", "Duty cycle a training job is told to run at.", labels=("job",)
        )
        pred = GaugeMetricFamily(
            "gpud_colo_predicted_speed_ratio", "Predicted speed over alone.", labels=("job",)
        )
        obs = GaugeMetricFamily(
            "gpud_colo_observed_speed_ratio", "Observed speed over alone.", labels=("job",)
        )
        gduty = GaugeMetricFamily(
            "gpud_colo_guard_duty_ratio",
            "SLO guard's training duty per inference job.",
            labels=("job",),
        )
        p99 = GaugeMetricFamily(
            "gpud_colo_guard_p99_latency_seconds",
            "Windowed p99 latency per inference job.",
            labels=("job",),
        )
        slo = GaugeMetricFamily(
            "gpud_colo_slo_attainment_ratio", "Latency windows within the SLO.", labels=("job",)
        )
        mae = GaugeMetricFamily(
            "gpud_colo_predictor_mean_abs_error_ratio",
            "Interference predictor mean absolute error.",
        )
        samples = GaugeMetricFamily(
            "gpud_colo_predictor_samples", "Slowdowns the predictor learned from."
        )
        waiting = GaugeMetricFamily(
            "gpud_colo_waiting_jobs",
            "gpuctl run invocations waiting for the co-location loop to name a GPU.",
        )
        waiting.add_metric([], float(len(v.waiting)))
        if v.plan is not None:
            for (gpu, resource), value in sorted(v.plan.prices.items()):
                price.add_metric([str(gpu), resource], value)
            iters.add_metric([], float(v.plan.convergence.iterations))
            resid.add_metric([], v.plan.convergence.residual)
            for job, speed in sorted(v.plan.predicted_speed.items()):
                pred.add_metric([job], speed)
        for r in v.running:
            share.add_metric([r.name], (r.threads_percent or 100) / 100.0)
            if r.kind == "training":
                duty.add_metric([r.name], v.duty.get(r.name, 1.0))
        for job, speed in sorted(v.observed_speed.items()):
            obs.add_metric([job], speed)
        for g in v.guards:
            gduty.add_metric([g.job], g.duty)
            slo.add_metric([g.job], g.attainment)
            if g.p99_ms is not None:
                p99.add_metric([g.job], g.p99_ms / 1e3)
        mae.add_metric([], v.predictor_mae)
        samples.add_metric([], float(v.predictor_samples))
        yield from (
            price, iters, resid, share, duty, pred, obs, gduty, p99, slo, mae, samples, waiting
        )  # fmt: skip
