"""qrag: train, tune and serve Q-RAG multi-step retrievers (ICLR 2026).

The library is plain PyTorch + transformers; only ``qrag.distributed`` imports Ray.
"""

__version__ = "0.1.0"
