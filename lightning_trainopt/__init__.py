"""lightning_trainopt: measure, plan and cut the cost of training large transformers with PyTorch Lightning."""

__version__ = "0.1.0"
