"""Pure co-location policy: job shapes, shadow prices, interference model, guard, planner,
and the one-user-per-MPS-server rule placement keeps too (:mod:`colocate.users`).

Imports nothing of the rest of the project.
"""

from colocate.guard import GuardAction, GuardDecision, GuardParams, ServiceGuard
from colocate.interference import InterferencePredictor, JobFeatures, PredictorStats
from colocate.planner import (
    Convergence,
    Directive,
    GpuView,
    JobView,
    MigMemory,
    Placement,
    Plan,
    Planner,
    PlannerParams,
)
from colocate.prices import Option, PriceResult, ShadowPrices
from colocate.shapes import Config, Curve, JobKind, MigOption, Shape
from colocate.users import other_users, shared_under_mps

__all__ = [
    "Config",
    "Convergence",
    "Curve",
    "Directive",
    "GpuView",
    "GuardAction",
    "GuardDecision",
    "GuardParams",
    "InterferencePredictor",
    "JobFeatures",
    "JobKind",
    "JobView",
    "MigMemory",
    "MigOption",
    "Option",
    "Placement",
    "Plan",
    "Planner",
    "PlannerParams",
    "PredictorStats",
    "PriceResult",
    "ServiceGuard",
    "ShadowPrices",
    "Shape",
    "other_users",
    "shared_under_mps",
]
