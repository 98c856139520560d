"""The ``qrag`` command: ``commands`` holds the parser and ``train``/``eval``; every other module
here adds one subcommand (``serve``, ``report``, ``sweep-lengths``) and registers it on import."""

from qrag.cli.commands import main

__all__ = ["main"]
