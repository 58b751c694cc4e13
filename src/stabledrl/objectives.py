"""RL objectives for diffusion LMs: GRPO, StableDRL, wd1 and SPG, as pure tensor functions
(docs/methods.md, "Objectives": the equations, and where they part from the papers).

Every loss takes likelihood estimates (`stabledrl.likelihood`), not a model, and returns a
`LossOutput(loss, metrics)`. Rows are laid out group by group: rows [g·G, (g+1)·G) are the
G completions of prompt g. The loop hands an objective one `ScoredBatch`; `OBJECTIVES` maps
each `objective.name` to a function (its config section, the batch) -> LossOutput
(docs/extending.md: adding your own).

Ratios: ``sequence`` ρ = exp(ℓ_θ − ℓ_old); ``sequence_normalized`` exp((ℓ_θ − ℓ_old)/|y|)
(GSPO / GDPO); ``token`` per-token ratios. `log_ratios` returns log ρ unclamped; GRPO, where
ρ itself is exponentiated, clamps log ρ to ±80 so a float32 ratio never overflows, and the
ratio diagnostics use the same clamp. StableDRL's softmax needs no clamp.

Shapes: B = num_groups · G rows, L completion slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal

import torch

__all__ = [
    "LossOutput",
    "ScoredBatch",
    "OBJECTIVES",
    "objective_for",
    "group_advantages",
    "log_ratios",
    "grpo_loss",
    "stabledrl_loss",
    "wd1_loss",
    "spg_likelihood",
    "spg_loss",
    "kl_k3",
    "aggregate_tokens",
]

RatioLevel = Literal["sequence", "sequence_normalized", "token"]
TokenAggregation = Literal["sequence_mean", "batch_token_mean"]
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


def _token_mean(x: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    m = completion_mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)


def aggregate_tokens(x: torch.Tensor, completion_mask: torch.Tensor, how: TokenAggregation) -> torch.Tensor:
    """(B, L) per-token terms -> scalar, counting only the scored slots of `completion_mask`.

    ``sequence_mean``: (1/B) Σ_b (1/n_b) Σ_i x_bi — every completion counts the same
    (this project's default). ``batch_token_mean``:
    Σ_b Σ_i x_bi / Σ_b n_b — every token counts the same, so long completions weigh
    more (d1's diffu-GRPO). They are equal when every n_b is equal."""
    if how == "sequence_mean":
        return _token_mean(x, completion_mask).mean()
    if how == "batch_token_mean":
        m = completion_mask.to(x.dtype)
        return (x * m).sum() / m.sum().clamp(min=1)
    raise ValueError(f"token aggregation must be 'sequence_mean' or 'batch_token_mean', got {how!r}")


@torch.no_grad()
def _ratio_metrics(log_rho: torch.Tensor, adv: torch.Tensor, eps: float, completion_mask: torch.Tensor | None):
    rho = log_rho.exp()
    if rho.dim() == 2:  # token level: statistics over scored tokens, advantage broadcast
        m = completion_mask.bool()
        a = adv[:, None].expand_as(rho)[m]
        rho = rho[m]
    else:
        a = adv
    outside = (rho < 1 - eps) | (rho > 1 + eps)
    return {
        "ratio_mean": float(rho.mean()),
        "ratio_std": float(rho.std()) if rho.numel() > 1 else 0.0,
        "ratio_max": float(rho.max()),
        "log_ratio_std": float(rho.log().std()) if rho.numel() > 1 else 0.0,
        "clip_fraction": float(outside.float().mean()),
        "bypass_fraction": float(((a < 0) & (rho > 1 + eps)).float().mean()),
    }


def grpo_loss(batch: ScoredBatch, *, clip_eps: float = 0.2, ratio_level: RatioLevel = "sequence", beta: float = 0.0,
              token_aggregation: TokenAggregation = "sequence_mean") -> LossOutput:
    """GRPO with conditional clipping and fixed 1/G normalisation (docs/methods.md, "GRPO"),
    plus β·KL_k3 to `batch.ref_logp` when β > 0. `token_aggregation` (token ratios only; the
    KL term too): how per-token terms become the loss, see `aggregate_tokens`."""
    logp, old_logp, advantages, group_size = batch.logp, batch.old_logp, batch.advantages, batch.group_size
    completion_mask, ref_logp = batch.completion_mask, batch.ref_logp
    _groups(advantages, group_size)  # shape check
    log_rho = _clamped(log_ratios(logp, old_logp, ratio_level, completion_mask))  # (B,) or (B, L)
    if token_aggregation != "sequence_mean" and log_rho.dim() != 2:
        raise ValueError(f"token_aggregation {token_aggregation!r} needs token ratios (ratio_level='token')")
    rho = log_rho.exp()
    adv = advantages.detach() if log_rho.dim() == 1 else advantages.detach()[:, None]
    pg_loss1 = rho * adv
    pg_loss2 = rho.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per = torch.minimum(pg_loss1, pg_loss2)  # (B,) or (B, L)
    # −(1/G) Σ_i within a group, then the mean over groups: a plain mean over rows
    # (token ratios: over rows of per-sequence token means, or over all scored tokens).
    loss = -(aggregate_tokens(per, completion_mask, token_aggregation) if per.dim() == 2 else per.mean())
    metrics = _ratio_metrics(log_rho.detach(), advantages, clip_eps, completion_mask)
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_k3(logp, ref_logp)  # (B,) or (B, L)
        kl = aggregate_tokens(kl, completion_mask, token_aggregation) if kl.dim() == 2 else kl.mean()
        loss = loss + beta * kl
        metrics["kl_ref"] = float(kl.detach())
    return LossOutput(loss, metrics)


def stabledrl_loss(batch: ScoredBatch, *, clip: Literal["upper", "two_sided"] = "upper", clip_max: float = 5.0,
                   clip_eps: float = 0.2,
                   ratio_level: Literal["sequence", "sequence_normalized"] = "sequence") -> LossOutput:
    """StableDRL: unconditional clipping + group self-normalisation (docs/methods.md, "StableDRL").

    `batch.weight_logp` / `weight_old_logp`: optional estimates from a *separate* mask draw, used
    only for the weights, so that w_i and ∇ℓ_i do not share the same mask noise
    (docs/methods.md, "Open questions"); by default the weights use `logp` itself.

    The log-ratios are not clamped: the softmax subtracts each group's largest clipped
    log-ratio, so the weights are right however negative the log-ratios are."""
    logp, old_logp, advantages, group_size = batch.logp, batch.old_logp, batch.advantages, batch.group_size
    weight_logp, weight_old_logp, completion_mask = batch.weight_logp, batch.weight_old_logp, batch.completion_mask
    if clip not in ("upper", "two_sided"):
        raise ValueError(f"clip must be 'upper' or 'two_sided', got {clip!r}")
    if (weight_logp is None) != (weight_old_logp is None):
        raise ValueError("pass both weight_logp and weight_old_logp, or neither")
    _groups(advantages, group_size)
    wl = logp if weight_logp is None else weight_logp
    wo = old_logp if weight_old_logp is None else weight_old_logp
    log_rho = log_ratios(wl.detach(), wo.detach(), ratio_level, completion_mask)  # (B,), unclamped
    if clip == "upper":
        clipped = log_rho.clamp(max=torch.log(torch.tensor(clip_max)).item())
    else:
        clipped = log_rho.clamp(torch.log1p(torch.tensor(-clip_eps)).item(), torch.log1p(torch.tensor(clip_eps)).item())
    w = torch.softmax(_groups(clipped, group_size), dim=1)  # (num_groups, G), rows sum to 1
    per_group = (w * _groups(advantages.detach(), group_size) * _groups(logp, group_size)).sum(1)  # (num_groups,)
    loss = -per_group.mean()
    metrics = _ratio_metrics(_clamped(log_rho), advantages, clip_eps, completion_mask)
    metrics["ess"] = float((1.0 / (w**2).sum(1)).mean())  # effective sample size, in [1, G]
    return LossOutput(loss, metrics)


def wd1_loss(batch: ScoredBatch, *, psi: float = 1.0, clip_eps: float = 0.2,
             ratio_level: Literal["sequence", "sequence_normalized"] = "sequence") -> LossOutput:
    """wd1: loss = mean over groups of Σ_i (softmax(−ψA)_i − softmax(ψA)_i) ℓ_i (docs/methods.md,
    "wd1"). `batch.old_logp` enters only the ratio diagnostics, which are logged as for the
    other objectives (they show how far θ has moved, not a term of the loss; `clip_eps`
    is the band of their clip_fraction)."""
    logp, old_logp, advantages, group_size = batch.logp, batch.old_logp, batch.advantages, batch.group_size
    completion_mask = batch.completion_mask
    if psi <= 0:
        raise ValueError(f"psi must be positive, got {psi}")
    adv = _groups(advantages.detach(), group_size)  # (num_groups, G)
    coef = torch.softmax(-psi * adv, dim=1) - torch.softmax(psi * adv, dim=1)  # (num_groups, G)
    loss = (coef * _groups(logp, group_size)).sum(1).mean()
    log_rho = log_ratios(logp.detach(), old_logp.detach(), ratio_level, completion_mask)  # (B,)
    return LossOutput(loss, _ratio_metrics(_clamped(log_rho), advantages, clip_eps, completion_mask))


def spg_likelihood(elbo: torch.Tensor, eubo: torch.Tensor, advantages: torch.Tensor, *,
                   omega: float = 0.5) -> torch.Tensor:
    """SPG's sandwich (module docstring): (B,) ELBO where A > 0, ω·EUBO + (1 − ω)·ELBO elsewhere."""
    if not 0 <= omega <= 1:
        raise ValueError(f"omega must be in [0, 1], got {omega}")
    if not elbo.shape == eubo.shape == advantages.shape or elbo.dim() != 1:
        raise ValueError(f"elbo, eubo and advantages must be (B,) alike, got {tuple(elbo.shape)}, "
                         f"{tuple(eubo.shape)} and {tuple(advantages.shape)}")
    return torch.where(advantages.detach() > 0, elbo, omega * eubo + (1 - omega) * elbo)


def spg_loss(batch: ScoredBatch, *, omega: float = 0.5, clip_eps: float = 0.2) -> LossOutput:
    """SPG: mean over groups of −Σ_i (n_i / Σ_j n_j) A_i ℓ̃_i, ℓ̃ = `spg_likelihood` of the ELBO
    `batch.logp` and `batch.eubo` (docs/methods.md, "SPG"). No ratio: `batch.old_logp`, the
    old ELBO, enters only the ratio diagnostics (ELBO_θ − ELBO_old)."""
    elbo, eubo, old_elbo, advantages = batch.logp, batch.eubo, batch.old_logp, batch.advantages
    group_size, completion_mask = batch.group_size, batch.completion_mask
    sandwich = spg_likelihood(elbo, eubo, advantages, omega=omega)
    n = _groups(completion_mask.sum(-1).to(sandwich.dtype), group_size)  # (num_groups, G)
    share = n / n.sum(1, keepdim=True)
    loss = -(share * _groups(advantages.detach(), group_size) * _groups(sandwich, group_size)).sum(1).mean()
    log_rho = log_ratios(elbo.detach(), old_elbo.detach(), "sequence")
    metrics = _ratio_metrics(_clamped(log_rho), advantages, clip_eps, completion_mask)
    metrics["eubo_gap"] = float((eubo - elbo).detach().mean())  # how far apart the two bounds are
    return LossOutput(loss, metrics)


def _grpo(cfg: Any, b: ScoredBatch) -> LossOutput:
    return grpo_loss(b, clip_eps=cfg.clip_eps, ratio_level=cfg.ratio_level, beta=cfg.beta,
                     token_aggregation=cfg.token_aggregation)


def _stabledrl(cfg: Any, b: ScoredBatch) -> LossOutput:
    if cfg.likelihood == "spg":  # the authors' StableDRL: weights from the ELBO, the sandwich in the gradient
        sandwich = spg_likelihood(b.logp, b.eubo, b.advantages, omega=cfg.spg_omega)
        b = replace(b, logp=sandwich, weight_logp=b.logp, weight_old_logp=b.old_logp)
    return stabledrl_loss(b, clip=cfg.clip, clip_max=cfg.clip_max, clip_eps=cfg.clip_eps, ratio_level=cfg.ratio_level)


def _wd1(cfg: Any, b: ScoredBatch) -> LossOutput:
    return wd1_loss(b, psi=cfg.psi, clip_eps=cfg.clip_eps, ratio_level=cfg.ratio_level)


def _spg(cfg: Any, b: ScoredBatch) -> LossOutput:
    return spg_loss(b, omega=cfg.spg_omega, clip_eps=cfg.clip_eps)


OBJECTIVES: dict[str, Callable[[Any, ScoredBatch], LossOutput]] = {
    "stabledrl": _stabledrl,
    "grpo": _grpo,
    "wd1": _wd1,
    "spg": _spg,
}
"""objective.name -> the objective: (its config section, a ScoredBatch) -> LossOutput."""


def objective_for(cfg: Any) -> Callable[[ScoredBatch], LossOutput]:
    """The objective of a config section (`cfg.name` picks it from `OBJECTIVES`), as a function of the batch."""
    fn = OBJECTIVES[cfg.name]
    return lambda batch: fn(cfg, batch)
