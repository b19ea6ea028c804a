"""Pure arithmetic of the planner: per-device memory by category, speed and dollars, before launch."""

from lightning_trainopt.planner.activations import ActivationPolicy, estimate_transformer_activations
from lightning_trainopt.planner.adapters import AdapterPlan, gpt_adapter_plan
from lightning_trainopt.planner.estimate import PlanEstimate, PlanInputs, estimate_plan, gpt_param_groups
from lightning_trainopt.planner.measure import measure_activation_bytes
from lightning_trainopt.planner.model_profile import (
    ModelProfile,
    decay_groups,
    forward_trace,
    gpt_profile,
    module_profile,
)
from lightning_trainopt.planner.model_states import (
    ADAM_PATHS,
    StrategyLayout,
    estimate_model_states,
    param_dtype_bytes,
    textbook_model_state_bytes,
)
from lightning_trainopt.planner.optimizer_state import (
    OPTIMIZER_STATES,
    OptimizerStateModel,
    optimizer_state_model,
)
from lightning_trainopt.planner.precision_plan import LossPlan, PrecisionPlan
from lightning_trainopt.planner.search import (
    Candidate,
    Parallelism,
    SearchSpace,
    least_parallelism,
    rank_candidates,
    search_plans,
)
from lightning_trainopt.planner.speed import SpeedEstimate, estimate_speed
from lightning_trainopt.planner.teacher import TeacherPlan, gpt_teacher_plan
from lightning_trainopt.planner.terms import CATEGORIES, LOCATIONS, MemoryEstimate, Term
from lightning_trainopt.planner.zero3_gather import gpt_module_trace, zero3_gathered_peak_numel

__all__ = [
    "ADAM_PATHS",
    "CATEGORIES",
    "LOCATIONS",
    "OPTIMIZER_STATES",
    "ActivationPolicy",
    "AdapterPlan",
    "Candidate",
    "LossPlan",
    "MemoryEstimate",
    "ModelProfile",
    "OptimizerStateModel",
    "Parallelism",
    "PlanEstimate",
    "PlanInputs",
    "PrecisionPlan",
    "SearchSpace",
    "SpeedEstimate",
    "StrategyLayout",
    "TeacherPlan",
    "Term",
    "decay_groups",
    "estimate_model_states",
    "estimate_plan",
    "estimate_speed",
    "estimate_transformer_activations",
    "gpt_adapter_plan",
    "forward_trace",
    "gpt_module_trace",
    "gpt_param_groups",
    "gpt_profile",
    "gpt_teacher_plan",
    "least_parallelism",
    "measure_activation_bytes",
    "module_profile",
    "optimizer_state_model",
    "param_dtype_bytes",
    "rank_candidates",
    "search_plans",
    "textbook_model_state_bytes",
    "zero3_gathered_peak_numel",
]
