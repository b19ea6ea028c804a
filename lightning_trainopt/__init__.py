"""lightning_trainopt: measure, plan and cut the cost of training large transformers with PyTorch Lightning."""

__version__ = "0.1.0"

# parallel/ answers what a user's own Lightning strategy does for the rooms below it (models/ asks through
# planner.strategy_layout.registered_answers): imported with the package so that every entry point has it.
from lightning_trainopt.parallel import spec as _strategy_spec  # noqa: E402, F401
