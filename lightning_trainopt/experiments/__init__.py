"""Sweeps with a report: the optimization ladder, the precision parity experiment, sweep summaries."""
