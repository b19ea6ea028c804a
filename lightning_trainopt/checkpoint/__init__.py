"""Checkpoints: the atomic write, checkpoint layouts and the state in them, resume checks, conversion."""
