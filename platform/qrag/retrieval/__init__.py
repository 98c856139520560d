"""Search with a trained Q: the scoring rule, what backends answer (hits), the one multi-step driver (greedy,
beam, Q-threshold stop), offline search over contexts, and the served model (embedder)."""
