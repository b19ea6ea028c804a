"""lightning_trainopt: measure, plan and cut the cost of training large transformers with PyTorch Lightning."""

from typing import Any

from lightning_trainopt.strategy_answers import answer_strategies_with as _answer_strategies_with

__version__ = "0.1.0"


def _parallel_answers(strategy: Any) -> Any:
    # parallel/ answers what a user's own Lightning strategy does for the rooms below it (models/ and precision/ ask
    # through strategy_answers.registered_answers). Imported on the first question, not here: importing the package
    # must not take torch's seconds (train.py's die_with_parent runs before them).
    from lightning_trainopt.parallel.spec import spec_of

    return spec_of(strategy)


_answer_strategies_with(_parallel_answers)
