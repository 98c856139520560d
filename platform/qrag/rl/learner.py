"""Soft PQN (paper Alg. 1): on-policy value learning of the two encoders, no replay buffer.

One update = a batch of episodes, rolled out in micro-batches. Per micro-batch:

1. embed every chunk once with the online action encoder (to act) and the target action encoder
   (for V), in length-bucketed no-grad batches; positions are a rotation of those cached vectors;
2. act for T steps on the whole micro-batch: one online state-encoder call per step (its graph is
   kept: that forward pass is reused by the loss), a Boltzmann policy with temperature α over the
   top-k *available* chunks, and one target state-encoder call for V(s_{t+1}) of the episodes
   that go on;
3. λ-returns backwards over every transition, the last one included;
4. re-encode only the chosen chunks with gradients and regress both twin halves of Q onto G^λ.

The loss's passes with gradients are few and large: each one is a fixed number of kernel launches
forward and backward, whatever its size, and the host's launches bound an update's speed. The chosen
chunks of every step go through the action encoder in one pass at the end; with dropout (acting then
runs without it) the states of steps 0 and 1 share one packed pass, queued while the host samples
step 1 (:meth:`SoftPQNLearner._embed_steps`).

Then clip, step AdamW, and move the targets towards the online encoders by τ.

Each update also reports diagnostics of the learning signal (:class:`UpdateMetrics`): the
behaviour policy's success rate and entropy, Q of the transitions of successful and of failed
episodes, the bootstrapped V(s_{t+1}), and the share of transitions with a non-zero return to go.
When successes are rare these show the failure mode of a too-hot soft value: V is dominated by
its entropy bonus (up to α·ln k), Q flattens towards it, the policy's entropy climbs to ln k and
the success rate falls to zero.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from qrag.config import EnvConfig, LearnerConfig
from qrag.model.encoder import EncodeStats, HostCopy, attention_kernels, encode, pad_rows, to_device
from qrag.model.packed import encode_packed, packing_unsupported
from qrag.rl.bf16_copies import Bf16Copies
from qrag.rl.graphed_passes import GraphedPasses
from qrag.rl.env import RetrievalEnv
from qrag.model.qnet import QNetwork
from qrag.data.tokens import TokenizedSample, TokenLayout


def lr_factor(update: int, warmup: int, total: int, final_fraction: float) -> float:
    """Linear warm-up to 1, then linear decay to ``final_fraction`` at ``total`` updates."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (update - warmup) / span)
    return 1.0 - (1.0 - final_fraction) * progress


def alpha_at(update: int, cfg: LearnerConfig, total: int) -> float:
    """α follows the *decaying* part of the learning-rate schedule; it is flat during warm-up
    (annealing it with a rising learning rate would make it grow)."""
    if update < cfg.warmup_updates:
        return cfg.alpha
    return cfg.alpha * lr_factor(update, cfg.warmup_updates, total, cfg.final_lr_fraction)


def lambda_returns(
    rewards: torch.Tensor, dones: torch.Tensor, next_values: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """G_t = r_t + γ(1 − d_t)[(1 − λ) V(s_{t+1}) + λ G_{t+1}], computed backwards.

    All inputs are [E, T]; ``next_values[:, t]`` is V(s_{t+1}) (the state *after* action t).
    Steps after an episode's end must have ``dones`` = 1 and are ignored by the caller.
    """
    e, horizon = rewards.shape
    returns = torch.zeros_like(rewards)
    g_next = torch.zeros(e, dtype=rewards.dtype, device=rewards.device)
    for t in range(horizon - 1, -1, -1):
        boot = (1.0 - lam) * next_values[:, t] + lam * g_next
        returns[:, t] = rewards[:, t] + gamma * (1.0 - dones[:, t]) * boot
        g_next = returns[:, t]
    return returns


def soft_value(q: torch.Tensor, available: torch.Tensor, alpha: float, top_k: int, soft: bool) -> torch.Tensor:
    """V(s) over the top-k *available* chunks: α·logsumexp(Q/α), or max Q when not soft.

    Unavailable chunks are masked *before* the top-k, so a selected chunk never enters V.
    """
    masked = q.masked_fill(~available, float("-inf"))
    k = min(top_k, masked.shape[1])
    vals = masked.topk(k, dim=1).values
    if not soft or alpha <= 0:
        return vals[:, 0]
    return alpha * torch.logsumexp(vals / alpha, dim=1)


@dataclass
class UpdateMetrics:
    loss: float
    q_taken: float
    target: float
    episode_return: float
    success: float
    episode_length: float
    policy_entropy: float  # nats, mean over acting steps (ln top_k = uniform)
    value_next: float  # mean V(s_{t+1}) over the transitions that bootstrap
    nonzero_return_share: float  # transitions with a reward still to come in their episode
    q_success: float | None  # mean Q(s_t, a_t) over transitions of successful episodes
    q_failure: float | None  # ... and of failed ones
    alpha: float
    lr: float
    grad_norm: float
    episodes: int
    transitions: int
    encoder_tokens: int
    encoder_padded_tokens: int
    encoder_seconds: float
    seconds: float

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class SoftPQNLearner:
    def __init__(
        self,
        qnet: QNetwork,
        layout: TokenLayout,
        env_cfg: EnvConfig,
        cfg: LearnerConfig,
        total_updates: int,
        device: torch.device,
        seed: int = 0,
    ):
        self.qnet = qnet
        self.layout = layout
        self.env_cfg = env_cfg
        self.cfg = cfg
        self.total_updates = total_updates
        self.device = device
        on_gpu = torch.device(device).type == "cuda"
        # fused: one multi-tensor kernel per step on a GPU instead of a launch per operation and tensor group
        self.optimizer = torch.optim.AdamW(
            qnet.online_parameters(),
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=True if on_gpu else None,  # None: torch picks its own (foreach) implementation
        )
        self.update = 0
        # Action sampling draws Gumbel noise on the CPU: reproducible on any device.
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = EncodeStats()
        wanted = cfg.packed if cfg.packed is not None else on_gpu
        # Why the passes are padded although packing was asked for (None: packed, or not asked).
        self.unpacked_reason = packing_unsupported(qnet.state_encoder) if wanted else None
        self.packed = wanted and self.unpacked_reason is None
        # Padded passes without gradients replay from CUDA graphs; packed ones need no padding.
        graphs = cfg.graphs and on_gpu and not self.packed
        self.graphed = GraphedPasses(qnet, layout.pad_id, device, cfg.padded_tokens) if graphs else None
        copies = cfg.bf16_copies if cfg.bf16_copies is not None else on_gpu
        self.bf16 = Bf16Copies() if copies and self.packed else None

    # -- schedule ------------------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        return alpha_at(self.update, self.cfg, self.total_updates)

    @property
    def lr(self) -> float:
        c = self.cfg
        return c.lr * lr_factor(self.update, c.warmup_updates, self.total_updates, c.final_lr_fraction)

    # -- acting --------------------------------------------------------------------------------

    def sample_actions(self, q: torch.Tensor, available: torch.Tensor, alpha: float) -> np.ndarray:
        """Boltzmann policy over the top-k available chunks (greedy when α = 0)."""
        return self.sample_actions_with_entropy(q, available, alpha)[0]

    def sample_actions_with_entropy(
        self, q: torch.Tensor, available: torch.Tensor, alpha: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Actions and the entropy (nats) of the distribution each was drawn from."""
        return self.sample_top_k(self.policy_top_k(q, available), alpha)

    def policy_top_k(self, q: torch.Tensor, available: torch.Tensor) -> HostCopy:
        """The top-k available chunks' Q and indices, on their way to the host (the one read while
        acting: the next states depend on it). Not waited for: work queued before
        :meth:`sample_top_k` runs on the GPU while the host samples."""
        masked = q.masked_fill(~available, float("-inf"))
        k = min(self.cfg.top_k, masked.shape[1])
        vals, idx = masked.topk(k, dim=1)
        return HostCopy.start(vals.float(), idx)

    def sample_top_k(self, pending: HostCopy, alpha: float) -> tuple[np.ndarray, np.ndarray]:
        """Boltzmann policy over the top-k (greedy when α = 0): actions and their entropies."""
        vals, idx = pending.wait()
        if alpha > 0:
            logits = (vals - vals[:, :1]) / alpha
            logp = torch.log_softmax(logits, dim=1)
            probs = logp.exp()
            entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).sum(1)
            uniform = torch.rand(vals.shape, generator=self.generator).clamp_(1e-12, 1.0)
            logits = logits - torch.log(-torch.log(uniform))  # Gumbel-max sampling
            choice = logits.argmax(1)
        else:
            choice = torch.zeros(len(vals), dtype=torch.long)
            entropy = torch.zeros(len(vals))
        return idx[torch.arange(len(idx)), choice].numpy(), entropy.numpy()

    def _embed(self, model, seqs, grad: bool = False, kind: str = "encode") -> torch.Tensor:
        """The vectors Q uses. A pass without gradients (acting, bootstrapped values) runs the
        encoder in eval mode, without dropout: from its bf16 copy with ``learner.bf16_copies``, from
        CUDA graphs where ``learner.graphs`` applies."""
        if not grad and self.bf16 is not None:
            return self._encode(self.bf16.of(model), seqs, False, kind, autocast=False)
        if not grad:
            with eval_mode(model):
                vectors = self.graphed.encode(model, seqs, self.stats, kind) if self.graphed else None
                return vectors if vectors is not None else self._encode(model, seqs, False, kind)
        return self._encode(model, seqs, True, kind)

    def _embed_steps(self, model, steps: Sequence[Sequence[np.ndarray]], kind: str) -> torch.Tensor:
        """The loss's vectors (with gradients) of several steps' sequences, in step order. Packed, one
        pass: its launches are its cost, not its size. Padded, one pass per step: a step's states are
        of like length, and one padded pass over all would pad the early, shorter states to the
        longest (a GPU's padded batches are not cut by length, ``split_ratio_for``)."""
        if self.packed:
            return self._embed(model, [s for step in steps for s in step], grad=True, kind=kind)
        return torch.cat([self._embed(model, step, grad=True, kind=kind) for step in steps])

    def _encode(self, model, seqs, grad: bool, kind: str, autocast: bool = True) -> torch.Tensor:
        """``autocast=False``: ``model`` runs in its own dtype (a packed pass of a bf16 copy)."""
        common = {"device": self.device, "grad": grad, "stats": self.stats, "kind": kind}
        if self.packed:
            pooled = encode_packed(model, seqs, max_tokens=self.cfg.encode_tokens, autocast=autocast, **common)
        else:
            pooled = encode(model, seqs, pad_id=self.layout.pad_id, max_tokens=self.cfg.padded_tokens, **common)
        return self.qnet.finish(pooled)

    def _rollout_and_backward(self, episodes: Sequence[TokenizedSample], alpha: float) -> dict:
        """Roll out one micro-batch and back-propagate the *sum* of its transitions' losses
        (``train_update`` divides by the update's transition count: the mean over the batch)."""
        cfg, qnet, dev = self.cfg, self.qnet, self.device
        env = RetrievalEnv(episodes, self.env_cfg, self.layout)
        m, horizon = len(episodes), self.env_cfg.max_steps
        use_target = cfg.use_target and qnet.use_target  # the config can ablate targets a checkpoint has
        target_state_enc, target_action_enc = (
            qnet.target_encoders() if use_target else (qnet.state_encoder, qnet.action_encoder)
        )

        flat_chunks = [c for s in episodes for c in s.chunks]
        chunk_vecs = pad_rows(self._embed(qnet.action_encoder, flat_chunks, kind="chunks"), env.n_chunks)
        target_chunk_vecs = None if use_target else chunk_vecs  # queued while the first actions are read
        n_chunks = to_device(env.n_chunks, dev)

        rewards = np.zeros((m, horizon), dtype=np.float32)
        dones = np.ones((m, horizon), dtype=np.float32)
        next_values = torch.zeros(m, horizon, device=dev)
        state_vecs, chosen_pos, trans_rows, trans_steps = [], [], [], []
        chosen_seqs: list[np.ndarray] = []  # every step's chosen chunks, for the one loss pass at the end
        loss_states: list[list[np.ndarray]] = []  # each step's states whose loss pass (with dropout) is not queued yet
        entropies: list[np.ndarray] = []
        value_top_k = cfg.value_top_k or cfg.top_k

        # Without dropout the acting forward pass equals the loss's forward pass: keep its graph
        # instead of encoding the states twice. With dropout, act without it (a pass without
        # gradients runs in eval mode) and re-encode in train mode for the loss.
        reuse_acting_pass = qnet.cfg.dropout == 0
        for t in range(horizon):
            rows = env.active
            if len(rows) == 0:
                break
            rows_t = to_device(rows, dev)
            seqs = env.states(rows)
            states = self._embed(qnet.state_encoder, seqs, grad=reuse_acting_pass, kind="states")
            selected = to_device(env.selected[rows], dev)
            available = to_device(env.available(rows), dev)
            with torch.no_grad():
                pos = qnet.positions(selected, n_chunks[rows_t])
                q = QNetwork.twin_scores(states.detach(), qnet.place(chunk_vecs[rows_t], pos)).mean(-1)
            pending = self.policy_top_k(q, available)
            # While the top-k travels to the host, queue the GPU work that does not need this step's
            # actions (the first step's target chunks, the loss's passes over what is already
            # known), so that the GPU keeps working while the host samples and steps.
            if target_chunk_vecs is None:
                target_chunk_vecs = pad_rows(
                    self._embed(target_action_enc, flat_chunks, kind="target_chunks"), env.n_chunks
                )
            if reuse_acting_pass:
                state_vecs.append(states)
            else:
                loss_states.append(seqs)
                if t > 0:  # step 0's window already holds the target chunks' pass
                    state_vecs.append(self._embed_steps(qnet.state_encoder, loss_states, kind="states_grad"))
                    loss_states = []
            actions, entropy = self.sample_top_k(pending, alpha)
            entropies.append(entropy)
            if pos is not None:
                chosen_pos.append(pos[torch.arange(len(rows), device=dev), to_device(actions, dev)])
            r, d = env.step(rows, actions)
            rewards[rows, t], dones[rows, t] = r, d.astype(np.float32)
            chosen_seqs.extend(episodes[i].chunks[a] for i, a in zip(rows, actions))
            trans_rows.append(rows)
            trans_steps.append(np.full(len(rows), t))

            go_on = rows[~d]
            if len(go_on):
                go_on_t = to_device(go_on, dev)
                with torch.no_grad():
                    next_states = self._embed(target_state_enc, env.states(go_on), kind="target_states")
                    next_sel = to_device(env.selected[go_on], dev)
                    next_pos = qnet.positions(next_sel, n_chunks[go_on_t])
                    qt = QNetwork.twin_scores(next_states, qnet.place(target_chunk_vecs[go_on_t], next_pos))
                    qt = qt.min(-1).values  # clipped double-Q over the twin halves
                    avail_next = to_device(env.available(go_on), dev)
                    next_values[go_on_t, t] = soft_value(qt, avail_next, alpha, value_top_k, cfg.soft_q)

        returns = lambda_returns(to_device(rewards, dev), to_device(dones, dev), next_values, cfg.gamma, cfg.lam)
        rows_np, steps_np = np.concatenate(trans_rows), np.concatenate(trans_steps)
        rows_all, steps_all = to_device(rows_np, dev), to_device(steps_np, dev)
        targets = returns[rows_all, steps_all]

        if loss_states:  # every episode ended at step 0
            state_vecs.append(self._embed_steps(qnet.state_encoder, loss_states, kind="states_grad"))
        # The chunks chosen at different steps are alike in length: one pass, padded or not.
        actions_vecs = self._embed(qnet.action_encoder, chosen_seqs, grad=True, kind="chosen_chunks")
        if chosen_pos:
            actions_vecs = qnet.place(actions_vecs, torch.cat(chosen_pos))
        state_vecs_all = torch.cat(state_vecs)
        q_taken = QNetwork.pair_scores(state_vecs_all, actions_vecs)  # [K, 2]
        loss_sum = ((q_taken - targets.unsqueeze(1)) ** 2).sum()
        self._backward(loss_sum)
        # Figures from the GPU stay tensors: train_update reads them all in one copy after the step.
        return {
            "loss_sum": loss_sum.detach(),
            "q_taken": q_taken.detach().mean(),
            "target": targets.mean(),
            "episode_return": float(env.episode_return.mean()),
            "success": float(env.succeeded.mean()),
            "episode_length": float(env.t.mean()),
            "transitions": int(len(targets)),
            **signal_diagnostics(
                q_taken.detach().mean(1),
                next_values[rows_all, steps_all],
                rows_np,
                steps_np,
                env,
                rewards,
                dones,
                np.concatenate(entropies),
            ),
        }

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward through both encoders; timed with the encoder passes when profiling."""
        with self.stats.timing(self.device, "backward"):
            loss.backward()

    # -- one update ----------------------------------------------------------------------------

    def train_update(self, episodes: Sequence[TokenizedSample]) -> UpdateMetrics:
        if not episodes:
            raise ValueError("train_update() needs at least one episode")
        t0 = time.perf_counter()
        self.stats.reset()
        if self.bf16 is not None:
            self.bf16.refresh()  # the weights after the last update's step and target move
        alpha, lr = self.alpha, self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.qnet.train()
        micro = max(1, self.cfg.micro_batch)
        parts = [episodes[i : i + micro] for i in range(0, len(episodes), micro)]
        sums: dict[str, float] = {}
        diag = Diagnostics()
        for part in parts:
            weight = len(part) / len(episodes)
            with attention_kernels(self.cfg.cudnn_attention):
                out = self._rollout_and_backward(part, alpha)
            diag.add(out.pop("counts"))
            for key, value in out.items():
                summed = key in ("transitions", "loss_sum")
                sums[key] = sums.get(key, 0.0) + (value if summed else value * weight)
        params = self.qnet.online_parameters()
        # The loss is the mean over every transition of the update, however micro-batches split it.
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, max(1.0, sums["transitions"]))  # one launch, not one per tensor
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.qnet.update_targets(self.cfg.tau)
        self.update += 1
        # The one wait for the GPU outside acting: every figure of the update in one copy.
        sums, diag.totals, grad_norm = fetch_floats((sums, diag.totals, {"grad_norm": grad_norm}))
        return UpdateMetrics(
            loss=sums["loss_sum"] / max(1.0, sums["transitions"]),
            q_taken=sums["q_taken"],
            target=sums["target"],
            episode_return=sums["episode_return"],
            success=sums["success"],
            episode_length=sums["episode_length"],
            **diag.means(),
            alpha=alpha,
            lr=lr,
            grad_norm=grad_norm["grad_norm"],
            episodes=len(episodes),
            transitions=int(sums["transitions"]),
            encoder_tokens=self.stats.tokens,
            encoder_padded_tokens=self.stats.padded_tokens,
            encoder_seconds=self.stats.seconds,
            seconds=time.perf_counter() - t0,
        )

    # -- state ---------------------------------------------------------------------------------

    def scalar_state(self) -> dict:
        return {"update": self.update, "total_updates": self.total_updates}

    def load_scalar_state(self, state: dict) -> None:
        self.update = int(state["update"])


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, its own mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# -- learning-signal diagnostics ---------------------------------------------------------------


def fetch_floats(groups: tuple[dict, ...]) -> tuple[dict[str, float], ...]:
    """Each dict with its tensor values (0-d, on one device) read back as floats in a single copy:
    one wait for the GPU instead of one per figure."""
    tensors = [(g, k) for g, group in enumerate(groups) for k, v in group.items() if isinstance(v, torch.Tensor)]
    out = [dict(group) for group in groups]
    if tensors:
        values = torch.stack([groups[g][k].detach().float().reshape(()) for g, k in tensors]).tolist()
        for (g, k), value in zip(tensors, values):
            out[g][k] = value
    return tuple(out)


def signal_diagnostics(
    q_taken: torch.Tensor,
    value_next: torch.Tensor,
    rows: np.ndarray,
    steps: np.ndarray,
    env: RetrievalEnv,
    rewards: np.ndarray,
    dones: np.ndarray,
    entropies: np.ndarray,
) -> dict[str, dict[str, float]]:
    """Sums and counts of one micro-batch's diagnostics (merged over micro-batches by
    :class:`Diagnostics`); ``q_taken`` is the mean of the twin halves per transition, [K] on the
    device, ``value_next`` its V(s_{t+1}) (0 where it does not bootstrap), ``rows`` and ``steps``
    each transition's episode and step. The sums over device values stay tensors (masked sums, not
    boolean indexing, which would wait for the GPU)."""
    to_go = np.flip(np.cumsum(np.flip(rewards, 1), 1), 1)  # undiscounted reward still to come
    dev = q_taken.device
    success_np = env.succeeded[rows]
    boots_np = dones[rows, steps] == 0
    success, boots = to_device(success_np, dev), to_device(boots_np, dev)
    q = q_taken.float()
    return {
        "counts": {
            "transitions": float(len(rows)),
            "entropy_sum": float(entropies.sum()),
            "value_sum": (value_next.float() * boots).sum(),
            "value_n": float(boots_np.sum()),
            "nonzero_n": float((to_go[rows, steps] > 0).sum()),
            "q_success_sum": (q * success).sum(),
            "q_success_n": float(success_np.sum()),
            "q_failure_sum": (q * ~success).sum(),
            "q_failure_n": float((~success_np).sum()),
        }
    }


class Diagnostics:
    """Transition-weighted means of the diagnostics over an update's micro-batches."""

    def __init__(self) -> None:
        self.totals: dict[str, float | torch.Tensor] = {}  # device sums until train_update reads them

    def add(self, counts: dict[str, float | torch.Tensor]) -> None:
        for key, value in counts.items():
            self.totals[key] = self.totals.get(key, 0.0) + value

    def _ratio(self, num: str, den: str) -> float | None:
        d = self.totals.get(den, 0.0)
        return self.totals.get(num, 0.0) / d if d else None

    def means(self) -> dict[str, float | None]:
        return {
            "policy_entropy": self._ratio("entropy_sum", "transitions") or 0.0,
            "value_next": self._ratio("value_sum", "value_n") or 0.0,
            "nonzero_return_share": self._ratio("nonzero_n", "transitions") or 0.0,
            "q_success": self._ratio("q_success_sum", "q_success_n"),
            "q_failure": self._ratio("q_failure_sum", "q_failure_n"),
        }
