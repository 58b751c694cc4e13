"""Masked-diffusion generation for full-attention and block-diffusion models
(docs/methods.md, "Sampling" and "Sampling: how a step decodes").

Start from L mask tokens after the prompt; over T steps, predict every masked slot and
commit the ones the remasking rule picks: ``low_confidence`` the most probable (LLaDA, Nie
et al. 2025, Alg. 5), ``random`` uniformly; with ``block_length`` < L in semi-autoregressive
blocks, left to right. Each step commits ceil(masked left in the block / steps left) slots,
and once a slot decodes to a stop token (EOS, PAD, named ones) every later slot becomes PAD,
as in SFT targets; MASK and the other special tokens are never drawn (`banned_token_ids`).
The prompt columns are never written. Temperature is Gumbel-max with noise from explicit
generators, one per row, so a row's completion does not depend on its batch. Block models
decode in their own blocks (``prompt_attention``, `stabledrl.models.attention`).

Fast decoding (`SamplingConfig`): ``noise="counter"`` (device-side counter noise: other
tokens, the same distribution; the default at a vocabulary of 32k tokens up), ``threshold`` (Fast-dLLM's parallel decoding),
``approx_cache`` (Fast-dLLM's approximate KV caches of a full-attention model).

Shapes: B batch, P prompt columns, L completion length, V vocabulary; a step runs on A rows
and W columns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Sequence

import torch
from tqdm.auto import tqdm

from stabledrl.cuda_graphs import CapturedCall, check_capturable
from stabledrl.data import banned_token_ids, position_ids, stop_ids_of
from stabledrl.data import completion_mask as _completion_mask
from stabledrl.models.attention import (
    block_causal_attention_mask,
    block_offset,
    completion_blocks,
    prompt_attention_of,
    tail_width,
)
from stabledrl.models.lora import lean_adapters
from stabledrl.models.policy import Policy
from stabledrl.settings import COUNTER_NOISE_VOCAB, SamplingConfig  # defined without torch, for the command line

__all__ = ["SamplingConfig", "GenerationOutput", "RolloutRequest", "generate", "generate_micro_batched",
           "micro_batch_calls", "row_generators", "row_keys", "check_sampler", "resolve_noise", "counter_uniform", "categorical",
           "concat_outputs"]


@dataclass
class GenerationOutput:
    sequences: torch.Tensor
    """(B, P + L) prompt and completion."""
    completion_ids: torch.Tensor
    """(B, L) completion tokens; PAD after the first EOS."""
    completion_mask: torch.Tensor
    """(B, L) bool, True up to and including the first EOS: the scored positions."""
    unmask_step: torch.Tensor
    """(B, L) the step (0-based, global over blocks) at which each slot was committed
    (or turned into PAD by an EOS before it); with the generator's seed and the
    sampling settings this replays the rollout."""
    forward_passes: int
    """Model calls made (each on the rows that still had masks)."""
    entropy: torch.Tensor
    """(B,) mean entropy (nats) of the model's distribution at each slot it committed,
    at the step it committed it (special tokens other than EOS excluded)."""
    token_logprob: torch.Tensor | None = None
    """(B, L) the sampler's own log-probability of each scored token: log p(y_i) under the
    model's distribution (untempered, over the whole vocabulary) in the call that committed
    slot i, what the `path` estimator scores (`stabledrl.likelihood`); 0 on the unscored
    slots. (The draw itself excludes MASK, PAD, BOS and UNK, and is tempered.) Filled by the
    built-in sampler when asked, ``generate(record_logprob=True)`` (a logsumexp over the
    vocabulary for every eligible slot of every step: a quarter to a third of a step's draw at
    a 126k vocabulary), else None; the trainer does not read it, and another engine may leave it None."""


def _rows_topk(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, L) scores, (B,) counts -> (B, L) bool selecting each row's k[b] highest scores."""
    order = scores.argsort(dim=-1, descending=True)  # (B, L)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.size(-1), device=scores.device).expand_as(order))
    return rank < k[:, None]


Generators = torch.Generator | Sequence[torch.Generator] | None


def _rand(shape: torch.Size, generator: Generators, rows: torch.Tensor, device, dtype=torch.float32,
          own: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform noise of `shape` (A, W, ...) for batch rows `rows`: from the one generator, or
    row b's part from generator[b]. With per-row generators, `own` (A, W) bool limits row
    b's draws to its own columns (the others get 0.5, never used), so that what a row draws
    does not depend on the columns its batch spans."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device, dtype=dtype)
    if own is None:
        draws = [torch.rand(shape[1:], generator=generator[b], dtype=dtype) for b in rows.tolist()]
        return torch.stack(draws).to(device)
    out = torch.full(shape, 0.5, dtype=dtype)
    for a, b in enumerate(rows.tolist()):
        cols = own[a].nonzero().flatten().cpu()
        if cols.numel():
            out[a, cols] = torch.rand((cols.numel(), *shape[2:]), generator=generator[b], dtype=dtype)
    return out.to(device)


_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31: a 32-bit value times it stays below 2**63, so int64 products are exact


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 values in [0, 2**32) onto the same range (two rounds of
    xorshift-multiply). Only exact int64 operations: products of a 32-bit value and a
    constant below 2**31, right shifts of non-negative values; the same bits on every device."""
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


def counter_uniform(keys: torch.Tensor, step: int | torch.Tensor, cols: torch.Tensor, purpose: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), float64 (A, W): a pure function of each row's key
    (A, 2) (two 32-bit halves, `row_keys`), its step (an int or (A,)), the completion column
    (A, W) or (W,) and the draw's `purpose` (0: the token, 1: the random remasking score).
    Nothing is consumed, so a row's draws do not depend on its batch, micro-batch, process
    or device."""
    step = torch.as_tensor(step, dtype=torch.long, device=keys.device).expand(keys.size(0))  # (A,)
    h = _mix32(_mix32(keys[:, 0] ^ _mix32(keys[:, 1] ^ purpose)) ^ step)  # (A,)
    h = _mix32(_mix32(h[:, None] ^ cols.to(keys.device)))  # (A, W)
    return (h.double() + 0.5) / 2.0**32


def row_keys(generator: Generators, B: int, device) -> torch.Tensor | None:
    """(B, 2) the counter keys of B rows, two 32-bit values drawn from each row's generator
    (or B pairs from the one generator); None without a generator. A fresh generator with
    the same seed gives the same keys; drawing them advances it, so a reused generator
    gives new rollouts, as with the generator noise."""
    if generator is None:
        return None
    if isinstance(generator, torch.Generator):
        keys = torch.randint(0, 2**32, (B, 2), generator=generator)
    else:
        keys = torch.stack([torch.randint(0, 2**32, (2,), generator=g) for g in generator])
    return keys.to(device)


def categorical(probs: torch.Tensor, u: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Inverse-CDF draw: (N, V) probabilities (unnormalised, ≥ 0, a positive sum) and (N,)
    uniforms -> (N,) the first index whose cumulative mass exceeds u times the total. In two
    levels: the chunk holding the target, then the token within it. Each chunk's mass is summed
    in the input's dtype (a float64 sum over the vocabulary costs ten times more on a CPU) and
    accumulated over chunks in float64, so the draw departs from an all-float64 one only for a
    target within ~1e-7 of a chunk's edge. A zero-probability token is never returned."""
    N, V = probs.shape
    whole = V - V % chunk
    sums = probs[:, :whole].reshape(N, -1, chunk).sum(-1)  # (N, V // chunk)
    if whole < V:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=1)
    cum = sums.double().cumsum(-1)  # (N, C)
    target = u.double() * cum[:, -1]  # (N,)
    j = torch.searchsorted(cum, target[:, None], right=True).clamp(max=cum.size(1) - 1)  # (N, 1) the chunk
    rest = target[:, None] - torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), 0.0)  # (N, 1)
    idx = j * chunk + torch.arange(chunk, device=probs.device)  # (N, chunk)
    p = probs.gather(1, idx.clamp(max=V - 1)).double().masked_fill(idx >= V, 0.0)  # (N, chunk)
    i = torch.searchsorted(p.cumsum(-1), rest, right=True)  # (N, 1)
    # rounding can put the target at the chunk's very end: take its last token of positive mass
    last = ((p > 0) * torch.arange(chunk, device=probs.device)).amax(-1, keepdim=True)  # (N, 1)
    return (j * chunk + torch.minimum(i, last)).squeeze(1)


@dataclass
class _At:
    """Where a denoising step draws: its rows, its step number and its columns."""

    rows: torch.Tensor
    """(A,) the batch rows the step runs on."""
    step: int | torch.Tensor
    """The step number (global over blocks), or (A,) each row's own."""
    cols: torch.Tensor
    """(W,) the completion columns of the step's W."""
    own: torch.Tensor | None = None
    """(A, W) the columns each row draws generator noise for (`_rand`); None: all."""


def _draw_counter(dec: _Decoding, logits: torch.Tensor, eligible: torch.Tensor, at: _At) -> tuple[torch.Tensor, ...]:
    """Counter noise: the draw and its score (each (A, W), 0 off the eligible slots), computed on
    the eligible slots only, in as few passes over the vocabulary as the draw needs (the
    entropy waits for the chosen slots, `_entropy_at`). The token is an inverse-CDF draw from
    the tempered distribution with one counter uniform per slot."""
    temperature = dec.sampling.temperature
    keys = None if dec.keys is None else dec.keys[at.rows]  # (A, 2)
    a, w = eligible.nonzero(as_tuple=True)  # (N,) each
    # (N, V), a copy; of whole rows of V (index_select's row copies, not a gather of each element)
    lg = logits.flatten(0, 1).index_select(0, a * logits.size(1) + w) if logits.is_contiguous() else logits[a, w]
    top = lg.amax(-1, keepdim=True)  # (N, 1)
    if temperature > 0:
        # (N, V) unnormalised tempered probabilities. In lg's own memory where nothing reads lg again
        # (a fresh (N, V) tensor is a pass over new pages), and no division by a temperature of 1 (x / 1
        # is x): the same values.
        weights = lg.sub_(top) if temperature == 1 or dec.sampling.remasking != "low_confidence" else lg - top
        if temperature != 1:
            weights.div_(temperature)
        x0 = categorical(weights.exp_(), counter_uniform(keys, at.step, at.cols, 0)[a, w])
    else:
        x0 = lg.argmax(-1)  # (N,)
    if dec.sampling.remasking == "low_confidence":  # p(x0) at temperature 1, as the generator path computes it
        if temperature != 1:
            weights = (lg - top).exp_()  # (N, V)
        score = weights.gather(-1, x0[:, None]).squeeze(-1) / weights.sum(-1)
    else:
        score = counter_uniform(keys, at.step, at.cols, 1)[a, w].float()
    out = []
    for v, fill in ((x0, 0), (score, 0.0)):
        full = torch.full(eligible.shape, fill, dtype=v.dtype, device=v.device)
        full[a, w] = v
        out.append(full)
    return tuple(out)


def _entropy_at(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """(A, W, V) logits, (A, W) chosen slots -> (A, W) the entropy (nats) of the model's
    distribution at each chosen slot, 0 elsewhere (a banned token's −inf contributes 0)."""
    a, w = chosen.nonzero(as_tuple=True)
    ent = torch.zeros(chosen.shape, device=logits.device)
    ent[a, w] = torch.special.entr(logits[a, w].softmax(-1)).sum(-1)
    return ent


def _draw_generator(dec: _Decoding, logits: torch.Tensor, at: _At) -> tuple[torch.Tensor, ...]:
    """Generator noise (the default, the stream every figure was made with): float64 Gumbel
    noise over every column and the whole vocabulary -> x0, score and entropy, (A, W)."""
    if dec.sampling.temperature > 0:
        u = _rand(logits.shape, dec.generator, at.rows, logits.device, torch.float64, at.own)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        x0 = (logits.double() / dec.sampling.temperature + gumbel).argmax(-1)  # (A, W)
    else:
        x0 = logits.argmax(-1)  # (A, W)
    if dec.sampling.remasking == "low_confidence":
        score = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)  # (A, W) p(x0)
    else:
        score = _rand(x0.shape, dec.generator, at.rows, logits.device, own=at.own)
    logq = logits.log_softmax(-1)  # (A, W, V)
    ent = -(logq.exp() * logq.nan_to_num(neginf=0.0)).sum(-1)  # (A, W)
    return x0, score, ent


def _pick(dec: _Decoding, logits: torch.Tensor, eligible: torch.Tensor, steps_left: int | torch.Tensor,
          at: _At) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One denoising step over W columns: (A, W, V) logits and (A, W) eligible slots, with
    `steps_left` (an int, or (A,) one per row) -> the slots to commit (A, W) bool, their
    tokens x0 (A, W) and the entropy (A, W). With a threshold, also every slot whose score
    exceeds it."""
    logits[..., dec.banned] = -math.inf
    counter = dec.sampling.noise == "counter"
    x0, score, *ent = _draw_counter(dec, logits, eligible, at) if counter else _draw_generator(dec, logits, at)
    score = score.masked_fill(~eligible, -math.inf)
    k = (eligible.sum(-1) + steps_left - 1) // steps_left  # ceil(masked / steps left), (A,)
    if dec.sampling.threshold is not None:  # parallel decoding: every slot above it, at least the schedule's k
        k = torch.maximum(k, (score > dec.sampling.threshold).sum(-1))
    chosen = _rows_topk(score, k) & eligible  # (A, W)
    return chosen, x0, _entropy_at(logits, chosen) if counter else ent[0]


def _step(dec: _Decoding, logits: torch.Tensor, eligible: torch.Tensor, steps_left: int | torch.Tensor,
          at: _At) -> tuple[torch.Tensor, ...]:
    """`_pick`, and when `dec` records them the model's log-probability of each draw (A, W),
    else None: over the whole vocabulary, special tokens included, as the likelihood scores it
    (the draw excludes them); computed on the eligible slots (−inf or 0 elsewhere, never committed)."""
    if dec.logprob is None:
        return *_pick(dec, logits, eligible, steps_left, at), None
    lse = torch.zeros(eligible.shape, device=logits.device)  # (A, W) the model's normaliser
    lse[eligible] = logits[eligible].logsumexp(-1)
    chosen, x0, ent = _pick(dec, logits, eligible, steps_left, at)
    return chosen, x0, ent, logits.gather(-1, x0[..., None]).squeeze(-1) - lse  # x0 is never banned


class _Decoding:
    """One `generate` call: its settings, its noise, and the completion being written."""

    def __init__(self, policy: Policy, sampling: SamplingConfig, B: int, device: torch.device,
                 generator: Generators, synced: bool, record_logprob: bool) -> None:
        self.policy, self.sampling, self.generator, self.synced = policy, sampling, generator, synced
        self.mask_id, self.pad_id = policy.mask_token_id, policy.pad_token_id
        self.stop_ids = stop_ids_of(policy)  # ends a completion; PAD fills the slots after it
        self.banned = banned_token_ids(policy)
        L = sampling.gen_length
        self.comp = torch.full((B, L), self.mask_id, dtype=torch.long, device=device)  # (B, L)
        self.unmask_step = torch.full((B, L), -1, dtype=torch.long, device=device)
        self.entropy_sum = torch.zeros(B, device=device)
        # (B, L) log p of each committed token, if recorded
        self.logprob = torch.zeros((B, L), device=device) if record_logprob else None
        self.committed = torch.zeros(B, device=device)
        self.passes = 0
        # (B, 2) counter-noise keys, drawn before any other noise
        self.keys = row_keys(generator, B, device) if sampling.noise == "counter" else None

    def decode(self, logits: torch.Tensor, eligible: torch.Tensor, steps_left: int | torch.Tensor, at: _At,
               cols: slice) -> None:
        """One step (`_step`) on (A, W, V) logits of the completion columns `cols`, committed."""
        chosen, x0, ent, logp = _step(self, logits, eligible, steps_left, at)
        self.commit(at.rows, cols, chosen, x0, ent, logp, at.step)

    def commit(self, rows: torch.Tensor, cols: slice, chosen, x0, ent, logp, step: int | torch.Tensor) -> None:
        """Write the chosen tokens of rows `rows` in columns `cols`; PAD after the first stop token.
        `step`: the step number, or (A,) each row's own."""
        self.entropy_sum[rows] += (ent * chosen).sum(-1)
        if self.logprob is not None:
            logprob = self.logprob[rows]  # (A, L)
            logprob[:, cols] = torch.where(chosen, logp.float(), logprob[:, cols])
            self.logprob[rows] = logprob
        self.committed[rows] += chosen.sum(-1)
        comp = self.comp[rows]  # (A, L)
        comp[:, cols] = torch.where(chosen, x0, comp[:, cols])
        # After the first stop token only PAD, whether those slots were decoded or not.
        after_eos = ~_completion_mask(comp, self.stop_ids)  # (A, L)
        self.comp[rows] = comp.masked_fill(after_eos, self.pad_id)
        newly = after_eos.clone()
        newly[:, cols] |= chosen
        stamped = self.unmask_step[rows]  # (A, L); a slot keeps the step it was first filled at
        step = step[:, None] if isinstance(step, torch.Tensor) else step
        self.unmask_step[rows] = torch.where(newly & (stamped < 0), step, stamped)

    def output(self, prompt_ids: torch.Tensor) -> GenerationOutput:
        if (self.comp == self.mask_id).any():  # cannot happen with the ceil schedule; guard the invariant
            raise RuntimeError("generation left masks unfilled")
        scored = _completion_mask(self.comp, self.stop_ids)  # (B, L)
        return GenerationOutput(
            sequences=torch.cat([prompt_ids, self.comp], dim=1),
            completion_ids=self.comp.clone(),
            completion_mask=scored,
            unmask_step=self.unmask_step,
            forward_passes=self.passes,
            entropy=self.entropy_sum / self.committed.clamp(min=1),
            token_logprob=None if self.logprob is None else self.logprob.masked_fill(~scored, 0.0),
        )


def _check_generator(B: int, sampling: SamplingConfig, generator: Generators) -> None:
    """A random draw needs its generators: one for the batch or one per row."""
    if generator is None and (sampling.temperature > 0 or sampling.remasking == "random"):
        raise ValueError("random sampling needs an explicit generator=torch.Generator().manual_seed(seed)")
    if generator is not None and not isinstance(generator, torch.Generator) and len(generator) != B:
        raise ValueError(f"one generator per row: got {len(generator)} generators for {B} rows")


def check_sampler(policy: Policy, sampling: SamplingConfig) -> None:
    """The options of `sampling` that depend on the policy (a ValueError saying what to set);
    the others `SamplingConfig` checks itself."""
    cache = sampling.approx_cache
    if cache != "none" and policy.attention_kind != "full":
        raise ValueError("approx_cache is for full-attention models; a block model's kv_cache is already exact")
    if cache != "none" and not hasattr(policy, "new_cache"):
        raise ValueError(f"approx_cache {cache!r} needs a policy with a KV cache (new_cache(), cache= in "
                         f"logits), which {type(policy).__name__} lacks (of the real checkpoints, only the native "
                         "llada, dream and sdar models have one; a checkpoint's own code has none): set it to 'none'")
    if sampling.cuda_graphs:
        if not getattr(policy, "cache_in_place", False):
            raise ValueError("sampling.cuda_graphs replays calls that write their keys into the cache in place "
                             f"(the native and tiny models); {type(policy).__name__}'s model does not: set it to false")
        if isinstance(getattr(policy, "model", None), torch.nn.Module):
            check_capturable(policy.model)
        if torch.is_inference_mode_enabled():  # inference tensors keep no version: a mask is read in every call
            raise ValueError("sampling.cuda_graphs cannot capture under torch.inference_mode(), where the models read "
                             "the key padding off the device in each call: use torch.no_grad()")


def resolve_noise(policy: Policy, sampling: SamplingConfig) -> SamplingConfig:
    """`sampling` with ``noise: auto`` made concrete for `policy`: counter noise from a
    vocabulary of `COUNTER_NOISE_VOCAB` tokens up, generator noise below."""
    if sampling.noise != "auto":
        return sampling
    model = getattr(policy.model, "module", policy.model)  # DDP and DeepSpeed hide the model's config
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or len(policy.tokenizer)
    return dataclasses.replace(sampling, noise=sampling.noise_for(vocab))


def _blocks(policy: Policy, L: int, steps: int, block_length: int | None) -> tuple[int, int]:
    """The block length and the number of blocks of `generate`, checked."""
    if policy.attention_kind == "block":
        if block_length not in (None, policy.block_size):
            raise ValueError(f"a block model decodes in its own blocks of {policy.block_size}; "
                             f"block_length must be null or {policy.block_size}, got {block_length}")
        block_length = policy.block_size
    elif policy.attention_kind != "full":
        raise NotImplementedError(f"no sampler for attention kind {policy.attention_kind!r}")
    block_length = L if block_length is None else block_length
    if L < 1 or steps < 1 or block_length < 1:
        raise ValueError(f"gen_length, steps and block_length must be >= 1, got {L}, {steps}, {block_length}")
    num_blocks = math.ceil(L / block_length)
    shared = policy.attention_kind == "block" and prompt_attention_of(policy) == "sequence_blocks"
    if shared:  # the prompt's tail shortens the first block: L slots can span one block more
        num_blocks = math.ceil((L + block_length - 1) / block_length)
    if steps < num_blocks:
        raise ValueError(f"steps ({steps}) must be at least the number of blocks ({num_blocks})" + (
            f": with prompt_attention 'sequence_blocks' the prompt's tail shares the first block, so {L} slots "
            f"can span {num_blocks} blocks of {block_length}" if shared else ""))
    return block_length, num_blocks


@torch.no_grad()
def generate(
    policy: Policy,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    sampling: SamplingConfig,
    *,
    generator: Generators = None,
    synced: bool = False,
    record_logprob: bool = False,
) -> GenerationOutput:
    """Generate `sampling.gen_length` tokens after each (left-padded) prompt, as `sampling`
    says (`SamplingConfig`; its gen_length must be set).

    `generator` is required when sampling is random (temperature > 0 or random remasking):
    one for the batch, or a sequence of B, one per row (then a row's completion does not
    depend on the rest of the batch). `synced`: make every model call of the schedule even
    when no row has work left (the output is discarded), so that processes whose parameters
    are sharded (FSDP, ZeRO-3), where each call is a collective, make the same number of
    calls; same tokens. `record_logprob`: fill `GenerationOutput.token_logprob` (the
    sampler's own log-probability of each token, which the `path` estimator should
    reproduce); else it is None. Same tokens either way."""
    if sampling.gen_length is None:
        raise ValueError("generate needs sampling.gen_length (a config's null means the task's completion_length)")
    sampling = resolve_noise(policy, sampling)
    B, L = prompt_ids.size(0), sampling.gen_length
    steps = L if sampling.steps is None else sampling.steps
    block_length, num_blocks = _blocks(policy, L, steps, sampling.block_length)
    _check_generator(B, sampling, generator)
    check_sampler(policy, sampling)
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)
    dec = _Decoding(policy, sampling, B, prompt_ids.device, generator, synced, record_logprob)
    model = getattr(policy, "model", None)
    with lean_adapters(model) if isinstance(model, torch.nn.Module) else nullcontext():  # LoRA: the same bits, sooner
        if policy.attention_kind == "block":
            _BlockSampler(dec, prompt_ids, prompt_mask, block_length, steps).run()
        else:
            # Steps per block: as even as possible, earlier blocks take the remainder.
            per_block = [steps // num_blocks + (b < steps % num_blocks) for b in range(num_blocks)]
            _decode_full(dec, prompt_ids, prompt_mask, block_length, per_block)
    return dec.output(prompt_ids)


class _ApproxCache:
    """Fast-dLLM's caches for one block [lo, hi) of a full-attention model (Wu et al. 2025).

    The block's first call runs the whole [q ; completion], exactly as the uncached sampler,
    and keeps the keys and values of the prefix (prompt and finished blocks; ``prefix``) or
    of everything but the block (``dual``). The block's later calls feed the block and the
    suffix (``prefix``) or the block alone (``dual``), attending to the kept keys. An
    approximation: under full attention the kept keys depend on the tokens fed after them,
    which change as the block is decoded (and with them the suffix's, under ``dual``).

    A policy whose model reads column i for token i + 1 (``shift_logits``, Dream) is fed the
    column before the block as well: its logits predict the block's first slot. `refresh`: the
    whole-sequence call (and new kept keys) every `refresh` calls, not only the first.

    Where the policy's model writes a cache in place (``cache_in_place``: the native models
    and the tiny one honour `KVCache.write_at`), the first call's keys of every column stay
    where they are, and a later call overwrites the fed columns' (one run of the sequence) with
    its own and attends to all of them under the rows' own key padding: the same keys as the
    kept ones followed by the fed ones, without copying the kept ones out once a block and
    joining them to the fed ones in every layer of every call. Otherwise the kept columns are
    copied out and the fed ones' keys joined to them."""

    def __init__(self, policy, sampling: SamplingConfig, P: int, lo: int, hi: int, attn: torch.Tensor,
                 pos: torch.Tensor) -> None:
        self.policy, self.P, self.lo, self.hi = policy, P, lo, hi
        self.refresh, self.calls = sampling.approx_refresh, 0
        self.graphs, self.graph = sampling.cuda_graphs, None  # the later call captured (`CapturedCall`)
        self.attn, self.pos = attn, pos  # (B, P+L) all rows
        self.shift = int(bool(getattr(policy, "shift_logits", False)))
        self.narrow = takes_columns(policy)  # the head on the block
        self.in_place = bool(getattr(policy, "cache_in_place", False))
        T = attn.size(1)
        # what a later call feeds
        self.run = slice(P + lo - self.shift, T if sampling.approx_cache == "prefix" else P + hi)
        col = torch.arange(T, device=attn.device)
        fed = (col >= self.run.start) & (col < self.run.stop)  # (T,)
        self.fed, self.kept = fed.nonzero().flatten(), (~fed).nonzero().flatten()
        self.kv, self.rows = None, None  # the kept keys/values, and the batch rows they are of
        self.sub = None  # (key padding, positions) of `rows` in a later call

    def logits(self, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """(A, P+L) inputs of batch rows `active` -> (A, hi - lo, V) logits of the block."""
        P, lo, hi = self.P, self.lo, self.hi
        self.calls += 1
        if self.kv is None or (self.refresh and (self.calls - 1) % self.refresh == 0):  # the whole sequence, keys kept
            self.kv = self.sub = self.graph = None  # a refresh: the old keys' memory free for the new call's
            cache = self.policy.new_cache()
            block = slice(P + lo, P + hi)
            out = self.policy.logits(x, self.attn[active], self.pos[active], cache=cache, extend_cache=True,
                                     **({"columns": block} if self.narrow else {}))
            if self.in_place:
                cache.write_at = self.run
                self.kv = cache
            else:
                self.kv = cache.select(cols=self.kept)
            self.rows, self.sub = active, None
            return out if self.narrow else out[:, block]
        if not torch.equal(active, self.rows):
            # Rows that finished the block leave it for good (its masked slots only fill): the
            # cache keeps the others' rows alone, narrowed layer by layer (not a copy beside it).
            if not bool(torch.isin(active, self.rows).all()):
                raise RuntimeError("a row came back to a block it had finished: its keys are no longer cached")
            self.kv.keep_rows(torch.searchsorted(self.rows, active))
            self.rows, self.sub, self.graph = active, None, None  # the cut cache's tensors are new: capture again
        if self.sub is None:  # the same until rows leave
            attn = self.attn[active]
            keys = attn if self.in_place else attn[:, torch.cat([self.kept, self.fed])]  # (A, T) key padding
            self.sub = (keys, self.pos[active][:, self.run])
        keys, fed_pos = self.sub
        block = slice(self.shift, self.shift + hi - lo)

        def later(ids: torch.Tensor) -> torch.Tensor:
            return self.policy.logits(ids, keys, fed_pos, cache=self.kv, **({"columns": block} if self.narrow else {}))

        if not self.graphs or (self.graph is None and self.refresh and self.calls % self.refresh == 0):
            out = later(x[:, self.run])  # (a graph captured in the call before a refresh would not be replayed)
        elif self.graph is None:  # the first later call of these rows: run, and captured
            static = x[:, self.run].clone()
            self.graph = CapturedCall(lambda: later(static), static)
            out, self.graph.first = self.graph.first, None  # not held beside the graph's own output
        else:
            out = self.graph(x[:, self.run])
        return out if self.narrow else out[:, block]


def takes_columns(policy: Policy) -> bool:
    """Whether `policy.logits` takes ``columns=`` (a slice: the logits of those columns only)."""
    try:
        return "columns" in inspect.signature(policy.logits).parameters
    except (TypeError, ValueError):
        return False


def _decode_full(dec: _Decoding, prompt_ids, prompt_mask, block_length: int, per_block: list[int]) -> None:
    """Full attention: every step runs the whole [q ; completion] of the rows with work left
    (with `approx_cache`, what `_ApproxCache` feeds)."""
    policy, approx_cache = dec.policy, dec.sampling.approx_cache
    B, P = prompt_ids.shape
    L = dec.comp.size(1)
    attn = torch.cat([prompt_mask, torch.ones((B, L), dtype=prompt_mask.dtype, device=prompt_mask.device)], dim=1)
    pos = position_ids(attn)  # (B, P+L)
    slot = torch.arange(L, device=prompt_ids.device)
    # Generator noise without a cache draws over every column (the default stream); otherwise only the block's,
    # and a policy that can computes only the block's logits.
    narrow = dec.sampling.noise == "counter" or approx_cache != "none"
    head_on_block = narrow and takes_columns(policy)
    step = 0
    for b, block_steps in enumerate(per_block):
        lo, hi = b * block_length, min(L, (b + 1) * block_length)
        cols = slice(lo, hi) if narrow else slice(None)
        in_block = (slot >= lo) & (slot < hi)  # (L,)
        cache = None if approx_cache == "none" else _ApproxCache(policy, dec.sampling, P, lo, hi, attn, pos)
        for s in range(block_steps):
            eligible = (dec.comp == dec.mask_id) & in_block  # (B, L)
            active = eligible.any(dim=1).nonzero().squeeze(1)  # rows with work left in this block
            if active.numel() == 0:
                if dec.synced:  # the call the other processes are making; its output is not needed
                    policy.logits(torch.cat([prompt_ids[:1], dec.comp[:1]], dim=1), attn[:1], pos[:1])
                    dec.passes += 1
                    step += 1
                    continue
                step += block_steps - s
                break
            x = torch.cat([prompt_ids[active], dec.comp[active]], dim=1)  # (A, P+L)
            if head_on_block and cache is None:
                logits = policy.logits(x, attn[active], pos[active], columns=slice(P + lo, P + hi)).float()  # (A, W, V)
            elif cache is None:
                logits = policy.logits(x, attn[active], pos[active])[:, P:][:, cols].float()  # (A, W, V)
            else:
                logits = cache.logits(x, active).float()  # (A, W, V)
            dec.passes += 1
            dec.decode(logits, eligible[active][:, cols], block_steps - s, _At(active, step, slot[cols]), cols)
            step += 1


def _block_schedule(num_blocks: torch.Tensor, steps: int, width: int) -> torch.Tensor:
    """(R,) blocks per row -> (R, width) steps of each row's block j: `steps` split as evenly as
    possible, earlier blocks taking the remainder; 0 past a row's last block."""
    j = torch.arange(width, device=num_blocks.device)
    per = (steps // num_blocks)[:, None] + (j[None] < (steps % num_blocks)[:, None]).long()  # (R, width)
    return per.masked_fill(j[None] >= num_blocks[:, None], 0)


class _BlockSampler:
    """Block diffusion: block j is denoised attending to the clean blocks < j, then frozen.
    Without the cache each step runs [q ; y_≤j] under the block-causal mask; with it, the
    prompt's whole blocks and each finished block are run once and their keys/values kept,
    and a step feeds only block j. Same mathematics.

    The blocks are the policy's (`prompt_attention`). Under ``sequence_blocks`` a row's
    first block holds its prompt's tail, r = (prompt length mod S) tokens, and S − r slots:
    block j is then decoded for all rows at once over the columns it covers in any row (a
    row's other columns there belong to its blocks j − 1 or j + 1: hidden from block j,
    never written). Each row splits its `steps` over its own blocks and counts its steps over
    them (`unmask_step`), so a row's tokens do not depend on its batch (docs/methods.md,
    "Sampling: how a step decodes")."""

    def __init__(self, dec: _Decoding, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, S: int,
                 steps: int) -> None:
        B, P = prompt_ids.shape
        L = dec.comp.size(1)
        device = prompt_ids.device
        self.dec, self.prompt_ids, self.prompt_mask, self.S, self.P = dec, prompt_ids, prompt_mask, S, P
        self.conv = prompt_attention_of(dec.policy)
        self.pos = position_ids(torch.cat([prompt_mask, torch.ones_like(dec.comp)], dim=1))  # (B, P+L)
        offset = block_offset(prompt_mask, S, self.conv)  # (B,) prompt tokens in each row's first block
        self.blk_of = completion_blocks(offset, L, S)  # (B, L) each slot's block
        W = self.W = tail_width(P, S, self.conv)
        self.tail = prompt_mask[:, P - W :].bool() & (torch.arange(W, device=device) >= W - offset[:, None])  # (B, W)
        # Every block count a row of this model can have (so that synced processes make the same calls).
        counts = torch.arange(S if self.conv == "sequence_blocks" else 1, device=device)
        counts = torch.div(counts + L + S - 1, S, rounding_mode="floor").unique()  # ceil((r + L) / S) for each r
        self.NB = int(counts.max())
        self.sched = _block_schedule(self.blk_of[:, -1] + 1, steps, self.NB)  # (B, NB) each row's steps per block
        self.first_step = self.sched.cumsum(1) - self.sched  # (B, NB) each row's step number at block j's start
        self.iters = _block_schedule(counts, steps, self.NB).max(0).values.tolist()  # (NB,) calls per block
        self.rows = torch.arange(B, device=device)
        self.cache, self.valid = None, None  # valid: (B, Tc) cached keys a later query may attend to
        if dec.sampling.kv_cache and hasattr(dec.policy, "new_cache"):
            self._prefill()

    def _prefill(self) -> None:
        """Cache the prompt; its keys are valid but for a tail that shares the first block."""
        P, W = self.P, self.W
        self.cache = self.dec.policy.new_cache()
        mask = block_causal_attention_mask(self.prompt_mask, 0, self.S, self.conv)  # (B, P, P)
        self.dec.policy.logits(self.prompt_ids, mask, self.pos[:, :P], cache=self.cache, extend_cache=True)
        self.dec.passes += 1
        self.valid = self.prompt_mask.bool().clone()  # (B, P)
        self.valid[:, P - W :] &= ~self.tail

    def run(self) -> None:
        for j in range(self.NB):
            self._block(j)

    def _block(self, j: int) -> None:
        """Denoise block j over its steps, then (with the cache) freeze it."""
        dec, P = self.dec, self.P
        L = dec.comp.size(1)
        member = self.blk_of == j  # (B, L) the slots of block j, per row
        cols = member.any(0).nonzero().flatten()
        if cols.numel() == 0 and not dec.synced:
            return
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (L - 1, L)  # none: a discarded call
        member = member[:, lo:hi]  # (B, W_j)
        head = self.W if j == 0 else 0  # the prompt's tail denoises with the first block (cache path: fed again)
        fed = None
        if self.cache is not None:  # (the columns of each row's block j, their positions, their mask)
            fresh = torch.cat([self.tail[:, self.W - head :], member], dim=1)  # (B, F)
            fed_pos = torch.cat([self.pos[:, P - head : P], self.pos[:, P + lo : P + hi]], dim=1)  # (B, F)
            fed = (fresh, fed_pos, fresh[:, :, None] & torch.cat([self.valid, fresh], dim=1)[:, None, :])
        for s in range(self.iters[j]):
            active = s < self.sched[:, j]  # (B,) rows still within their steps of block j
            eligible = (dec.comp[:, lo:hi] == dec.mask_id) & member & active[:, None]  # (B, W_j)
            if not eligible.any() and not dec.synced:
                break
            logits = self._logits(lo, hi, head, fed)  # (B, W_j, V)
            dec.passes += 1
            if eligible.any():  # (synced calls with nothing left to decode are discarded)
                steps_left = (self.sched[:, j] - s).clamp(min=1)  # (B,)
                # A row draws noise for its own block's columns, and only while it has slots to fill: its
                # draws do not depend on the other rows (a row without any has none left: EOS came).
                own = member & eligible.any(1, keepdim=True)  # (B, W_j)
                at = _At(self.rows, self.first_step[:, j] + s, torch.arange(lo, hi, device=dec.comp.device), own)
                dec.decode(logits.float(), eligible, steps_left, at, slice(lo, hi))
        later = self.blk_of > j
        if fed is not None and j < self.NB - 1 and (dec.synced or (dec.comp[later] == dec.mask_id).any()):
            x = torch.cat([self.prompt_ids[:, P - head :], dec.comp[:, lo:hi]], dim=1)  # (B, F) freeze block j
            dec.policy.logits(x, fed[2], fed[1], cache=self.cache, extend_cache=True)
            self.valid = torch.cat([self.valid, fed[0]], dim=1)
            dec.passes += 1

    def _logits(self, lo: int, hi: int, head: int, fed: tuple | None) -> torch.Tensor:
        """(B, hi - lo, V) logits of block [lo, hi): with the cache, block j (and the tail) attend
        to the valid cached keys and to themselves; without, [q ; y_<hi] under the block-causal mask."""
        dec, P = self.dec, self.P
        if fed is not None:
            x = torch.cat([self.prompt_ids[:, P - head :], dec.comp[:, lo:hi]], dim=1)  # (B, F)
            return dec.policy.logits(x, fed[2], fed[1], cache=self.cache)[:, head:]
        x = torch.cat([self.prompt_ids, dec.comp[:, :hi]], dim=1)  # (B, P+hi)
        attn = block_causal_attention_mask(self.prompt_mask, hi, self.S, self.conv)  # (B, P+hi, P+hi)
        return dec.policy.logits(x, attn, self.pos[:, : P + hi])[:, P + lo :]


def row_generators(tag: str, lo: int, hi: int) -> list[torch.Generator]:
    """One generator per row lo..hi-1 of a batch named `tag`: a row's draws depend on the
    tag and its index only, not on the batch, micro-batch or process it is sampled in."""
    def seed(row: int) -> int:
        return int.from_bytes(hashlib.sha256(f"{tag}/{row}".encode()).digest()[:8], "big") >> 1
    return [torch.Generator().manual_seed(seed(r)) for r in range(lo, hi)]


def micro_batch_calls(rows: int, micro_batch: int | None) -> int:
    """`generate` calls that `generate_micro_batched` makes for `rows` rows."""
    return 1 if micro_batch is None else max(1, math.ceil(rows / micro_batch))


@dataclass
class RolloutRequest:
    """B prompts and how to sample them: what the trainer asks a rollout engine for
    (`stabledrl.engines`), and what `generate_micro_batched` runs."""

    policy: Policy
    """The current policy: its weights are those the trainer scores the rollouts with."""
    prompt_ids: torch.Tensor
    """(B, P) left-padded prompt ids, on the policy's device."""
    prompt_mask: torch.Tensor
    """(B, P) 1 for prompt tokens, 0 for padding."""
    gen_length: int
    """Completion slots L."""
    generators: list[torch.Generator]
    """One per row (`row_generators`): row b's randomness comes from its own."""
    sampling: SamplingConfig
    """The sampling settings (temperature, steps, block length, ...)."""
    micro_batch: int | None = None
    """Rows per call of the built-in sampler (None: all)."""
    synced: bool = False
    """Processes with sharded parameters must make the same model calls (built-in sampler)."""
    num_calls: int | None = None
    """With `synced`: the sampler calls of the largest share of the processes."""
    progress: bool = False
    """A progress bar over the micro-batches."""


def generate_micro_batched(request: RolloutRequest, *, record_logprob: bool = False) -> GenerationOutput:
    """`generate` on at most `request.micro_batch` rows at a time (None: all at once), the
    outputs concatenated; `forward_passes` is the sum over the calls. With one generator per
    row (or no randomness) each row writes the same tokens as in a single call; a single
    generator would be consumed in another order, so it is refused for several micro-batches.
    With `sampling.sort_by_length` the rows are cut in order of prompt length and each call
    drops the left padding all its rows have (the same tokens but for rounding; output in the
    given order, `sequences` with the P columns of the prompts). `synced` with `num_calls`: a
    process with fewer micro-batches than `num_calls` makes the missing calls on its first row
    and discards them, so processes with sharded parameters make the same model calls
    (docs/methods.md, "Sampling: how a step decodes")."""
    r = request
    B, size = r.prompt_ids.size(0), r.micro_batch or r.prompt_ids.size(0)
    prompt_mask = torch.ones_like(r.prompt_ids) if r.prompt_mask is None else r.prompt_mask
    if r.micro_batch is not None and r.micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1 or None, got {r.micro_batch}")
    sampling = dataclasses.replace(r.sampling, gen_length=r.gen_length)
    starts = list(range(0, B, size))
    one_generator = isinstance(r.generators, torch.Generator)
    if len(starts) > 1 and one_generator:
        raise ValueError("micro-batches need one generator per row (stabledrl.sampling.row_generators): "
                         "a single generator would give other draws than one call")
    order = torch.arange(B)  # (B,) the rows in the order they are cut into micro-batches
    if sampling.sort_by_length and len(starts) > 1:
        order = prompt_mask.sum(1).cpu().argsort(stable=True)
    outs = []
    for s in tqdm(starts, desc="sampling", disable=not r.progress, leave=False):
        rows = order[s : s + size]  # (b,)
        gens = r.generators if r.generators is None or one_generator else [r.generators[i] for i in rows.tolist()]
        ids, mask = r.prompt_ids[rows.to(r.prompt_ids.device)], prompt_mask[rows.to(prompt_mask.device)]  # (b, P)
        lead = _common_padding(mask) if sampling.sort_by_length else 0
        out = generate(r.policy, ids[:, lead:], mask[:, lead:], sampling, generator=gens, synced=r.synced,
                       record_logprob=record_logprob)
        if lead:  # back to the P columns of the prompts as given
            out.sequences = torch.cat([ids[:, :lead], out.sequences], dim=1)  # (b, P + L)
        outs.append(out)
    if r.synced and r.num_calls is not None:
        for _ in range(r.num_calls - len(starts)):  # the calls of a larger share; output discarded
            spare = [torch.Generator().manual_seed(0)]
            generate(r.policy, r.prompt_ids[:1], prompt_mask[:1], sampling, generator=spare, synced=True,
                     record_logprob=record_logprob)
    out = concat_outputs(outs)
    if not torch.equal(order, torch.arange(B)):
        out = _take_rows(out, order.argsort().to(out.completion_ids.device))
    return out


def _common_padding(prompt_mask: torch.Tensor) -> int:
    """The number of leading columns of (b, P) `prompt_mask` that are padding in every row
    (none when no row has a prompt token)."""
    real = prompt_mask.bool().any(0).nonzero()  # columns where some row has a token
    return int(real[0]) if real.numel() else 0


def _take_rows(out: GenerationOutput, rows: torch.Tensor) -> GenerationOutput:
    """The rows `rows` (an index tensor) of `out`, in that order; `forward_passes` kept."""
    picked = {f.name: getattr(out, f.name)[rows] for f in fields(GenerationOutput)
              if f.name != "forward_passes" and getattr(out, f.name) is not None}
    return GenerationOutput(forward_passes=out.forward_passes, **picked)


def concat_outputs(outs: Sequence[GenerationOutput]) -> GenerationOutput:
    """The rows of several outputs (same P and L) in one; `forward_passes` summed, a
    `token_logprob` kept when every output has one."""
    if len(outs) == 1:
        return outs[0]
    cat = {f.name: torch.cat([getattr(o, f.name) for o in outs]) for f in fields(GenerationOutput)
           if f.name != "forward_passes" and all(getattr(o, f.name) is not None for o in outs)}
    return GenerationOutput(forward_passes=sum(o.forward_passes for o in outs), **cat)
