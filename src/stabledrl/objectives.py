"""RL objectives for diffusion LMs: GRPO (with DAPO's and Dr. GRPO's aggregations), StableDRL, wd1
and SPG, as pure tensor functions (docs/methods.md, "Objectives": the equations, and where they
part from the papers).

An objective is a loss `(options, batch: ScoredBatch) -> LossOutput(loss, metrics)` registered
with `@objective("name")`; its options are the `ObjectiveSection` of that name (`stabledrl.settings`),
which also says what the loss is divided by (`normaliser`). It reads likelihood estimates, not a
model. Rows are laid out group by group: rows [g·G, (g+1)·G) are the G completions of prompt g.

Ratios: ``sequence`` ρ = exp(ℓ_θ − ℓ_old); ``sequence_normalized`` exp((ℓ_θ − ℓ_old)/|y|)
(GSPO / GDPO); ``token`` per-token ratios. `log_ratios` returns log ρ unclamped; GRPO, where
ρ itself is exponentiated, clamps log ρ to ±80 so a float32 ratio never overflows, and the
ratio diagnostics use the same clamp. StableDRL's softmax needs no clamp.

Shapes: B = num_groups · G rows, L completion slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal, TypeVar

import torch

from stabledrl.settings import (OBJECTIVE_SECTIONS, GRPOConfig, Normaliser, SPGConfig, StableDRLConfig,
                                TokenAggregation, WD1Config)

__all__ = [
    "LossOutput",
    "ScoredBatch",
    "OBJECTIVES",
    "objective",
    "objective_for",
    "group_advantages",
    "log_ratios",
    "ratio_diagnostics",
    "grpo_loss",
    "stabledrl_loss",
    "wd1_loss",
    "spg_likelihood",
    "spg_loss",
    "kl_k3",
    "aggregate_tokens",
    "share_of_loss",
]

RatioLevel = Literal["sequence", "sequence_normalized", "token"]
MAX_LOG_RATIO = 80.0
"""|log ρ| at most this before GRPO's exp(): e^80 is finite in float32 (its largest is about e^88.7)."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to minimise."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Diagnostics of this step (ratio spread, bypass fraction, ESS, ...)."""


@dataclass(frozen=True, eq=False)
class ScoredBatch:
    """What an objective sees of a step: the likelihood estimates of the kept groups' B rows
    and their advantages. Only `logp` (and `eubo`) carry a graph; the rest are constants."""

    logp: torch.Tensor
    """ℓ_θ: (B,) sequence estimates (for the ELBO estimators the ELBO), or (B, L) per-token terms."""
    old_logp: torch.Tensor
    """ℓ_old, the same estimate under the policy that wrote the rollouts, on the same masks."""
    advantages: torch.Tensor
    """(B,) group advantages."""
    group_size: int
    """G."""
    completion_mask: torch.Tensor | None = None
    """(B, L) the scored slots (what token ratios, length normalisation and SPG read)."""
    ref_logp: torch.Tensor | None = None
    """ℓ under the initial policy, on ℓ_old's masks (when the config's `needs_reference` or drift_kl)."""
    weight_logp: torch.Tensor | None = None
    """ℓ_θ on a separate mask draw, for weights (when the config's `weight_masks`), no graph ..."""
    weight_old_logp: torch.Tensor | None = None
    """... and ℓ_old on that draw."""
    eubo: torch.Tensor | None = None
    """(B,) SPG's EUBO of θ on the views of `logp` (when the config's `eubo_beta` is set)."""
    step_rows: int | None = None
    """P·G, the rows a step is set to train on (what a loss with a constant normaliser divides by,
    whatever the groups kept and the rounds); None: this batch's rows."""

    def first_rows(self, n: int) -> "ScoredBatch":
        """The batch of its first n rows (whole groups)."""
        cut = {f.name: getattr(self, f.name)[:n] for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **cut)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or x.size(0) % group_size:
        raise ValueError(f"batch of {x.size(0)} rows is not a whole number of groups of {group_size}")
    return x.view(x.size(0) // group_size, group_size, *x.shape[1:])  # (num_groups, G, ...)


def group_advantages(rewards: torch.Tensor, group_size: int,
                     scale: Literal["none", "std", "leave_one_out"] = "none") -> torch.Tensor:
    """(B,) rewards -> (B,) advantages relative to the group mean; "leave_one_out":
    relative to the mean of the other G − 1 rewards, r_i − mean_{j≠i} r_j = G/(G − 1)·(r_i − mean)
    (DiffuCoder's coupled-GRPO)."""
    r = _groups(rewards.float(), group_size)  # (num_groups, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=True).nan_to_num(0.0) + 1e-4)
    elif scale == "leave_one_out":
        if group_size < 2:
            raise ValueError("leave_one_out advantages need groups of at least 2")
        adv = adv * (group_size / (group_size - 1))
    elif scale != "none":
        raise ValueError(f"scale must be 'none', 'std' or 'leave_one_out', got {scale!r}")
    return adv.flatten()


def log_ratios(
    logp: torch.Tensor, old_logp: torch.Tensor, level: RatioLevel, completion_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """log ρ: (B,) for sequence levels (from (B,) estimates), (B, L) for ``token``
    (from (B, L) per-token terms). Not clamped (GRPO clamps it before exp(), see the module docstring)."""
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ in shape")
    diff = logp - old_logp.detach()
    if level == "sequence":
        if diff.dim() != 1:
            raise ValueError("sequence ratios need (B,) sequence estimates")
    elif level == "sequence_normalized":
        if diff.dim() != 1 or completion_mask is None:
            raise ValueError("sequence_normalized ratios need (B,) estimates and the completion_mask")
        diff = diff / completion_mask.sum(-1).clamp(min=1)
    elif level == "token":
        if diff.dim() != 2 or completion_mask is None:
            raise ValueError("token ratios need (B, L) per-token terms and the completion_mask")
    else:
        raise ValueError(f"ratio level must be sequence, sequence_normalized or token, got {level!r}")
    return diff


def _clamped(log_rho: torch.Tensor) -> torch.Tensor:
    """log ρ within ±MAX_LOG_RATIO, so that its exp() is finite in float32."""
    return log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π_θ ‖ π_ref): e^{ref−θ} − (ref−θ) − 1 ≥ 0, elementwise."""
    d = (ref_logp.detach() - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1


def aggregate_tokens(x: torch.Tensor, completion_mask: torch.Tensor, how: TokenAggregation, *, group_size: int = 1,
                     step_rows: int | None = None) -> torch.Tensor:
    """(B, L) per-token terms x -> scalar, counting only the n_b scored slots of each row b.

    ``sequence_mean``: (1/B) Σ_b (1/n_b) Σ_i x_bi, every completion counts the same (GRPO,
    Shao et al. 2024, Eq. 3). ``group_token_mean``: the mean over groups of
    Σ_{b∈g} Σ_i x_bi / Σ_{b∈g} n_b, every token of a group counts the same (DAPO, Yu et al.
    2025). ``batch_token_mean``: Σ_b Σ_i x_bi / Σ_b n_b, every token of the batch
    counts the same (d1's trainer). ``constant``: Σ_b Σ_i x_bi / (step_rows · L), each token
    counts 1/(P·G·L) whatever the lengths and the groups kept (Dr. GRPO, Liu et al. 2025,
    with their code's constant; step_rows None: this batch's B). The first three are equal when
    every n_b is equal, and the last is too when every n_b is L and no group is dropped."""
    m = completion_mask.to(x.dtype)  # (B, L)
    if how == "sequence_mean":
        return ((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()  # the mean over rows of each row's token mean
    if how == "group_token_mean":
        per_group = _groups((x * m).sum(-1), group_size).sum(1)  # (num_groups,)
        return (per_group / _groups(m.sum(-1), group_size).sum(1).clamp(min=1)).mean()
    if how == "batch_token_mean":
        return (x * m).sum() / m.sum().clamp(min=1)
    if how == "constant":
        return (x * m).sum() / ((x.size(0) if step_rows is None else step_rows) * x.size(1))
    raise ValueError(f"token aggregation must be one of sequence_mean, group_token_mean, batch_token_mean, "
                     f"constant; got {how!r}")


def share_of_loss(normaliser: Normaliser, completion_mask: torch.Tensor, lo: int, hi: int) -> float:
    """How much a loss over rows [lo, hi) of a batch counts in the loss over the whole batch (the
    accumulation rounds, grad_agreement's halves), for a loss divided by `normaliser`: their rows /
    the batch's (sequences), their scored tokens / the batch's (tokens), or 1 (constant: the parts'
    losses add up to the whole's)."""
    if normaliser == "sequences":
        return (hi - lo) / completion_mask.size(0)
    if normaliser == "tokens":
        return (completion_mask[lo:hi].sum() / completion_mask.sum().clamp(min=1)).item()
    if normaliser == "constant":
        return 1.0
    raise ValueError(f"normaliser must be sequences, tokens or constant, got {normaliser!r}")


@torch.no_grad()
def ratio_diagnostics(batch: ScoredBatch, *, level: RatioLevel = "sequence", clip_eps: float = 0.2,
                      log_rho: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> dict[str, float]:
    """The ratio diagnostics of a batch, for any objective's metrics (the progress bar's ratio_max,
    the report's panels). Of ρ = exp(ℓ_θ − ℓ_old) at `level`, log ρ clamped to ±80 (`log_rho`:
    another log-ratio of the batch's rows, e.g. of a separate mask draw): ratio_mean, ratio_std,
    ratio_max, log_ratio_std; clip_fraction, ρ outside [1 − ε, 1 + ε]; bypass_fraction, A < 0 and
    ρ > 1 + ε (what GRPO's conditional clip lets through); ess, the mean over groups of 1/Σ_i w_i²
    (in [1, G]) of the objective's (num_groups, G) `weights`, else of each group's self-normalised
    ratios ρ_i / Σ_j ρ_j (sequence levels; token ratios have none). Token ratios: over scored tokens."""
    if log_rho is None:
        log_rho = log_ratios(batch.logp.detach(), batch.old_logp, level, batch.completion_mask)  # (B,) or (B, L)
    if weights is None and log_rho.dim() == 1:
        weights = torch.softmax(_groups(log_rho.float(), batch.group_size), dim=1)  # (num_groups, G)
    log_rho, a = _clamped(log_rho.detach()), batch.advantages
    if log_rho.dim() == 2:  # token level: statistics over scored tokens, advantage broadcast
        m = batch.completion_mask.bool()
        a = a[:, None].expand_as(log_rho)[m]
        log_rho = log_rho[m]
    rho = log_rho.exp()
    outside = (rho < 1 - clip_eps) | (rho > 1 + clip_eps)
    out = {
        "ratio_mean": float(rho.mean()),
        "ratio_std": float(rho.std()) if rho.numel() > 1 else 0.0,
        "ratio_max": float(rho.max()),
        "log_ratio_std": float(log_rho.std()) if rho.numel() > 1 else 0.0,
        "clip_fraction": float(outside.float().mean()),
        "bypass_fraction": float(((a < 0) & (rho > 1 + clip_eps)).float().mean()),
    }
    if weights is not None:
        out["ess"] = float((1.0 / (weights**2).sum(1)).mean())  # effective sample size, in [1, G]
    return out


# --- The registry, and the objectives -----------------------------------------------------------

Loss = TypeVar("Loss", bound=Callable[[Any, ScoredBatch], LossOutput])

OBJECTIVES: dict[str, Callable[[Any, ScoredBatch], LossOutput]] = {}
"""objective.name -> its loss: (its options, a ScoredBatch) -> LossOutput; filled by `objective`."""


def objective(name: str) -> Callable[[Loss], Loss]:
    """Register the decorated loss `(options, batch: ScoredBatch) -> LossOutput` as objective `name`.
    Its options are the `ObjectiveSection` subclass with that `name`, defined before it (which made
    it the config section `objective: {name: ...}`); it declares what the loss is divided by."""

    def register(loss: Loss) -> Loss:
        if name not in OBJECTIVE_SECTIONS:
            raise ValueError(f"objective {name!r} has no options: define a dataclass deriving from "
                             f"stabledrl.settings.ObjectiveSection with name: Literal[{name!r}] = {name!r} before its loss")
        OBJECTIVES[name] = loss
        return loss

    return register


def objective_for(cfg: Any) -> Callable[[ScoredBatch], LossOutput]:
    """The objective of a config section (`cfg.name` picks it from `OBJECTIVES`), as a function of the batch."""
    if cfg.name not in OBJECTIVES:
        raise ValueError(f"objective {cfg.name!r} has options but no loss: decorate it with @objective({cfg.name!r})")
    fn = OBJECTIVES[cfg.name]
    return lambda batch: fn(cfg, batch)


@objective("stabledrl")
def stabledrl_loss(opts: StableDRLConfig, batch: ScoredBatch) -> LossOutput:
    """StableDRL: unconditional clipping + group self-normalisation (docs/methods.md, "StableDRL").

    `batch.weight_logp` / `weight_old_logp`: optional estimates from a *separate* mask draw, used
    only for the weights, so that w_i and ∇ℓ_i do not share the same mask noise
    (docs/methods.md, "Open questions"); by default the weights use `logp` itself. With
    `likelihood: spg` (the authors' StableDRL) the weights read the ELBO `logp` and the gradient
    SPG's sandwich of it and `batch.eubo`.

    The log-ratios are not clamped: the softmax subtracts each group's largest clipped
    log-ratio, so the weights are right however negative the log-ratios are."""
    if opts.likelihood == "spg":
        sandwich = spg_likelihood(batch.logp, batch.eubo, batch.advantages, omega=opts.spg_omega)
        batch = replace(batch, logp=sandwich, weight_logp=batch.logp, weight_old_logp=batch.old_logp)
    logp, old_logp, advantages, group_size = batch.logp, batch.old_logp, batch.advantages, batch.group_size
    weight_logp, weight_old_logp = batch.weight_logp, batch.weight_old_logp
    if opts.clip not in ("upper", "two_sided"):
        raise ValueError(f"clip must be 'upper' or 'two_sided', got {opts.clip!r}")
    if (weight_logp is None) != (weight_old_logp is None):
        raise ValueError("pass both weight_logp and weight_old_logp, or neither")
    _groups(advantages, group_size)
    wl = logp if weight_logp is None else weight_logp
    wo = old_logp if weight_old_logp is None else weight_old_logp
    log_rho = log_ratios(wl.detach(), wo.detach(), opts.ratio_level, batch.completion_mask)  # (B,), unclamped
    if opts.clip == "upper":
        clipped = log_rho.clamp(max=torch.log(torch.tensor(opts.clip_max)).item())
    else:
        eps = opts.clip_eps
        clipped = log_rho.clamp(torch.log1p(torch.tensor(-eps)).item(), torch.log1p(torch.tensor(eps)).item())
    w = torch.softmax(_groups(clipped, group_size), dim=1)  # (num_groups, G), rows sum to 1
    per_group = (w * _groups(advantages.detach(), group_size) * _groups(logp, group_size)).sum(1)  # (num_groups,)
    loss = -per_group.mean()
    return LossOutput(loss, ratio_diagnostics(batch, log_rho=log_rho, weights=w, clip_eps=opts.clip_eps))


@objective("grpo")
def grpo_loss(opts: GRPOConfig, batch: ScoredBatch) -> LossOutput:
    """GRPO with conditional clipping (docs/methods.md, "GRPO"), plus β·KL_k3 to `batch.ref_logp`
    when β > 0. Token ratios: per-token terms become the loss (the KL term too) by
    `opts.token_aggregation` (`aggregate_tokens`: GRPO's, DAPO's or Dr. GRPO's); sequence ratios:
    the mean over rows, i.e. −(1/G) Σ_i within a group, then the mean over groups."""
    logp, advantages, completion_mask = batch.logp, batch.advantages, batch.completion_mask
    _groups(advantages, batch.group_size)  # shape check
    log_rho = _clamped(log_ratios(logp, batch.old_logp, opts.ratio_level, completion_mask))  # (B,) or (B, L)
    if opts.token_aggregation != "sequence_mean" and log_rho.dim() != 2:
        raise ValueError(f"token_aggregation {opts.token_aggregation!r} needs token ratios (ratio_level='token')")
    rho = log_rho.exp()
    adv = advantages.detach() if log_rho.dim() == 1 else advantages.detach()[:, None]
    pg_loss1 = rho * adv
    pg_loss2 = rho.clamp(1 - opts.clip_eps, 1 + opts.clip_eps) * adv
    per = torch.minimum(pg_loss1, pg_loss2)  # (B,) or (B, L)

    def aggregate(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            return x.mean()
        return aggregate_tokens(x, completion_mask, opts.token_aggregation, group_size=batch.group_size,
                                step_rows=batch.step_rows)

    loss = -aggregate(per)
    metrics = ratio_diagnostics(batch, log_rho=log_rho, clip_eps=opts.clip_eps)
    if opts.beta:
        if batch.ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = aggregate(kl_k3(logp, batch.ref_logp))  # of (B,) or (B, L) terms
        loss = loss + opts.beta * kl
        metrics["kl_ref"] = float(kl.detach())
    return LossOutput(loss, metrics)


@objective("wd1")
def wd1_loss(opts: WD1Config, batch: ScoredBatch) -> LossOutput:
    """wd1: loss = mean over groups of Σ_i (softmax(−ψA)_i − softmax(ψA)_i) ℓ_i (docs/methods.md,
    "wd1"). `batch.old_logp` enters only the ratio diagnostics, which are logged as for the
    other objectives (they show how far θ has moved, not a term of the loss; `clip_eps`
    is the band of their clip_fraction)."""
    if opts.psi <= 0:
        raise ValueError(f"psi must be positive, got {opts.psi}")
    adv = _groups(batch.advantages.detach(), batch.group_size)  # (num_groups, G)
    coef = torch.softmax(-opts.psi * adv, dim=1) - torch.softmax(opts.psi * adv, dim=1)  # (num_groups, G)
    loss = (coef * _groups(batch.logp, batch.group_size)).sum(1).mean()
    return LossOutput(loss, ratio_diagnostics(batch, level=opts.ratio_level, clip_eps=opts.clip_eps))


def spg_likelihood(elbo: torch.Tensor, eubo: torch.Tensor, advantages: torch.Tensor, *,
                   omega: float = 0.5) -> torch.Tensor:
    """SPG's sandwich (module docstring): (B,) ELBO where A > 0, ω·EUBO + (1 − ω)·ELBO elsewhere."""
    if not 0 <= omega <= 1:
        raise ValueError(f"omega must be in [0, 1], got {omega}")
    if not elbo.shape == eubo.shape == advantages.shape or elbo.dim() != 1:
        raise ValueError(f"elbo, eubo and advantages must be (B,) alike, got {tuple(elbo.shape)}, "
                         f"{tuple(eubo.shape)} and {tuple(advantages.shape)}")
    return torch.where(advantages.detach() > 0, elbo, omega * eubo + (1 - omega) * elbo)


@objective("spg")
def spg_loss(opts: SPGConfig, batch: ScoredBatch) -> LossOutput:
    """SPG: mean over groups of −Σ_i (n_i / Σ_j n_j) A_i ℓ̃_i, ℓ̃ = `spg_likelihood` of the ELBO
    `batch.logp` and `batch.eubo` (docs/methods.md, "SPG"). No ratio: `batch.old_logp`, the
    old ELBO, enters only the ratio diagnostics (ELBO_θ − ELBO_old)."""
    elbo, eubo, advantages, group_size = batch.logp, batch.eubo, batch.advantages, batch.group_size
    sandwich = spg_likelihood(elbo, eubo, advantages, omega=opts.spg_omega)
    n = _groups(batch.completion_mask.sum(-1).to(sandwich.dtype), group_size)  # (num_groups, G)
    share = n / n.sum(1, keepdim=True)
    loss = -(share * _groups(advantages.detach(), group_size) * _groups(sandwich, group_size)).sum(1).mean()
    metrics = ratio_diagnostics(batch, clip_eps=opts.clip_eps)
    metrics["eubo_gap"] = float((eubo - elbo).detach().mean())  # how far apart the two bounds are
    return LossOutput(loss, metrics)
