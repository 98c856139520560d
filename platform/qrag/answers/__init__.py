"""Answer generation after retrieval: ``reader`` (prompts, records, metrics), one module per
backend (``local``: SmolLM2 offline; ``openai_compat``: any OpenAI-compatible endpoint), and
``backends``, which builds the configured one."""
