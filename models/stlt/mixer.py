"""`STLTMixer`: value projection -> adaptive STLT mix -> output projection, a drop-in token mixer of the blocks.

It owns the S complex nodes (sigma, omega), the shared window bandwidth T, the readout C and the node gate:

- Constraints hold by construction, whatever an optimiser does to the raw parameters (no clamping, which would zero
  the gradient at the bound and can be undone by the next step):
      sigma = 1e-3 + softplus(sigma_raw)     >= 1e-3, behaves like exp(raw) for small sigma: relative steps across
                                                     the four decades sigma spans
      omega = (pi / delta) * tanh(omega_raw)  |omega| < pi / delta (Nyquist)
      T     = 4 + softplus(T_raw)             >= 4
  The initial values of the design (sigma log-spaced over [1e-3, 10], omega uniform in [0, pi/delta], T = max(4,
  length/16)) sit on or next to these bounds; they are reached to within 1e-6 (sigma), 1e-3 (omega/T) of the bound.
- Gate: logits z = W pool(x) + b, alpha = sigmoid(z); pool is the sequence mean (bilateral: one mask per sequence) or
  the prefix mean up to each position (causal: the mask at n never sees tokens after n). Training draws a
  relaxed-Bernoulli mask sigmoid((z + g) / tau) with logistic noise g (one draw per sequence and node) from the
  logits. Evaluation (`eval_gate`): "soft", the write-up's inference rule, weighs node k by alpha_k and skips it
  where alpha_k < 0.01 (SKIP_BELOW); "hard" uses 1[alpha > 0.5]. Either way nodes off for every row of the batch are
  not computed. A row is a sequence of a bilateral layer, a (sequence, position) of a causal one; S_eff, the active
  nodes per row, is counted over every evaluation forward between `start_node_count` and `stop_node_count`.
- tau: tau_start for the first `tau_hold` of training, then geometric to tau_end over the next `tau_anneal`.
- regularization_loss(), with m_bar the mask averaged over the sequences and positions of every forward pass of the
  current optimiser step (with gradients enabled), each of the write-up's sums taken as a mean over its terms, so
  that a layer's penalty is on the scale of a per-token loss whatever S (docs/stlt.md, "Regulariser"):
      lambda_omega mean_k |omega_k| m_bar_k + lambda_sigma mean_k (sigma_k - sigma_{k-1})^2 m_bar_k m_bar_{k-1}
      + lambda_mask mean_k m_bar_k,        zero before `reg_start_step`.
  Call it once per optimiser step, after the step's last forward, and add it unscaled to the step's loss: with
  gradient accumulation over micro-batches (each loss scaled as a big batch's mean would weigh it), the step then
  has the gradient of one big batch. A step begins with `set_training_step` or after a backward pass through the
  regulariser; forwards after that count towards the next step. Once per micro-batch cannot give the big-batch
  gradient: the smoothness term couples the nodes' means over the whole batch (m_bar_k m_bar_{k-1}), and a
  micro-batch's backward cannot wait for the masks of the micro-batches after it. Because the regulariser reaches
  back into every micro-batch's forward graph, backward once per step through the sum of the scaled micro-batch
  losses and the regulariser (or keep the micro-batches' graphs with `retain_graph=True`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.stlt.config import EVAL_GATES, STLTConfig
from models.stlt.naive import decay_log
from models.stlt.op import stlt_mix

SIGMA_MIN, SIGMA_INIT_MAX, T_MIN = 1e-3, 10.0, 4.0
# The write-up's inference rule: a node whose gate probability alpha is under this is skipped entirely.
SKIP_BELOW = 0.01


def _softplus_inverse(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class STLTMixer(nn.Module):
    def __init__(
        self,
        dim: int,
        num_nodes: int = 32,
        *,
        causal: bool = False,
        seq_len: int = 256,
        T_init: float | None = None,
        delta: float = 1.0,
        lambda_omega: float = 0.01,
        lambda_sigma: float = 0.1,
        lambda_mask: float = 0.05,
        reg_start_step: int = 8000,
        tau_start: float = 1.0,
        tau_end: float = 0.2,
        tau_hold: float = 0.1,
        tau_anneal: float = 0.5,
        bias: bool = True,
        backend: str = "auto",
        gate_bias_init: float = 3.0,
        eval_gate: str = "soft",
    ):
        super().__init__()
        self.dim, self.num_nodes, self.causal, self.delta, self.backend = dim, num_nodes, causal, delta, backend
        self.lambda_omega, self.lambda_sigma, self.lambda_mask = lambda_omega, lambda_sigma, lambda_mask
        self.reg_start_step = reg_start_step
        if eval_gate not in EVAL_GATES:
            raise ValueError(f"eval_gate must be one of {', '.join(EVAL_GATES)}, got {eval_gate!r}")
        self.eval_gate = eval_gate
        self.tau_start, self.tau_end, self.tau_hold, self.tau_anneal = tau_start, tau_end, tau_hold, tau_anneal
        self.value = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        S = num_nodes
        self.sigma_raw = nn.Parameter(torch.empty(S))
        self.omega_raw = nn.Parameter(torch.empty(S))
        self.T_raw = nn.Parameter(torch.empty(()))
        self.readout = nn.Parameter(torch.empty(S, dim, 2))  # C as (real, imag): optimisers and DDP see real tensors
        # Plain parameters, not an nn.Linear, so a model-wide Linear re-initialisation leaves the gate's bias alone.
        self.gate_weight = nn.Parameter(torch.empty(S, dim))
        self.gate_bias = nn.Parameter(torch.empty(S))
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=True)
        self.register_buffer("tau", torch.tensor(float(tau_start)), persistent=True)
        # Evaluation forwards' [active (row, node) pairs, rows] while counting (start_node_count), else None.
        self._node_count: torch.Tensor | None = None
        # The masks of this optimiser step's forwards, summed over sequences and positions (with their graphs), and
        # how many (sequence, position) rows they hold; cleared at the first forward of the next step.
        self._mask_sum: torch.Tensor | None = None
        self._mask_rows = 0
        self._step_over = False
        self.reset_parameters(seq_len, T_init, gate_bias_init)

    @classmethod
    def from_config(cls, config: STLTConfig, dim: int, *, causal: bool, seq_len: int, bias: bool = True):
        return cls(
            dim, config.stlt_nodes, causal=causal, seq_len=seq_len, T_init=config.T_init_for(seq_len),
            delta=config.stlt_delta, lambda_omega=config.stlt_lambda_omega, lambda_sigma=config.stlt_lambda_sigma,
            lambda_mask=config.stlt_lambda_mask, reg_start_step=config.stlt_reg_start_step,
            tau_start=config.stlt_tau_start, tau_end=config.stlt_tau_end, tau_hold=config.stlt_tau_hold,
            tau_anneal=config.stlt_tau_anneal, bias=bias, backend=config.stlt_backend,
            eval_gate=config.stlt_eval_gate,
        )

    @torch.no_grad()
    def reset_parameters(self, seq_len: int, T_init: float | None, gate_bias_init: float) -> None:
        S, nyquist = self.num_nodes, math.pi / self.delta
        T_init = max(T_MIN, seq_len / 16) if T_init is None else T_init
        sigma = torch.logspace(math.log10(SIGMA_MIN), math.log10(SIGMA_INIT_MAX), S, dtype=torch.float64)
        self.sigma_raw.copy_(_softplus_inverse((sigma - SIGMA_MIN).clamp(min=1e-6)))
        omega = torch.rand(S, dtype=torch.float64) * nyquist
        self.omega_raw.copy_(torch.atanh((omega / nyquist).clamp(max=1 - 1e-3)))
        self.T_raw.copy_(_softplus_inverse(torch.tensor(max(T_init - T_MIN, 1e-3), dtype=torch.float64)))
        # Unit output variance for white input: node k's window has energy sum_t |a_k|^(2|t|) over the sequence.
        r2 = torch.exp(-2 * (self.sigma.double() + 1 / self.T.double()) * self.delta)
        energy = (1 - r2**seq_len) / (1 - r2)
        energy = energy if self.causal else 2 * energy - 1
        scale = (1 / (2 * S * energy)).sqrt()
        self.readout.copy_(torch.randn(S, self.dim, 2, dtype=torch.float64) * scale[:, None, None])
        nn.init.trunc_normal_(self.gate_weight, std=0.02)
        nn.init.constant_(self.gate_bias, gate_bias_init)

    @property
    def sigma(self) -> torch.Tensor:
        return SIGMA_MIN + F.softplus(self.sigma_raw)

    @property
    def omega(self) -> torch.Tensor:
        return (math.pi / self.delta) * torch.tanh(self.omega_raw)

    @property
    def T(self) -> torch.Tensor:
        return T_MIN + F.softplus(self.T_raw)

    @property
    def C(self) -> torch.Tensor:
        return torch.view_as_complex(self.readout)

    def gate_logits(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) from the sequence mean (bilateral) or (B, N, S) from prefix means (causal); with ``keep``
        (B, N, 1), 1 at tokens and 0 at padding, the means are over the tokens only."""
        if keep is None:
            if not self.causal:
                return x.mean(dim=1) @ self.gate_weight.T + self.gate_bias
            counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
            return (x @ self.gate_weight.T).cumsum(dim=1) / counts + self.gate_bias
        if not self.causal:
            return (x * keep).sum(dim=1) @ self.gate_weight.T / keep.sum(dim=1).clamp(min=1) + self.gate_bias
        return (x @ self.gate_weight.T * keep).cumsum(dim=1) / keep.cumsum(dim=1).clamp(min=1) + self.gate_bias

    def node_mask(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self._eval_mask(logits)
        noise_shape = (logits.shape[0],) + (1,) * (logits.dim() - 2) + (logits.shape[-1],)
        u = torch.rand(noise_shape, device=logits.device, dtype=logits.dtype).clamp(1e-6, 1 - 1e-6)
        return torch.sigmoid((logits + torch.log(u) - torch.log1p(-u)) / self.tau)

    def _eval_mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.eval_gate == "hard":
            return (logits > 0).to(logits.dtype)
        alpha = torch.sigmoid(logits)
        return alpha.masked_fill(alpha < SKIP_BELOW, 0.0)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D). ``padding_mask`` (B, N), True at padding: padded positions add nothing to the
        transform (their values are zeroed) nor to the gate's means, so a token's output is the same whatever
        padding its sequence has after it (bilateral: wherever it is, for positions kept in place)."""
        v = self.value(x)
        keep = None if padding_mask is None else (~padding_mask).to(x.dtype)[..., None]  # (B, N, 1)
        if keep is not None:
            v = v * keep
        mask = self.node_mask(self.gate_logits(x, keep))
        rows = mask.reshape(-1, self.num_nodes)
        if keep is not None and mask.dim() == 3:  # per-position masks: padded positions are no rows of the batch
            rows = rows[keep.reshape(-1) > 0]
        if torch.is_grad_enabled():
            self._count_masks(rows)
        sigma, omega, C = self.sigma, self.omega, self.C
        if not self.training:
            on = rows > 0
            if self._node_count is not None:
                self._node_count += torch.stack([on.sum(), torch.tensor(on.shape[0], device=on.device)]).double()
            # Nodes off for every sequence and position of the batch cost nothing: drop them before the mix.
            active = on.any(dim=0).nonzero().squeeze(1)
            if active.numel() == 0:
                return self.out_proj(torch.zeros_like(v))
            if active.numel() < self.num_nodes:
                sigma, omega, C, mask = sigma[active], omega[active], C[active], mask[..., active]
        y = stlt_mix(v, sigma, omega, self.T, C, mask, delta=self.delta, causal=self.causal, backend=self.backend)
        return self.out_proj(y)

    # Step-by-step decoding (the encoder-decoder's incremental decoder, models/encdec.py). Named decode_step: `step`
    # is the buffer holding the optimiser step.

    def init_state(self, batch_size: int, *, device=None, dtype: torch.dtype = torch.float32) -> dict:
        """The causal recurrence's state before the first token: per sequence, node and channel the transform
        L (complex, (B, S, D)), the sum of the gate's projections of the tokens so far (B, S) and their count (B, 1).
        Its size never grows with the number of tokens decoded. In training mode it also holds the gate's logistic
        noise (B, S), drawn once per sequence as forward draws it."""
        if not self.causal:
            raise ValueError("a bilateral STLT mixes the whole sequence at once; "
                             "only a causal one decodes step by step")
        device = self.sigma_raw.device if device is None else device
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        B, S = batch_size, self.num_nodes
        state = {"L": torch.zeros(B, S, self.dim, device=device, dtype=cdtype),
                 "gate_sum": torch.zeros(B, S, device=device, dtype=dtype),
                 "count": torch.zeros(B, 1, device=device, dtype=dtype)}
        if self.training:
            u = torch.rand(B, S, device=device, dtype=dtype).clamp(1e-6, 1 - 1e-6)
            state["noise"] = torch.log(u) - torch.log1p(-u)
        return state

    def decode_step(self, x_t: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One position of the causal mix: x_t (B, D) -> (y_t (B, D), the next state), O(S D) work whatever the
        position. The recurrence of the definition, L_n = a L_{n-1} + v_n, and its readout
        y_n = sum_k m[n,k] Re(C_k L_n,k) with the gate on the prefix mean of the tokens so far; forward over the
        whole sequence gives the same outputs. Steps feed no regulariser (they decode; they do not train)."""
        v = self.value(x_t)
        cdtype = state["L"].dtype
        a = torch.exp(decay_log(self.sigma, self.omega, self.T, self.delta)).to(cdtype)  # (S,)
        L = a[:, None] * state["L"] + v.to(cdtype)[:, None, :]
        gate_sum = state["gate_sum"] + x_t @ self.gate_weight.T
        count = state["count"] + 1
        logits = gate_sum / count + self.gate_bias
        if "noise" in state:
            mask = torch.sigmoid((logits + state["noise"]) / self.tau)
        else:
            mask = self._eval_mask(logits)
        y = torch.einsum("bk,bkd->bd", mask.to(v.dtype), (self.C.to(cdtype) * L).real.to(v.dtype))
        return self.out_proj(y), {**state, "L": L, "gate_sum": gate_sum, "count": count}

    # Hooks the models forward to every mixer (models/base.py).

    def _count_masks(self, rows: torch.Tensor) -> None:
        if self._step_over:
            self._mask_sum, self._mask_rows, self._step_over = None, 0, False
        total = rows.sum(dim=0)
        self._mask_sum = total if self._mask_sum is None else self._mask_sum + total
        self._mask_rows += rows.shape[0]

    def _end_step(self, grad: torch.Tensor) -> None:
        self._step_over = True

    def set_training_step(self, step: int, total_steps: int) -> None:
        self._step_over = True
        self.step.fill_(step)
        progress = step / max(total_steps, 1)
        if progress < self.tau_hold:
            tau = self.tau_start
        elif self.tau_anneal <= 0 or progress >= self.tau_hold + self.tau_anneal:
            tau = self.tau_end
        else:
            frac = (progress - self.tau_hold) / self.tau_anneal
            tau = self.tau_start * (self.tau_end / self.tau_start) ** frac
        self.tau.fill_(tau)

    def regularization_loss(self) -> torch.Tensor:
        """The regulariser over every forward of the current optimiser step: call it once per step (class docstring)."""
        if self._mask_sum is None or int(self.step) < self.reg_start_step:
            return self.sigma_raw.new_zeros(())
        m, sigma = self._mask_sum / self._mask_rows, self.sigma
        if m.requires_grad:
            m.register_hook(self._end_step)  # a backward through the regulariser ends the step
        frequency = (self.omega.abs() * m).mean()
        # mean over the S - 1 neighbour pairs (none for one node: sum() of nothing is 0)
        smoothness = ((sigma[1:] - sigma[:-1]) ** 2 * m[1:] * m[:-1]).sum() / max(self.num_nodes - 1, 1)
        usage = m.mean()
        return self.lambda_omega * frequency + self.lambda_sigma * smoothness + self.lambda_mask * usage

    def start_node_count(self) -> None:
        """From now on, every forward in evaluation mode adds its active (row, node) pairs and its rows."""
        self._node_count = torch.zeros(2, dtype=torch.float64, device=self.gate_bias.device)

    def stop_node_count(self) -> torch.Tensor:
        """[active (row, node) pairs, rows] (float64, CPU) of the evaluation forwards since `start_node_count`:
        S_eff = active / rows. Counting stops."""
        count, self._node_count = self._node_count, None
        return count.cpu()

    def stats(self) -> dict[str, float]:
        return {"T": float(self.T.detach())}

    def slow_parameters(self) -> list[nn.Parameter]:
        return [self.sigma_raw, self.omega_raw]

    def extra_repr(self) -> str:
        kind = "causal" if self.causal else "bilateral"
        return (f"dim={self.dim}, nodes={self.num_nodes}, {kind}, delta={self.delta}, backend={self.backend!r}, "
                f"eval_gate={self.eval_gate!r}")
