"""Zeroth-order estimators beyond MeZO, each on `zo.SeededZO` (the same seeds, z, perturbation and update code).

* `NSPSA`: n two-point (SPSA) estimates averaged, g = (1/n) sum_i (L(theta + eps z_i) - L(theta - eps z_i)) / (2 eps)
  z_i; 2n forwards per step (n = 1 is MeZO).
* `FZOO` (Dang et al., "FZOO: Fast Zeroth-Order Optimizer for Fine-Tuning LLMs towards Adam-Scale Speed",
  github.com/DKmiyan/FZOO, trainer.py `zo_step`/`zo_update`): N one-sided Rademacher perturbations u_i and one
  unperturbed forward, theta <- theta - lr sum_i (L(theta + eps u_i) - L(theta)) / (N sigma) u_i, sigma the
  (population) standard deviation of the N perturbed losses: a step of normalised size; N + 1 forwards per step.
* `MeZOSVRG` (Gautam et al., "Variance-reduced Zeroth-Order Methods for Fine-Tuning Language Models", ICML 2024,
  github.com/amazon-science/mezo_svrg, models/llm_module.py `training_step_MeZO_SVRG`): every `period` steps an
  anchor step takes theta_a = theta and a two-point estimate g_a z_a on a large batch (`anchor_batches` batches,
  2 x anchor_batches forwards) and steps along it at the full-batch rate eta_1, theta <- theta - eta_1 g_a z_a;
  each step between takes, on one batch and with one z shared by both points, theta <- theta - eta_2 ((g(theta) -
  g(theta_a)) z + g_a z_a): 4 forwards. The two rates are the paper's eta_1 and eta_2 (the reference's
  `learning_rate_aux` and `learning_rate`; its script: 1e-3 and 1e-6); eta_1 = anchor_lr_scale x eta_2. Memory: one copy of the
  trainable weights (theta_a); g_a z_a is kept as its seed and coefficient. The reference code's memory-efficient
  path evaluates the "anchor" term at the current weights with a second z (its anchor list is a shallow copy);
  this follows the paper's algorithm instead.
* `ES` (evolution strategies as Qiu et al. scale them to LLM fine-tuning, "Evolution Strategies at Scale",
  arXiv 2509.24372, github.com/VsonicV/es-fine-tuning-paper, es_at_scale/backends/es_ops.py `apply_update` and
  utils/reward_shaping.py `z_score`): a population of n antithetic pairs theta +- eps z_i (2n members, one step seed
  per pair, as OpenAI ES's mirrored sampling), each member's loss z-scored over the population, and
  theta <- theta - lr / (2n) sum_m zscore(L_m) e_m (e_m = +-z_i): the reference's update with the loss in place of
  the reward. 2n forwards per step (n with the dual batch); memory as MeZO's. With sampling "independent" the
  population is the reference's own: N one-sided members theta + eps z_m (one step seed each) and
  theta <- theta - lr / N sum_m zscore(L_m) z_m; N forwards per step. With a `share` (rank, world) each process
  scores only the members of the seeds k with k % world == rank (whole pairs), and reduce_losses sums the
  population's losses over processes (0 stands for another process's member): every process then holds all N.
  With `member_batch` K > 1 (adapters only), K members at a time are scored by one call of the loss on
  `batch.repeated(K, rows)`, each adapter layer in member mode (`LoRALinear.set_members`) and `rows` telling it
  which member each row of a forward is; the loss returns one value per member, and the weights never move.

Each `step(loss_fn, batch, lr)` returns the losses it measured: their mean is the step's training loss.

`ESTIMATORS` names every estimator --zo_estimator chooses (MeZO's from optim.zo among them) and `build_estimator`
builds the chosen one from the ZO options: adding an estimator is its class, its entry, and the options it reads
in `_own_options`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from xgblora.adapters.lora import LoRALinear, MemberRows
from xgblora.data.batches import Batch
from xgblora.distributed import LOCAL, Distributed
from xgblora.optim.zo import MeZO, SeededZO, Trainable, ZOStepper
from xgblora.options import ZOOptions


class NSPSA(SeededZO):
    """n-SPSA: the mean of `queries` two-point estimates with independent z, one step seed each."""

    def __init__(self, *args, queries: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        if queries < 1:
            raise ValueError(f"{type(self).__name__} needs at least one pair of perturbations, got {queries}")
        self.queries = queries

    @torch.no_grad()
    def step(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
             lr: float | None = None) -> tuple[float, ...]:
        """One step on batch; returns the 2n losses (L+_1, L-_1, ...) after one host sync."""
        lr = self.lr if lr is None else lr
        params = self._trainable()
        seeds = [self._next_seed() for _ in range(self.queries)]
        values = self._reduce(self._population_losses(loss_fn, batch, params, seeds))
        coefficients = self._coefficients(values)
        self.projected_grad = sum(coefficients)
        if math.isfinite(self.projected_grad):
            self._apply(params, list(zip(seeds, coefficients, strict=True)), lr)
        return tuple(values)

    def _population_losses(self, loss_fn: Callable[[Batch], Tensor], batch: Batch, params: Trainable,
                           seeds: list[int]) -> list[Tensor]:
        """L+ and L- of each seed's pair, in seed order."""
        return [loss for seed in seeds for loss in self._pair_losses(loss_fn, batch, params, seed)]

    def _coefficients(self, values: list[float]) -> list[float]:
        """Each z_i's coefficient in the step: its two-point estimate over n."""
        return [(plus - minus) / (2 * self.eps * self.queries)
                for plus, minus in zip(values[::2], values[1::2], strict=True)]


class ES(NSPSA):
    """Evolution strategies: a population of `queries` antithetic pairs (2n members) or `queries` independent
    one-sided members (sampling "independent"), the members' losses z-scored over the population.

    Antithetic: in a pair the z-scores differ by (L+ - L-) / std (the population mean cancels), so z_i's coefficient
    is (L+_i - L-_i) / (2n (std + 1e-8)), std the population's (ddof 0) and 1e-8 the reference's guard: equal
    losses move nothing. Independent: z_m's coefficient is (L_m - mean) / (N (std + 1e-8)). Unlike MeZO's estimate
    there is no 1 / (2 eps): the reference folds the perturbation scale into the learning rate, so a step is of
    normalised size, as FZOO's. The antithetic pairs are n-SPSA's; only their weights differ.

    share (rank, world): this process scores the members of seed k only where k % world == rank; the losses of the
    others are 0 here, and reduce_losses must sum over the processes (each member's loss then comes from the one
    process that scored it)."""

    SAMPLINGS = ("antithetic", "independent")

    def __init__(self, *args, queries: int | None = None, sampling: str = "antithetic",
                 share: tuple[int, int] = (0, 1), member_batch: int = 1, **kwargs):
        if sampling not in self.SAMPLINGS:
            raise ValueError(f"ES sampling must be one of {self.SAMPLINGS}, got {sampling!r}")
        batched = kwargs.get("dual_modules") is not None
        if member_batch > 1 and not batched:
            raise ValueError("ES batches members through the adapters' member mode: pass them as dual_modules")
        if sampling == "independent" and batched and member_batch == 1:
            raise ValueError("ES with independent members perturbs one-sided: the dual batch does not apply")
        if queries is None:  # the reference's population of 30 either way
            queries = 15 if sampling == "antithetic" else 30
        super().__init__(*args, queries=queries, **kwargs)
        self.sampling, self.share, self.member_batch = sampling, share, member_batch

    @torch.no_grad()
    def step(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
             lr: float | None = None) -> tuple[float, ...]:
        """n-SPSA's step with ES's population and coefficients; returns the losses of the members that have one (a
        member whose loss is not finite, such as a policy with no scored completion, is left out of the
        population)."""
        return tuple(v for v in super().step(loss_fn, batch, lr) if math.isfinite(v))

    def _population_losses(self, loss_fn: Callable[[Batch], Tensor], batch: Batch, params: Trainable,
                           seeds: list[int]) -> list[Tensor]:
        """Each member's loss in population order (a pair's L+ then L-); under a share, another process's members
        as 0 in fp32, which its sum over the processes replaces."""
        rank, world = self.share
        signs = (1.0, -1.0) if self.sampling == "antithetic" else (1.0,)
        device = params[0][0].device if params else torch.device("cpu")
        if self.member_batch > 1:
            own = iter(self._batched_losses(loss_fn, batch, params, [(seed, sign) for k, seed in enumerate(seeds)
                                                                     if k % world == rank for sign in signs]))
            losses = [next(own) if k % world == rank else torch.zeros((), device=device)
                      for k in range(len(seeds)) for _ in signs]
        else:
            losses = []
            for k, seed in enumerate(seeds):
                if k % world != rank:
                    losses += [torch.zeros((), device=device)] * len(signs)
                elif self.sampling == "antithetic":
                    losses += self._pair_losses(loss_fn, batch, params, seed)
                else:
                    losses.append(self._one_sided_loss(loss_fn, batch, params, seed))
        return [loss.float() for loss in losses] if world > 1 else losses  # one dtype on every process

    def _batched_losses(self, loss_fn: Callable[[Batch], Tensor], batch: Batch, params: Trainable,
                        members: list[tuple[int, float]]) -> list[Tensor]:
        """The losses of members (seed, sign), member_batch at a time: each batch of members samples the step's
        prompts together, every row on its own member's factors (the weights are never moved)."""
        losses: list[Tensor] = []
        for start in range(0, len(members), self.member_batch):
            chunk = members[start:start + self.member_batch]
            zs = {seed: self._zs(params, seed) for seed, _ in chunk}  # a pair's two members share their z
            rows = MemberRows()
            with self._as_members(params, [(zs[seed], sign) for seed, sign in chunk], rows):
                losses += list(loss_fn(batch.repeated(len(chunk), rows)))
        return losses

    def _coefficients(self, values: list[float]) -> list[float]:
        """A member without a finite loss takes the population's mean (a z-score of 0) and is not counted; with
        none left, NaN: no step."""
        scored = [v for v in values if math.isfinite(v)]
        if not scored:
            return [math.nan] * self.queries
        mean = sum(scored) / len(scored)
        std = math.sqrt(sum((v - mean) ** 2 for v in scored) / len(scored))
        filled = [v if math.isfinite(v) else mean for v in values]
        if self.sampling == "independent":
            return [(v - mean) / (len(scored) * (std + 1e-8)) for v in filled]
        return [(plus - minus) / (len(scored) * (std + 1e-8))
                for plus, minus in zip(filled[::2], filled[1::2], strict=True)]


class FZOO(SeededZO):
    """FZOO: N one-sided Rademacher estimates against one unperturbed loss, divided by the losses' spread.

    When all N perturbed losses are equal (sigma = 0) they carry no direction and the step leaves the weights
    alone (FZOO's code would divide by zero)."""

    def __init__(self, *args, queries: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        if queries < 2:
            raise ValueError(f"FZOO needs at least two perturbations (it divides by their spread), got {queries}")
        if self._dual is not None:
            raise ValueError("FZOO perturbs one-sided with N different vectors: the dual batch does not apply")
        self.queries = queries

    @torch.no_grad()
    def step(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
             lr: float | None = None) -> tuple[float, ...]:
        """One step on batch; returns (L(theta),), or (nan,) when the estimate was not finite."""
        lr = self.lr if lr is None else lr
        params = self._trainable()
        seeds = [self._next_seed() for _ in range(self.queries)]
        losses = [self._one_sided_loss(loss_fn, batch, params, seed, sign=True) for seed in seeds]
        losses.append(loss_fn(batch).mean())
        *perturbed, base = self._reduce(losses)
        mean = sum(perturbed) / len(perturbed)
        sigma = math.sqrt(sum((loss - mean) ** 2 for loss in perturbed) / len(perturbed))
        scale = self.queries * sigma
        coefficients = [(loss - base) / scale if scale > 0 else 0.0 for loss in perturbed]
        self.projected_grad = sum(coefficients)
        if not math.isfinite(self.projected_grad + base):
            return (math.nan,)
        self._apply(params, list(zip(seeds, coefficients, strict=True)), lr, sign=True)
        return (base,)


class MeZOSVRG(SeededZO):
    """MeZO-SVRG: anchor steps on a large batch every `period` steps, variance-reduced steps between them."""

    def __init__(self, *args, period: int = 10, anchor_batches: int = 8, anchor_lr_scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        if period < 1 or anchor_batches < 1 or not anchor_lr_scale > 0:
            raise ValueError(f"MeZO-SVRG needs period >= 1, anchor_batches >= 1 and anchor_lr_scale > 0, got "
                             f"{period}, {anchor_batches}, {anchor_lr_scale}")
        self.period, self.anchor_batches, self.anchor_lr_scale = period, anchor_batches, anchor_lr_scale
        self._anchor: list[Tensor] | None = None  # theta_a of every weight in self._params, in order
        self._anchor_term: tuple[int, float] = (0, 0.0)  # g_a z_a as (seed, g_a)
        self._since_anchor = 0  # steps since the anchor step

    def anchor_due(self) -> bool:
        """Whether the next step is an anchor step (every `period` steps, and after forget())."""
        return self._anchor is None or self._since_anchor >= self.period

    @torch.no_grad()
    def anchor(self, loss_fn: Callable[[Batch], Tensor], batches: list[Batch],
               lr: float | None = None) -> tuple[float, float]:
        """theta_a = theta, g_a from the batches together, theta <- theta - eta_1 (g_a z_a + decay), eta_1 =
        anchor_lr_scale x lr (lr: the inner steps' rate, eta_2); (L+, L-)."""
        lr = (self.lr if lr is None else lr) * self.anchor_lr_scale
        params = self._trainable()
        seed = self._next_seed()
        plus, minus = self._two_pass_losses(lambda bs: self._large_batch_loss(loss_fn, bs), batches, params, seed)
        self._perturb(params, seed, self.eps)  # back to theta
        plus_f, minus_f = self._reduce([plus, minus])
        g = (plus_f - minus_f) / (2 * self.eps)
        self.projected_grad = g
        if not math.isfinite(g):
            return plus_f, minus_f  # no anchor taken: the next step tries again
        self._anchor = [p.detach().clone() for p, _ in self._params]
        self._anchor_term, self._since_anchor = (seed, g), 1
        self._apply(params, [self._anchor_term], lr)
        return plus_f, minus_f

    @torch.no_grad()
    def step(self, loss_fn: Callable[[Batch], Tensor], batch: Batch,
             lr: float | None = None) -> tuple[float, float]:
        """A variance-reduced step on batch (an anchor must exist); returns (L+, L-) at theta."""
        lr = self.lr if lr is None else lr
        params = self._trainable()
        seed = self._next_seed()
        plus, minus = self._pair_losses(loss_fn, batch, params, seed)
        self._swap_anchor()
        try:
            anchor_plus, anchor_minus = self._pair_losses(loss_fn, batch, params, seed)
        finally:
            self._swap_anchor()
        values = self._reduce([plus, minus, anchor_plus, anchor_minus])
        g = (values[0] - values[1]) / (2 * self.eps)
        g_anchor = (values[2] - values[3]) / (2 * self.eps)
        self.projected_grad = g - g_anchor
        self._since_anchor += 1
        if not math.isfinite(self.projected_grad):
            return values[0], math.nan
        self._apply(params, [(seed, g - g_anchor), self._anchor_term], lr)
        return values[0], values[1]

    def _large_batch_loss(self, loss_fn: Callable[[Batch], Tensor], batches: list[Batch]) -> Tensor:
        """The mean per-example loss over all the batches' examples, one batch in memory at a time."""
        total, count = 0.0, 0
        for batch in batches:
            losses = loss_fn(batch)
            total, count = total + losses.sum(), count + losses.numel()
        return total / count

    def _swap_anchor(self) -> None:
        """Exchange the weights' storage with the anchor's (no copy): theta <-> theta_a."""
        for (p, _), anchor in zip(self._params, self._anchor, strict=True):
            p.data, anchor.data = anchor.data, p.data

    def forget(self, params: Iterable[nn.Parameter]) -> None:
        """Re-initialised weights make the anchor stale: the next step is an anchor step."""
        super().forget(params)
        self._anchor = None

    def state_dict(self) -> dict:
        """SeededZO's state, the anchor weights, g_a z_a as (seed, g_a), and the steps since the anchor."""
        return {**super().state_dict(), "anchor": self._anchor, "anchor_term": list(self._anchor_term),
                "since_anchor": self._since_anchor}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned."""
        super().load_state_dict(state)
        anchor = state["anchor"]
        self._anchor = None if anchor is None else [
            a.to(device=p.device, dtype=p.dtype) for a, (p, _) in zip(anchor, self._params, strict=True)]
        seed, g = state["anchor_term"]
        self._anchor_term, self._since_anchor = (int(seed), float(g)), state["since_anchor"]


class SVRGStepper(ZOStepper):
    """ZOStepper for MeZO-SVRG: an anchor step draws `anchor_batches` batches (no first-order head step: its
    batches differ), the steps between take one batch each."""

    mezo: MeZOSVRG

    def step(self, next_batch: Callable[[], Batch], lr: float) -> Tensor:
        """An anchor step when one is due, else a variance-reduced step; returns the mean loss."""
        if not self.mezo.anchor_due():
            return super().step(next_batch, lr)
        batches = [next_batch() for _ in range(self.mezo.anchor_batches)]
        return self._report(self.mezo.anchor(self.loss_fn, batches, lr=lr))


# --zo_estimator NAME -> its estimator (options.ZO_ESTIMATORS, the names --help offers, is pinned to it by a test)
ESTIMATORS: dict[str, type[SeededZO]] = {"mezo": MeZO, "nspsa": NSPSA, "fzoo": FZOO, "svrg": MeZOSVRG, "es": ES}


def build_estimator(zo: ZOOptions, named_params: list[tuple[str, nn.Parameter]], lr: float, *, seed: int,
                    weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                    penalty: float = 0.0, dual_modules: dict[str, LoRALinear] | None = None,
                    dist: Distributed = LOCAL) -> SeededZO:
    """The estimator --zo_estimator names, over named_params, with its perturbation and update from `zo` (an object
    with ZOOptions' fields) and the run's peak rate lr, decay, seed and AdamW betas and epsilon (for
    --zo_optimizer momentum and adam). The processes of `dist` average their losses, or sum them where they share
    out ES's population. dual_modules, the adapters a doubled batch can perturb, serve an estimator whose
    perturbations are +z/-z pairs only: FZOO's and independent ES's are one-sided."""
    members = spreads_members(zo, "zo")  # an estimator steps under --trainer zo only
    pairs = zo.zo_estimator != "fzoo" and zo.zo_es_sampling == "antithetic"
    return ESTIMATORS[zo.zo_estimator](
        named_params, lr, zo.zo_eps, weight_decay, zo.zo_stochastic_rounding, penalty=penalty,
        dual_modules=dual_modules if pairs or zo.zo_member_batch > 1 else None, seed=seed,
        reduce_losses=dist.zo_losses(total=members), optimizer=zo.zo_optimizer, betas=betas, adam_eps=adam_eps,
        **_own_options(zo, lr, (dist.rank, dist.world_size) if members else (0, 1)))


def _own_options(zo: ZOOptions, lr: float, share: tuple[int, int]) -> dict[str, Any]:
    """An estimator's own options: its queries per step (ES: its population, sampling and this process's share of
    it), or SVRG's period, anchor batches and anchor rate (as a multiple of the scheduled rate lr, so that it
    follows the schedule)."""
    queries = {"queries": zo.zo_queries} if zo.zo_queries is not None else {}
    if zo.zo_estimator == "es":
        return {**queries, "sampling": zo.zo_es_sampling, "share": share, "member_batch": zo.zo_member_batch}
    if zo.zo_estimator in ("nspsa", "fzoo"):
        return queries
    if zo.zo_estimator == "svrg":
        anchor_rate = zo.zo_svrg_anchor_learning_rate or lr
        return {"period": zo.zo_svrg_period, "anchor_batches": zo.zo_svrg_anchor_batches,
                "anchor_lr_scale": anchor_rate / lr}
    return {}


def spreads_members(zo: ZOOptions, trainer: str) -> bool:
    """Whether the processes share out ES's population (each its members on all of a step's prompts) rather than
    the step's prompts."""
    return trainer == "zo" and zo.zo_estimator == "es" and zo.zo_es_spread == "members"


def stepper_type(estimator: SeededZO) -> type[ZOStepper]:
    """The stepper that drives an estimator: SVRG's draws the batches of its anchor steps."""
    return SVRGStepper if isinstance(estimator, MeZOSVRG) else ZOStepper
