"""Fault tolerance and bad input: signals, restarts, hangs, broken checkpoints and data (issue 7)."""
