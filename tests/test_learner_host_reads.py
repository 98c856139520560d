"""An update reads values back from the device only where it must: the policy's top-k while acting
(the next states depend on it) and every figure of the update in one copy at its end. Any other read
(``float(t)``, ``.item()``, a boolean mask as an index, ``.cpu()``) makes the host wait for the GPU
and stops it from queueing the next work ahead of it.

On the CPU a read costs nothing, so what is checked is where reads happen: a torch function mode
records every read outside the allowed places. The GPU test counts the syncs themselves.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from qrag.rl import learner as learner_module
from test_learner import _episodes, _learner

READS = {"__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "unique"}


def _is_read(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in READS:
        return True
    if name == "__getitem__":  # a boolean mask as an index: its result's size is read from the device
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    if name == "to":  # a copy to the host
        target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return any(torch.device(t).type == "cpu" for t in target) and args[0].device.type != "cpu"
    return False


class HostReads(TorchFunctionMode):
    """Reads of tensor values on the host, except inside ``allowed`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.allowed_depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.allowed_depth and _is_read(func, args, kwargs):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)

    def allow(self, fn):
        def wrapped(*args, **kwargs):
            self.allowed_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.allowed_depth -= 1

        return wrapped


@pytest.mark.parametrize("objective", ["pqn", "sft", "sft_trajectory"])
def test_an_update_reads_the_device_only_to_act_and_once_at_its_end(tiny_encoder, monkeypatch, objective):
    """Planted bugs caught: a metric read with ``float()`` in the rollout; a boolean-mask index in
    the diagnostics; ``train_update`` reading the gradient norm on its own."""
    learner, tok, layout = _learner(tiny_encoder, dropout=0.1, objective=objective, sft_stop=objective == "sft")
    mode = HostReads()
    fetches: list[int] = []
    real_fetch = learner_module.fetch_floats

    def counted_fetch(groups):
        fetches.append(1)
        return real_fetch(groups)

    monkeypatch.setattr(learner_module, "fetch_floats", mode.allow(counted_fetch))
    learner.sample_top_k = mode.allow(learner.sample_top_k)
    learner.optimizer.step = mode.allow(learner.optimizer.step)  # AdamW reads its step counts, kept on the host
    if objective != "pqn":  # the supervised order is drawn from the host's generator: a host tensor
        learner.fact_order = mode.allow(learner.fact_order)
    episodes = _episodes(tok, layout)
    with mode:
        metrics = learner.train_update(episodes)
    assert mode.reads == [], f"reads of device values outside acting and the update's end: {mode.reads}"
    assert fetches == [1]
    assert metrics.transitions > 0 and metrics.loss == metrics.loss  # the figures came back (not NaN)
    assert isinstance(metrics.grad_norm, float) and isinstance(metrics.q_taken, float)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the GPU's syncs")
@pytest.mark.parametrize("objective", ["pqn", "sft"])
def test_an_update_syncs_the_gpu_only_to_act_and_once_at_its_end_on_a_gpu(tiny_encoder, objective):
    """CUDA's own count: each acting step reads its top-k values and indices (two syncs), the end of
    the update one; every copy to the device is queued without waiting."""
    learner, tok, layout = _learner(tiny_encoder, dropout=0.1, device="cuda:0", objective=objective)
    episodes = _episodes(tok, layout)
    learner.train_update(episodes)  # the first update captures graphs and warms caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            learner.train_update(episodes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    parts = -(-len(episodes) // learner.cfg.micro_batch)
    acting = 2 * 3 * parts if objective == "pqn" else 0  # two reads per step, at most 3 steps per part
    assert len(syncs) <= acting + 1, [str(w.message) for w in syncs]
