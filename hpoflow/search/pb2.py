"""PB2's explore step: new hyperparameters for a member that just copied a better one, chosen by a GP
bandit on the time-varying reward change (Parker-Holder, Nguyen and Roberts 2020, "Provably Efficient
Online Hyperparameter Optimization with Population-Based Bandits", NeurIPS).

What it implements:

- **Data**: every finished interval of the population, ``(t, hyperparameters, reward change over the
  interval)``. Hyperparameters are normalised to ``[0, 1]`` within their bounds (a ``log`` one in log
  space); time is measured in intervals (``t`` divided by the median gap between the distinct time
  steps), so the forgetting rate means "per interval" whatever the interval's length in epochs; the
  reward changes are standardised (mean 0, standard deviation 1; all equal: all 0).
- **Model**: a GP with the paper's time-varying squared-exponential kernel,
  ``k((x, t), (x', t')) = s2 * exp(-|x - x'|^2 / (2 l^2)) * (1 - eps)^(|t - t'| / 2)``, plus noise
  ``s2 * g``. The kernel's hyperparameters (lengthscale ``l``, forgetting rate ``eps``, noise ratio
  ``g``) maximise the marginal likelihood over a grid (``s2`` is profiled out in closed form); a jitter
  keeps every Cholesky factorisation positive definite.
- **Acquisition**: GP-UCB at the current time ``t``, ``mean + sqrt(beta) * sd``, with
  ``beta = 0.2 * d * log(2 n)`` (Kandasamy et al. 2015's practical schedule; ``n`` the points seen,
  pending ones included), maximised over the box by random candidates (uniform, near ``current``,
  near the best observed points) refined by a shrinking local search, all drawn from ``rng``.
- **Batch (the paper's parallel variant, as GP-BUCB)**: ``pending`` are the hyperparameters of members
  running their interval now (time ``t``, no result yet). They enter the posterior variance, not the
  mean (their hallucinated result is the mean itself), so members exploring in the same round spread
  out instead of all picking the same point.

What it leaves out: integer and categorical hyperparameters (the caller rounds an integer; the paper's
categorical extension, PB2-Mix, is not here); ARD lengthscales (one lengthscale over the normalised
box, as the paper); gradient-based optimisation of the kernel hyperparameters and of the acquisition
(a grid and a random local search instead: numpy only, deterministic for a given ``rng``); the exploit
step, the quantiles and the lineage (the PBT scheduler's); Ray Tune's extra model input (the reward
before the interval). The reward change is taken as given: with intervals of unequal length the caller
divides it by the length. Only the most recent ``MAX_POINTS`` intervals are modelled (the GP's cost is
cubic in them; older ones are forgotten by the kernel anyway): one call takes well under a second at
that size on a 2-core machine.

Fewer than ``MIN_POINTS`` usable history points: no model; the answer is a random point near
``current``: each normalised coordinate moved uniformly by at most ``FALLBACK_RADIUS`` and clipped to
the box (a coordinate ``current`` lacks is uniform over the box).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["FALLBACK_RADIUS", "MAX_POINTS", "MIN_POINTS", "explore"]

MIN_POINTS = 2
MAX_POINTS = 200
FALLBACK_RADIUS = 0.25

_JITTER = 1e-6
_LENGTHSCALES = np.geomspace(0.05, 2.0, 8)
_EPSILONS = (0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4)
_NOISE_RATIOS = (1e-4, 1e-3, 1e-2, 0.05, 0.2, 0.5, 1.0)
_N_UNIFORM = 1024
_N_LOCAL = 128

Bounds = Mapping[str, tuple[float, float, bool]]


def explore(history: Sequence[tuple[float, Mapping[str, float], float]], bounds: Bounds,
            current: Mapping[str, float], rng: np.random.Generator, t: float, *,
            pending: Sequence[Mapping[str, float]] = ()) -> dict[str, float]:
    """New hyperparameters (every key of ``bounds``, each within its bounds) for a member exploring at
    time ``t``.

    ``history``: ``(time step, hyperparameters of the interval, reward change over it)`` of every
    finished interval of the population (entries lacking a hyperparameter of ``bounds`` or with a
    non-finite reward change are left out). ``bounds``: name -> ``(low, high, log)``. ``current``: the
    donor's hyperparameters (the fallback's centre). ``pending``: the hyperparameters of the members
    running their interval now (conditioned on as in the paper's batch variant); empty: sequential
    PB2. Deterministic for a given ``rng`` state.
    """
    names = sorted(bounds)
    _check_bounds(bounds, names)
    rows = [(float(ts), [float(h[k]) for k in names], float(dy)) for ts, h, dy in history
            if all(k in h and math.isfinite(float(h[k])) for k in names) and math.isfinite(float(dy))
            and math.isfinite(float(ts))]
    if len(rows) < MIN_POINTS:
        return _denormalise(_near_current(bounds, names, current, rng), bounds, names)
    rows = sorted(rows, key=lambda r: r[0])[-MAX_POINTS:]
    x = np.clip(np.array([_normalise(v, bounds, names) for _, v, _ in rows]), 0.0, 1.0)
    times = np.array([r[0] for r in rows] + [float(t)])
    gaps = np.diff(np.unique(times))
    scale = float(np.median(gaps)) if gaps.size else 1.0
    tau = times / (scale if scale > 0 else 1.0)
    y = np.array([r[2] for r in rows])
    sd = float(y.std())
    y = (y - y.mean()) / sd if sd > 1e-12 * max(1.0, float(np.abs(y).max())) else np.zeros_like(y)
    p = np.array([_normalise([float(h.get(k, math.nan)) for k in names], bounds, names)
                  for h in pending]).reshape(-1, len(names))
    p = np.clip(p[np.isfinite(p).all(axis=1)], 0.0, 1.0)
    gp = _fit(x, tau[:-1], y)
    beta = 0.2 * len(names) * math.log(2.0 * (len(y) + len(p)))
    best = _maximise_ucb(gp, x, y, p, float(tau[-1]), beta, _normalise(
        [float(current.get(k, math.nan)) for k in names], bounds, names), rng)
    return _denormalise(best, bounds, names)


# -- the box ----------------------------------------------------------------------------------------
def _check_bounds(bounds: Bounds, names: list[str]) -> None:
    if not names:
        raise ValueError("PB2 explores at least one hyperparameter, but got no bounds")
    for k in names:
        lo, hi, log = bounds[k]
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"low < high (both finite) must hold for PB2's bounds, but got {k}: low={lo}, high={hi}")
        if log and lo <= 0:
            raise ValueError(f"a log-scaled bound must be positive, but got {k}: low={lo}")


def _normalise(values: Sequence[float], bounds: Bounds, names: list[str]) -> np.ndarray:
    out = np.empty(len(names))
    for i, (k, v) in enumerate(zip(names, values, strict=True)):
        lo, hi, log = bounds[k]
        if not math.isfinite(v):
            out[i] = math.nan  # a value the caller lacks
        elif log:
            out[i] = (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) if v > 0 else 0.0
        else:
            out[i] = (v - lo) / (hi - lo)
    return out


def _denormalise(u: np.ndarray, bounds: Bounds, names: list[str]) -> dict[str, float]:
    out = {}
    for k, ui in zip(names, np.clip(u, 0.0, 1.0), strict=True):
        lo, hi, log = bounds[k]
        v = math.exp(math.log(lo) + float(ui) * (math.log(hi) - math.log(lo))) if log else lo + float(ui) * (hi - lo)
        out[k] = min(max(v, lo), hi)  # exp(log(x)) may round just outside
    return out


def _near_current(bounds: Bounds, names: list[str], current: Mapping[str, float],
                  rng: np.random.Generator) -> np.ndarray:
    centre = _normalise([float(current.get(k, math.nan)) for k in names], bounds, names)
    step = rng.uniform(-FALLBACK_RADIUS, FALLBACK_RADIUS, len(names))
    uniform = rng.uniform(0.0, 1.0, len(names))
    return np.where(np.isfinite(centre), np.clip(centre + step, 0.0, 1.0), uniform)


# -- the GP -----------------------------------------------------------------------------------------
class _GP:
    """The fitted time-varying GP: kernel hyperparameters, the training inputs and the factors."""

    def __init__(self, lengthscale: float, eps: float, noise: float, s2: float, x: np.ndarray, tau: np.ndarray,
                 chol: np.ndarray, alpha: np.ndarray) -> None:
        self.lengthscale, self.eps, self.noise, self.s2 = lengthscale, eps, noise, s2
        self.x, self.tau, self.chol, self.alpha = x, tau, chol, alpha

    def corr(self, a: np.ndarray, ta: np.ndarray, b: np.ndarray, tb: np.ndarray) -> np.ndarray:
        """The kernel's correlation (``k / s2``) between the rows of ``a`` (times ``ta``) and ``b``."""
        return _corr(_sqdist(a, b), np.abs(ta[:, None] - tb[None, :]), self.lengthscale, self.eps)


def _sqdist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.maximum((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T, 0.0))


def _corr(d2: np.ndarray, dt: np.ndarray, lengthscale: float, eps: float) -> np.ndarray:
    time = (1.0 - eps) ** (dt / 2.0) if eps > 0 else 1.0
    return np.asarray(np.exp(-d2 / (2.0 * lengthscale ** 2)) * time)


def _fit(x: np.ndarray, tau: np.ndarray, y: np.ndarray) -> _GP:
    """Kernel hyperparameters by the marginal likelihood over the grid, ``s2`` profiled out: with
    ``K = s2 * R``, ``s2 = y' R^-1 y / n`` and ``log p(y) = -n/2 log s2 - log|L| - n/2 (1 + log 2 pi)``."""
    n = len(y)
    d2, dt = _sqdist(x, x), np.abs(tau[:, None] - tau[None, :])
    eye = np.eye(n)
    noise = np.array(_NOISE_RATIOS)
    best: tuple[float, tuple[float, float, float, float, np.ndarray]] | None = None
    for lengthscale in _LENGTHSCALES:
        for eps in _EPSILONS:
            base = _corr(d2, dt, float(lengthscale), eps)
            stack = base[None] + (noise + _JITTER)[:, None, None] * eye[None]  # one matrix per noise ratio
            try:
                chols = np.linalg.cholesky(stack)
            except np.linalg.LinAlgError:
                continue  # cannot happen with a noise ratio >= 1e-4 (an SE kernel is PSD); kept for safety
            z = np.linalg.solve(chols, np.broadcast_to(y[None, :, None], (len(noise), n, 1)))[..., 0]  # L^-1 y
            s2 = np.maximum((z * z).sum(1) / n, 1e-12)
            lml = -0.5 * n * np.log(s2) - np.log(np.diagonal(chols, axis1=1, axis2=2)).sum(1)
            j = int(np.argmax(lml))
            if best is None or lml[j] > best[0] + 1e-12:
                best = (float(lml[j]), (float(lengthscale), eps, _NOISE_RATIOS[j], float(s2[j]), chols[j]))
    if best is None:  # nothing factorised (cannot happen: see above); a wide, noisy model then
        chol = np.linalg.cholesky(_corr(d2, dt, 1.0, 0.0) + 1.0 * eye)
        return _GP(1.0, 0.0, 1.0, 1.0, x, tau, chol, _solve(chol, y))
    lengthscale, eps, g, s2, chol = best[1]
    # reward changes all equal (standardised to 0) make the likelihood's s2 vanish, and UCB a tie
    # everywhere; a floor keeps the variance term, so the bandit then explores where nothing was tried
    return _GP(lengthscale, eps, g, max(s2, 1e-2), x, tau, chol, _solve(chol, y))


def _solve(chol: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(L L')^-1 b``."""
    return np.asarray(np.linalg.solve(chol.T, np.linalg.solve(chol, b)))


def _ucb(gp: _GP, cand: np.ndarray, tnow: float, beta: float, pend_chol: np.ndarray | None,
         pend_x: np.ndarray, pend_tau: np.ndarray) -> np.ndarray:
    """UCB at ``cand`` (time ``tnow``): the mean from the finished intervals, the variance from them and
    the pending points (in standardised units of the reward change)."""
    tc = np.full(len(cand), tnow)
    kx = gp.corr(cand, tc, gp.x, gp.tau)
    mean = kx @ gp.alpha
    if pend_chol is None:
        v = np.linalg.solve(gp.chol, kx.T)
    else:
        v = np.linalg.solve(pend_chol, np.hstack([kx, gp.corr(cand, tc, pend_x, pend_tau)]).T)
    var = gp.s2 * np.maximum(1.0 - (v * v).sum(0), 0.0)
    return np.asarray(mean + math.sqrt(beta) * np.sqrt(var))


def _maximise_ucb(gp: _GP, x: np.ndarray, y: np.ndarray, pending: np.ndarray, tnow: float, beta: float,
                  current: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    d = x.shape[1]
    pend_tau = np.full(len(pending), tnow)
    pend_chol = None
    if len(pending):
        xa, ta = np.vstack([x, pending]), np.concatenate([gp.tau, pend_tau])
        pend_chol = np.linalg.cholesky(gp.corr(xa, ta, xa, ta) + (gp.noise + _JITTER) * np.eye(len(xa)))
    # candidates: uniform over the box, near the donor, near the best intervals of the latest time steps
    recent = np.argsort(-(y - 0.1 * np.abs(gp.tau.max() - gp.tau)))[:4]
    centres = [c for c in (current,) if np.isfinite(c).all()] + [x[i] for i in recent]
    parts = [rng.uniform(0.0, 1.0, (_N_UNIFORM, d))]
    parts += [np.clip(c + rng.normal(0.0, 0.1, (_N_LOCAL, d)), 0.0, 1.0) for c in centres]
    cand = np.vstack(parts)
    score = _ucb(gp, cand, tnow, beta, pend_chol, pending, pend_tau)
    top = cand[np.argsort(-score, kind="stable")[:5]]
    top_score = np.sort(score)[::-1][:5]
    for radius in (0.05, 0.015, 0.004):  # shrinking local search around the best candidates
        moved = np.clip(np.repeat(top, 32, axis=0) + rng.normal(0.0, radius, (len(top) * 32, d)), 0.0, 1.0)
        s = _ucb(gp, moved, tnow, beta, pend_chol, pending, pend_tau).reshape(len(top), 32)
        j = s.argmax(axis=1)
        better = s[np.arange(len(top)), j] > top_score
        top = np.where(better[:, None], moved.reshape(len(top), 32, d)[np.arange(len(top)), j], top)
        top_score = np.where(better, s[np.arange(len(top)), j], top_score)
    return np.asarray(top[int(np.argmax(top_score))])
