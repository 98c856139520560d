"""Device spellings: every GPU device the library hands out carries its index."""

from __future__ import annotations

import torch

from qrag.model.encoder import pick_device


def test_a_gpu_device_always_has_its_index(monkeypatch):
    # torch.cuda.set_device(torch.device("cuda")) raises "Expected a torch.device with a specified
    # index": a lane on `--device auto` failed so on a GPU machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert pick_device("auto") == torch.device("cuda", 1)
    assert pick_device("cuda") == torch.device("cuda", 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0)
    assert pick_device(torch.device("cuda")) == torch.device("cuda", 1)


def test_cpu_stays_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu") and pick_device("cpu") == torch.device("cpu")
