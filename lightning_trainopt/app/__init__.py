"""The training and planning applications: train(cfg), plan(cfg), validation, pre-flight checks, reports."""
