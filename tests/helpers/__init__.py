"""Shared test helpers (skip conditions, tiny fits)."""
