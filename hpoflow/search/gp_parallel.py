"""Asynchronous parallel Thompson sampling on Optuna's Gaussian process (``search.algorithm: gp`` with
``sampler_options.acquisition: thompson``, which ``auto`` means above ``GPOptions.EI_UP_TO``, 32, trials at
once).

Kandasamy et al., "Parallelised Bayesian Optimisation via Thompson Sampling" (AISTATS 2018): each free
worker gets the argmax of one draw from the GP's posterior; trials still running are ignored, as in their
asynchronous variant. Optuna's ``GPSampler`` instead optimizes LogEI at every ask, and qLogEI over the joint
posterior of the running trials when some run, so its ask grows with the trials in flight.

Here one fit serves many asks (``ThompsonGPSampler``):

- **a fit**: Optuna's GP (Matern 5/2 with ARD, its prior and minimum noise, warm-started from the previous
  fit, as ``GPSampler`` fits it) on the completed trials the sampler reads (hpoflow's bounded history: at
  most ``max_history``), values signed so that larger is better and standardized; then a candidate set in
  Optuna's normalized space (``N_CANDIDATES``: half a scrambled Sobol sample, half Gaussian perturbations of
  the best trials, clipped, discrete values snapped to the nearest of Optuna's normalized choices,
  categorical ones redrawn with probability ``CATEGORICAL_REDRAW``; repeats dropped), its joint posterior
  and one Cholesky factor (with jitter; the marginal posterior if that fails). Candidates equal to a
  running trial's parameters are left out (the running trials the sampler reads: all of them below
  ``max_history``, a sample above);
- **an ask**: one posterior draw over the candidates (mean + L z) and its argmax among the candidates not
  proposed since the fit. With several objectives the draw is scalarized by a random augmented Chebyshev
  weighting (ParEGO's; with Thompson sampling as in Paria et al., UAI 2019); with constraints (Optuna's,
  <= 0 feasible) each constraint has its own GP and draw, and the argmax is taken among the candidates
  feasible in the draw (where none is, the least violating).

A new fit happens when ``refit_every`` trials completed since the last one (told to this sampler, or found
in what it reads), when the search space changed, or when every candidate has been proposed.

``default_refit_every(max_concurrent)`` is ``max(1, max_concurrent // 8)``: a fit at every ask up to 15
trials at once, then every eighth of them (4 at 32, 32 at 256, 128 at 1,024). A proposal already goes
without the results of the ``max_concurrent - 1`` trials still running; a fit that waits for an eighth of
that many adds at most an eighth to that lag. A fit costs about 0.23 s of one core at 500 finished trials
and 7 parameters (the kernel fit 0.13 s, the joint posterior over 1,024 candidates 0.07 s, its Cholesky
factor 0.02 s), an ask between fits under a millisecond. Per ask, mean CPU (``OMP_NUM_THREADS=1``, both
samplers built by ``hpoflow.search.models.gp`` with ``max_history`` 500, 500 finished trials, 7 parameters,
one trial told per ask; Thompson's ``refit_every`` the default for ``max_concurrent`` = the running trials):

=========================  =====  =====  =====  =====  =====  =====
running trials                 0      1      8     32    256  1,024
=========================  =====  =====  =====  =====  =====  =====
Optuna's GPSampler (ms)      325    341    340    379    713  1,151
ThompsonGPSampler (ms)       243    230    230     60    6.6    1.7
=========================  =====  =====  =====  =====  =====  =====

Built on Optuna's private GP modules (``optuna._gp.gp``, ``optuna._gp.prior``, ``optuna._gp.search_space``),
as ``GPSampler`` is: pyproject.toml pins ``optuna>=5.0,<6`` for them, and tests/search/test_gp_parallel.py
fails where a release moves them. ``optuna._gp.gp`` imports torch: it is imported at the first fit, so
importing this module does not load torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
from optuna._gp.prior import DEFAULT_MINIMUM_NOISE_VAR, default_log_prior
from optuna._gp.search_space import SearchSpace
from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    import torch
    from optuna._gp.gp import GPRegressor

__all__ = ["CATEGORICAL_REDRAW", "N_CANDIDATES", "ThompsonGPSampler", "default_refit_every"]

_logger = logging.getLogger(__name__)

N_CANDIDATES = 1024  # points of the candidate set of a fit (fewer where a discrete space has fewer)
N_CENTERS = 10  # the best trials the local half of the candidates perturbs
LOCAL_SCALES = (0.02, 0.05, 0.1, 0.2)  # standard deviations of the perturbations, in normalized units
CATEGORICAL_REDRAW = 0.2  # chance that a perturbation redraws a categorical parameter
CHEBYSHEV_AUGMENT = 0.05  # the augmented Chebyshev scalarization's linear term
_EPS = 1e-10  # the smallest standard deviation a value is standardized by (Optuna's GPSampler's)
_JITTER = (1e-6, 1e-4)  # added to the posterior covariance's diagonal, times its mean variance, in turn


def default_refit_every(max_concurrent: int) -> int:
    """Completed trials between two fits by default: one up to 15 trials at once, then ``max_concurrent // 8``
    (module docstring)."""
    return max(1, max_concurrent // 8)


def _standardize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Columns of ``values`` less their means, over their standard deviations (infinities clipped first)."""
    from optuna._gp import gp as optuna_gp

    finite = optuna_gp.warn_and_convert_inf(values)
    means, stds = finite.mean(axis=0), finite.std(axis=0)
    return (finite - means) / np.maximum(_EPS, stds), means, stds


def _snap(x: np.ndarray, choices: np.ndarray) -> np.ndarray:
    """Each of ``x`` moved to the nearest of ``choices`` (ascending, at least two)."""
    i = np.clip(np.searchsorted(choices, x), 1, len(choices) - 1)
    below, above = choices[i - 1], choices[i]
    return np.where(x - below <= above - x, below, above)


def _non_dominated(y: np.ndarray) -> np.ndarray:
    """Which rows of ``y`` (larger is better in every column) no other row dominates."""
    geq = np.all(y[None, :, :] >= y[:, None, :], axis=-1)  # [i, j]: j is at least as good as i everywhere
    gt = np.any(y[None, :, :] > y[:, None, :], axis=-1)
    kept: np.ndarray = ~np.any(geq & gt, axis=1)
    return kept


def _factor(cov: torch.Tensor) -> np.ndarray:
    """A lower Cholesky factor of ``cov`` (a torch matrix) with jitter; its diagonal's square root (the
    marginal posterior) where no jitter of ``_JITTER`` makes it positive definite."""
    import torch

    scale = float(cov.diagonal().mean().clamp_min(_EPS))
    eye = torch.eye(cov.shape[0], dtype=cov.dtype)
    for jitter in _JITTER:
        chol, info = torch.linalg.cholesky_ex(cov + jitter * scale * eye)
        if int(info) == 0:
            out: np.ndarray = chol.numpy()
            return out
    _logger.warning("The posterior covariance of the Thompson candidates is not positive definite even with "
                    "jitter %g; drawing from the marginal posterior instead", _JITTER[-1] * scale)
    marginal: np.ndarray = cov.diagonal().clamp_min(0.0).sqrt().numpy()
    return marginal


@dataclass
class _Batch:
    """One fit's candidates and posterior, and which candidates were proposed since."""

    search_space: dict[str, BaseDistribution]
    space: SearchSpace
    candidates: np.ndarray  # (n, d), Optuna's normalized space
    means: list[np.ndarray]  # per output (objectives, then constraints): the posterior mean, (n,)
    factors: list[np.ndarray]  # per output: the lower Cholesky factor (n, n), or the marginal std (n,)
    n_objectives: int
    thresholds: np.ndarray  # per constraint: a draw at or above it is feasible
    lows: np.ndarray  # per objective: the worst standardized value observed (the Chebyshev origin)
    used: np.ndarray  # (n,) bool: proposed since the fit, or a running trial's parameters
    completed: int  # completed trials seen at the fit

    def propose(self, rng: np.random.RandomState) -> dict[str, Any] | None:
        """The argmax of one posterior draw among the candidates not used yet (marked used); None if none is
        left."""
        free = ~self.used
        if not free.any():
            return None
        n = len(self.candidates)
        draws = [m + (f @ rng.standard_normal(n) if f.ndim == 2 else f * rng.standard_normal(n))
                 for m, f in zip(self.means, self.factors, strict=True)]
        k = self.n_objectives
        if k == 1:
            score = draws[0]
        else:
            w = rng.dirichlet(np.ones(k))[:, None]
            gain = w * (np.stack(draws[:k]) - self.lows[:, None])
            score = gain.min(axis=0) + CHEBYSHEV_AUGMENT * gain.sum(axis=0)
        if len(draws) > k:
            slack = np.minimum(np.stack(draws[k:]) - self.thresholds[:, None], 0.0).sum(axis=0)
            feasible = free & (slack >= 0.0)
            pick = int(np.argmax(np.where(feasible, score, -np.inf) if feasible.any() else
                                 np.where(free, slack, -np.inf)))
        else:
            pick = int(np.argmax(np.where(free, score, -np.inf)))
        self.used[pick] = True
        return self.space.get_unnormalized_param(self.candidates[pick])


class ThompsonGPSampler(optuna.samplers.BaseSampler):
    """Batched asynchronous Thompson sampling on Optuna's GP (module docstring): a relative sampler over the
    intersection search space; a seeded ``RandomSampler`` for the first ``n_startup_trials`` completed trials
    and for parameters outside that space. ``refit_every``: completed trials between two fits. The same seed
    and the same calls give the same proposals. One sampler reads one study."""

    def __init__(self, *, seed: int | None = None, n_startup_trials: int = 10, refit_every: int = 1,
                 n_candidates: int = N_CANDIDATES, deterministic_objective: bool = False,
                 warn_independent_sampling: bool = True) -> None:
        if refit_every < 1:
            raise ValueError(f"refit_every must be at least 1, but got {refit_every}")
        if n_candidates < 2:
            raise ValueError(f"n_candidates must be at least 2, but got {n_candidates}")
        self._rng = np.random.RandomState(seed)
        self._independent_sampler = optuna.samplers.RandomSampler(seed=seed)
        self._intersection = optuna.search_space.IntersectionSearchSpace()
        self._n_startup_trials = n_startup_trials
        self.refit_every = refit_every
        self._n_candidates = n_candidates
        self._deterministic = deterministic_objective
        self._warn_independent_sampling = warn_independent_sampling
        self._completed: set[int] = set()  # the numbers of the completed trials seen (told or read)
        self._batch: _Batch | None = None
        self._cache: list[GPRegressor] | None = None  # the last fit's GPs: the next fit starts from them
        self.n_fits = 0

    def reseed_rng(self) -> None:
        self._rng.seed()
        self._independent_sampler.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {name: d for name, d in self._intersection.calculate(study).items() if not d.single()}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        trials = study._get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING),
                                   use_cache=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        self._completed.update(t.number for t in complete)
        if len(complete) < max(1, self._n_startup_trials):
            return {}
        batch = self._batch
        if (batch is None or batch.search_space != search_space or batch.used.all()
                or len(self._completed) - batch.completed >= self.refit_every):
            complete = [t for t in complete if search_space.keys() <= t.params.keys()]
            running = [t for t in trials if t.state == TrialState.RUNNING and search_space.keys() <= t.params.keys()]
            if not complete:
                return {}
            batch = self._batch = self._fit(study, complete, running, search_space)
        params = batch.propose(self._rng)
        return {} if params is None else params

    def _fit(self, study: optuna.Study, complete: list[FrozenTrial], running: list[FrozenTrial],
             search_space: dict[str, BaseDistribution]) -> _Batch:
        import torch
        from optuna._gp import gp as optuna_gp

        space = SearchSpace(search_space)
        x = space.get_normalized_params(complete)
        sign = np.array([-1.0 if d == StudyDirection.MINIMIZE else 1.0 for d in study.directions])
        y, _, _ = _standardize(sign * np.array([t.values for t in complete], dtype=float))
        keys = sorted(set.intersection(*(set(t.constraints) for t in complete)))
        columns = list(y.T)
        thresholds = np.zeros(len(keys))
        feasible: np.ndarray = np.ones(len(complete), dtype=bool)
        if keys:  # Optuna's constraints, <= 0 feasible: fitted as -c, feasible at or above the standardized 0
            c = np.array([[t.constraints[k] for k in keys] for t in complete], dtype=float)
            z, c_means, c_stds = _standardize(-c)
            columns += list(z.T)
            thresholds = -c_means / np.maximum(_EPS, c_stds)
            feasible = np.all(c <= 0.0, axis=1)
        if self._cache is not None and (len(self._cache) != len(columns)
                                        or len(self._cache[0].inverse_squared_lengthscales) != space.dim):
            self._cache = None
        gprs = []
        with torch.device("cpu"):  # as GPSampler: a global default device of cuda must not apply here
            for i, column in enumerate(columns):
                gprs.append(optuna_gp.fit_kernel_params(
                    X=x, Y=np.ascontiguousarray(column), is_categorical=space.is_categorical,
                    log_prior=default_log_prior, minimum_noise=DEFAULT_MINIMUM_NOISE_VAR,
                    deterministic_objective=self._deterministic,
                    gpr_cache=self._cache[i] if self._cache is not None else None))
            self._cache = gprs
            self.n_fits += 1
            candidates = self._candidates(space, x, y, feasible)
            used: np.ndarray = np.zeros(len(candidates), dtype=bool)
            if running:
                r = space.get_normalized_params(running)
                used = np.any(np.all(np.isclose(candidates[:, None, :], r[None, :, :], rtol=0.0, atol=1e-9), axis=-1),
                              axis=-1)
            means, factors = [], []
            with torch.no_grad():
                for gpr in gprs:
                    mean, cov = gpr.posterior(torch.from_numpy(candidates), joint=True)
                    means.append(mean.numpy())
                    factors.append(_factor(cov))
        return _Batch(search_space=search_space, space=space, candidates=candidates, means=means,
                      factors=factors, n_objectives=y.shape[1], thresholds=thresholds, lows=y.min(axis=0),
                      used=used, completed=len(self._completed))

    def _candidates(self, space: SearchSpace, x: np.ndarray, y: np.ndarray, feasible: np.ndarray) -> np.ndarray:
        """The candidate set of a fit (module docstring), without repeats, in a fixed order."""
        n_sobol = 1 << ((self._n_candidates // 2).bit_length() - 1)  # Sobol points: a power of two
        n_local = self._n_candidates - n_sobol
        good = np.flatnonzero(feasible) if feasible.any() else np.arange(len(x))
        if y.shape[1] == 1:
            centers = good[np.argsort(-y[good, 0], kind="stable")[:N_CENTERS]]
        else:
            front = good[_non_dominated(y[good])]
            centers = front if len(front) <= N_CENTERS else self._rng.choice(front, N_CENTERS, replace=False)
        base = x[centers[self._rng.randint(len(centers), size=n_local)]]
        scales = np.asarray(LOCAL_SCALES)[self._rng.randint(len(LOCAL_SCALES), size=(n_local, 1))]
        local = base + scales * self._rng.standard_normal(base.shape)
        local[:, space.continuous_indices] = np.clip(local[:, space.continuous_indices], 0.0, 1.0)
        for j, choices in zip(space.discrete_indices, space.get_choices_of_discrete_params(), strict=True):
            if space.is_categorical[j]:
                redraw = self._rng.random_sample(n_local) < CATEGORICAL_REDRAW
                local[:, j] = np.where(redraw, self._rng.randint(len(choices), size=n_local), base[:, j])
            else:
                local[:, j] = _snap(local[:, j], choices)
        sobol = space.sample_normalized_params(n_sobol, self._rng)
        out: np.ndarray = np.unique(np.concatenate([sobol, local]), axis=0)
        return out

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if self._warn_independent_sampling:
            complete = study._get_trials(deepcopy=False, states=(TrialState.COMPLETE,), use_cache=True)
            if len(complete) >= self._n_startup_trials:
                _logger.warning("Trial %d: parameter '%s' is sampled at random: it is not in every completed "
                                "trial (a dynamic search space), and the Thompson GP sampler reads only "
                                "parameters every trial has", trial.number, param_name)
        return self._independent_sampler.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._independent_sampler.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        if state == TrialState.COMPLETE:
            self._completed.add(trial.number)
        self._independent_sampler.after_trial(study, trial, state, values)
