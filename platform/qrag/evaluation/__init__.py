"""Numbers: evaluation of checkpoints, Q-threshold early stopping, long-context length sweeps, reports, memory."""
