"""What every benchmark result records: machine, GPU, commit, date (from the library, which
records the same in the tables it writes)."""

from __future__ import annotations

import socket
from pathlib import Path

from qrag.integrations.provenance import git_commit, machine_info
from qrag.integrations.provenance import write_json as write_result

ROOT = Path(__file__).resolve().parents[1]


def pack_encoder(dest: str | Path, encoder: str = "minilm") -> Path:
    """An encoder (the bundled MiniLM, ``mpnet`` or any directory) in fp16 safetensors with its
    tokenizer (it loads back as fp32): what a GPU call carries instead of the encoder package."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from qrag.model.encoder import resolve_encoder

    src = resolve_encoder(encoder)
    AutoModel.from_pretrained(src).to(torch.float16).save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    return Path(dest)


def free_port() -> int:
    """A free TCP port on the loopback address (benchmarks bind only there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["ROOT", "free_port", "git_commit", "machine_info", "pack_encoder", "write_result"]
