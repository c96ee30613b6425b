"""Population-based training (``search.scheduler: {type: pbt, ...}``; Jaderberg et al. 2017, asynchronous
as in Ray Tune; PB2's explore step, Parker-Holder et al. 2020, with ``explore: pb2``).

A population of ``population`` members trains in intervals of ``interval`` epochs, one Optuna trial
per member interval. The first ``population`` trials are sampled by the study's sampler (the roots,
interval 0). When a member's interval ends and every root exists, the driver enqueues the member's
next interval with fixed parameters (``enqueue_trial``): it resumes from a checkpoint and trains
``interval`` more epochs (its ``training.epochs`` is the interval's end):

- **exploit**: if the member's value is in the bottom ``quantile`` of the population's latest
  interval values (as known now: no barrier), it takes a random member of the top ``quantile`` that
  is not behind it (its latest interval ends at the same epoch or later) as donor: the new trial
  resumes from the donor's latest checkpoint, with the donor's parameters, seed and epoch count;
  otherwise it resumes from its own with the same parameters;
- **explore** (after an exploit only): each explored hyperparameter is resampled from the space with
  ``resample_probability`` or multiplied by a random factor of ``perturb`` (``pbt``), or chosen by
  ``hpoflow.search.pb2.explore`` (``pb2``); then clipped to the space, ints and steps rounded.

The checkpoint is copied on the shared file system by the driver before the trial is submitted
(``trials/<n>/checkpoints`` starts as a copy of the parent's, in hard links: ``hpoflow.run.fencing``), so
every engine runs it as any resumed trial. Everything is in the storage: each interval trial's user attr
``hpoflow_lineage`` (``ATTR_LINEAGE``: member, interval, parent (the trial whose checkpoint it resumed),
donor (== parent after an exploit), start and end epochs, seed (the lineage root's, which a trial that
exploits takes from its donor)), so a restarted driver derives the population and the pending intervals from it.
A member stops when its interval ends at ``training.epochs``; the study at ``n_trials`` intervals
(at most ``population x ceil(epochs / interval)``).

A PBT study has one driver, its owner (``PbtScheduling.own``, a claim in the storage made before the
driver asks or enqueues anything); a driver without ``scheduler: pbt`` refuses it (``refuse_pbt_study``).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from hpoflow.errors import Issue, OwnerLost, SpecError, StudyTaken
from hpoflow.registry import SCHEDULERS, Options
from hpoflow.run.claims import Claims
from hpoflow.run.fencing import current, link_tree
from hpoflow.run.lease import LeaseInfo, first_alive, read_leases
from hpoflow.run.ledger import ATTR_CHECKPOINTS, ATTR_LINEAGE
from hpoflow.run.shared import SharedStudy
from hpoflow.search.options import pbt_budget
from hpoflow.search.population import Population
from hpoflow.spec import FloatParam, IntParam, Param, StudySpec, TrainConfig

__all__ = ["PbtPolicy", "PbtScheduling", "explore_pbt", "lineage_chain", "pbt", "refuse_pbt_study", "schedule_of"]

_log = logging.getLogger("hpoflow")
_OWNER = "pbt-owner:"  # the claim (hpoflow.run.claims) of the study's owner: pbt-owner:<epoch>
Bounds = dict[str, tuple[float, float, bool]]


class PbtPolicy:
    """The options of ``search.scheduler: {type: pbt}`` and its pure decisions."""

    def __init__(self, options: Options, direction: str) -> None:
        self.population = int(getattr(options, "population", 8))
        self.interval = int(getattr(options, "interval", 2))
        self.quantile = float(getattr(options, "quantile", 0.25))
        self.resample_probability = float(getattr(options, "resample_probability", 0.25))
        self.perturb = [float(f) for f in getattr(options, "perturb", [0.8, 1.2])]
        self.explore = str(getattr(options, "explore", "pbt"))
        self.hyperparams: list[str] | None = getattr(options, "hyperparams", None)
        self.maximize = direction == "maximize"

    def split(self, latest: dict[int, float]) -> tuple[list[int], list[int]]:
        """(top, bottom) members by their latest value, best first: ``ceil(n x quantile)`` each, at most
        half of the ``n`` members that have one (Ray Tune's rule)."""
        return self.cut(sorted(latest, key=lambda m: (-latest[m] if self.maximize else latest[m], m)))

    def cut(self, ordered: list[int]) -> tuple[list[int], list[int]]:
        """``split`` of members already ordered best first."""
        n = len(ordered)
        k = min(math.ceil(n * self.quantile), n // 2)
        return ordered[:k], ordered[n - k:] if k else []


def pbt(options: Options, direction: str) -> PbtPolicy:
    """``search.scheduler: {type: pbt}``: population-based training."""
    return PbtPolicy(options, direction)


def explored(space: dict[str, Param], names: list[str] | None) -> list[str]:
    """The explored hyperparameters: ``names``, or every float/int parameter of the space."""
    return list(names) if names else [k for k, p in space.items() if isinstance(p, FloatParam | IntParam)]


def fit(p: Param, value: float) -> float | int:
    """``value`` put in ``p``'s range: clipped to its bounds, rounded to its step (ints: whole)."""
    if not isinstance(p, FloatParam | IntParam):
        raise TypeError(f"pbt explores float and int parameters only, not {p!r}")
    v = min(max(float(value), p.low), p.high)
    if p.step:
        v = min(p.low + round((v - p.low) / p.step) * p.step, p.high)
    if isinstance(p, IntParam):
        return round(v)
    return float(v)


def explore_pbt(policy: PbtPolicy, space: dict[str, Param], names: list[str], current: dict[str, Any],
                rng: np.random.Generator) -> dict[str, Any]:
    """PBT's explore: each of ``names`` (present in ``current``) resampled from the space (log-uniform on a
    log scale) with ``resample_probability``, else multiplied by a random factor of ``perturb``."""
    out = dict(current)
    for name in names:
        p = space[name]
        if name not in out or not isinstance(p, FloatParam | IntParam):
            continue
        if rng.random() < policy.resample_probability:
            if p.log:
                v = math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
            else:
                v = rng.uniform(p.low, p.high)
        else:
            v = float(out[name]) * policy.perturb[int(rng.integers(len(policy.perturb)))]
        out[name] = fit(p, v)
    return out


def lineage_chain(trials: dict[int, FrozenTrial], number: int) -> list[FrozenTrial]:
    """The trials whose checkpoints led to trial ``number``, from the root to it (its ``parent`` links)."""
    chain: list[FrozenTrial] = []
    seen: set[int] = set()
    n: int | None = number
    while n is not None and n in trials and n not in seen:
        seen.add(n)
        t = trials[n]
        chain.append(t)
        lin = t.user_attrs.get(ATTR_LINEAGE) or {}
        n = lin.get("parent")
    return chain[::-1]


def schedule_of(chain: list[FrozenTrial], names: list[str]) -> dict[str, list[list[Any]]]:
    """``{param: [[start epoch, value], ...]}`` along a lineage chain, a pair where the value changes."""
    out: dict[str, list[list[Any]]] = {}
    for t in chain:
        start = int((t.user_attrs.get(ATTR_LINEAGE) or {}).get("start", 0))
        for name in names:
            if name in t.params and (name not in out or out[name][-1][1] != t.params[name]):
                out.setdefault(name, []).append([start, t.params[name]])
    return out


class PbtScheduling:
    """One driver's use of PBT: the lineage of the trials it starts, and the next intervals it enqueues."""

    def __init__(self, spec: StudySpec, study: optuna.Study, shared: SharedStudy, run_dir: Path,
                 n_trials: int | None = None) -> None:
        s = spec.search.scheduler
        self.policy: PbtPolicy = SCHEDULERS.get(s.type)(SCHEDULERS.options(s.type, s.options), spec.study.direction)
        self.study = study
        self.shared = shared
        self.run_dir = run_dir
        self.space = dict(spec.space)
        self.names = explored(self.space, self.policy.hyperparams)
        epochs = spec.training.get("epochs", TrainConfig.model_fields["epochs"].default)
        if not isinstance(epochs, int):
            raise SpecError([Issue("training.epochs", f"search.scheduler pbt needs a fixed training.epochs (every "
                                   f"member trains that long), but got {epochs!r}. Fix: write a whole number")])
        self.epochs = epochs
        self.seed = int(spec.search.seed or 0)
        self._pb2: Any = None
        if self.policy.explore == "pb2":
            try:
                self._pb2 = importlib.import_module("hpoflow.search.pb2")
            except ImportError as exc:
                raise SpecError([Issue("search.scheduler.explore", "pb2 needs hpoflow.search.pb2 (PB2's explore "
                                       f"step), which this installation does not have ({exc}). Fix: use explore: "
                                       "pbt")]) from exc
        self.n_exploits = 0  # this run's
        self.n_trials = n_trials
        self.population = Population(epochs, self.policy.maximize)  # kept up to date at every read of the study
        shared.tally.watch(self.population.update)
        self.claims = Claims(study)
        self._epoch: int | None = None  # the epoch of the study's ownership this driver holds (own())

    def own(self, stopping: Callable[[], bool] | None = None) -> None:
        """Make this driver the study's one owner, before it asks or enqueues anything: PBT enqueues a
        member's next interval in two writes, not a transaction, so two drivers could both enqueue it.

        The owner holds the claim ``pbt-owner:<epoch>`` (``hpoflow.run.claims``) of the highest epoch. A
        driver claims the next epoch when that holder's driver is dead (``first_alive``: at once when its
        lease ended or its process on this machine is gone; after its ``lease_s`` without a beat when it
        ran on another host). It is refused (``StudyTaken``) when the holder runs, when another driver
        claimed the next epoch first, or when a driver without pbt runs on the study now. A wait for a
        driver of another host ends with ``WaitStopped`` as soon as ``stopping()`` (a signal came)."""
        me = self.shared.lease.id
        plain = first_alive(self.study, lambda info: info.pbt is False, me, waiting=_waiting, stopping=stopping)
        if plain is not None:
            raise StudyTaken(f"driver {plain.label} (run directory {plain.run_dir}) runs this study now without "
                             "search.scheduler pbt, and pbt runs with one driver per study. Fix: wait for it to end "
                             "(or stop it), then rerun this command, or give this spec another study.name")
        epoch, holder = _owner(self.claims)
        if holder is not None and first_alive(self.study, lambda info: info.id == holder, me, waiting=_waiting,
                                              stopping=stopping) is not None:
            raise StudyTaken(f"pbt runs with one driver per study, and driver {_label(self.study, holder)} is "
                             "running this study now. Fix: wait for it to end (or stop it: its intervals are "
                             "rerun from their checkpoints), then rerun this command")
        won = self.claims.claim(f"{_OWNER}{epoch + 1}", me)
        if won != me:
            raise StudyTaken(f"pbt runs with one driver per study, and driver {_label(self.study, won)} took this "
                             "study at the same moment. Fix: wait for it to end, then rerun this command")
        self._epoch = epoch + 1

    def _check_owner(self) -> None:
        """Before this driver enqueues: it still owns the study, else ``OwnerLost`` (another driver judged
        it dead, a storage outage or a network partition outlasting its lease, and owns the study now)."""
        if self._epoch is None:
            return
        epoch, holder = _owner(self.claims)
        if (epoch, holder) != (self._epoch, self.shared.lease.id):
            raise OwnerLost(f"driver {_label(self.study, holder or '?')} took this pbt study over (it judged this "
                            f"driver dead: no beat seen for search.lease_s); this driver stops, and that one "
                            "reruns its intervals")

    @property
    def budget(self) -> int:
        """The most intervals the study can have (``hpoflow.search.options.pbt_budget``)."""
        return pbt_budget(self.policy.population, self.policy.interval, self.epochs)

    # -- the driver's calls -----------------------------------------------------------------------
    def adopt(self, trial: optuna.trial.Trial, base_seed: int) -> dict[str, Any]:
        """A trial just asked and admitted: a new root (no lineage yet: the next member, interval 0), or an
        enqueued interval whose checkpoint directory is filled from its parent's. A rerun keeps the
        directory it was handed (the interrupted interval's, with what it checkpointed) when that holds
        a checkpoint; when it holds none (its driver died before the copy ended, or before the interval
        checkpointed), it too is filled from the parent's. The copy is made beside the directory and
        renamed into place, so a driver killed while copying leaves no half copy. Returns its lineage."""
        attrs = trial.user_attrs
        lin = attrs.get(ATTR_LINEAGE)
        own = self.run_dir / "trials" / str(trial.number) / "checkpoints"
        if not isinstance(lin, dict):
            taken = self.population.members
            member = next(m for m in range(len(taken) + 1) if m not in taken)
            lin = {"member": member, "interval": 0, "parent": None, "donor": None, "start": 0,
                   "end": min(self.policy.interval, self.epochs), "seed": base_seed + member}
            trial.set_user_attr(ATTR_LINEAGE, lin)
        handed = attrs.get(ATTR_CHECKPOINTS)
        if handed is None or not _holds_files(current(Path(handed))):
            parent = lin.get("parent")
            if parent is not None:
                src = self._checkpoints(int(parent))
                if src.is_dir():
                    _copy_into_place(src, own)
                else:
                    _log.warning("pbt: the checkpoint directory %s of trial %d is gone; trial %d starts afresh",
                                 src, parent, trial.number)
            if handed is None or parent is not None:
                trial.set_user_attr(ATTR_CHECKPOINTS, str(own))
        return lin

    def configure(self, trial: optuna.trial.Trial, train: TrainConfig) -> TrainConfig:
        """The trial's training config for its interval: ``epochs`` = the interval's end, the lineage's
        seed, and a checkpoint at the interval's end (``checkpoint.every`` divides the interval)."""
        lin = trial.user_attrs.get(ATTR_LINEAGE) or {}
        every = train.checkpoint.every
        if every <= 0 or self.policy.interval % every:
            every = self.policy.interval
        ckpt = train.checkpoint.model_copy(update={"every": every})
        return train.model_copy(update={"epochs": int(lin.get("end", self.epochs)),
                                        "seed": int(lin.get("seed", train.seed)), "checkpoint": ckpt})

    def may_ask(self) -> bool:
        """Whether an ``ask`` now gives a trial PBT wants run: a root while the population is not full,
        else an enqueued interval (enqueued here if one is due)."""
        self.shared.refresh()
        if self.population.n_members < self.policy.population:
            return True
        return self.sync() > 0 or bool(self.shared.tally.waiting)

    def over(self) -> bool:
        """Nothing of PBT's runs or waits in the study, and no member has an interval left."""
        self.shared.refresh()
        tally = self.shared.tally
        if self.population.n_members < self.policy.population or tally.running or tally.waiting:
            return False
        return self.sync() == 0

    def sync(self) -> int:
        """Enqueue the next interval of every member whose latest interval finished and has none yet,
        within ``budget`` (finished, running and waiting intervals count); returns how many."""
        tally, pop = self.shared.tally, self.population
        if pop.n_members < self.policy.population:
            return 0  # roots first: an enqueued interval would be asked before them
        room = self._budget - (tally.finished + len(tally.running) + len(tally.waiting))
        added = 0
        for m in sorted(pop.due, key=lambda m: pop.latest[m].number):
            if room <= 0:
                break
            nxt = self._next(pop.latest[m])
            if nxt is None:
                continue
            params, new = nxt
            if not added:
                self._check_owner()
            self.study.enqueue_trial(params, user_attrs={ATTR_LINEAGE: new}, skip_if_exists=False)
            room -= 1
            added += 1
        if added:
            self.shared.refresh()
        return added

    # -- internals --------------------------------------------------------------------------------
    @property
    def _budget(self) -> int:
        return self.budget if self.n_trials is None else min(self.budget, self.n_trials)

    def _trial(self, number: Any) -> FrozenTrial | None:
        """Trial ``number`` as of the last read; None for None or a trial not read."""
        try:
            return self.shared.tally.trial(int(number)) if number is not None else None
        except KeyError:
            return None

    def _checkpoints(self, number: int) -> Path:
        """Where trial ``number``'s last attempt checkpointed (``hpoflow.run.fencing.current``)."""
        t = self.shared.tally.trial(number)
        return current(Path(t.user_attrs.get(ATTR_CHECKPOINTS) or self.run_dir / "trials" / str(number)
                            / "checkpoints"))

    def _next(self, t: FrozenTrial) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The params and lineage of member ``t``'s next interval: exploit and explore, or go on."""
        lin = t.user_attrs[ATTR_LINEAGE]
        m, i = int(lin["member"]), int(lin["interval"])
        rng = np.random.default_rng([self.seed, m, i + 1])
        best = self.population.best
        # the members by their latest complete value, best first; a donor must have epochs left
        ordered = [k for _, k in self.population.ranking]
        top, bottom = self.policy.cut(ordered)
        failed = t.state != TrialState.COMPLETE
        if failed and not top:
            top = ordered[:1]
        # a donor is not behind: a member never trains an epoch range again, so it needs at most
        # ceil(epochs / interval) intervals and the population fits the budget
        top = [k for k in top if int(best[k].user_attrs[ATTR_LINEAGE]["end"]) >= int(lin["end"])]
        if (m in bottom or failed) and top and m not in top:
            donor = best[int(top[int(rng.integers(len(top)))])]
            dlin = donor.user_attrs[ATTR_LINEAGE]
            params = self._explore(donor, rng)
            self.n_exploits += 1
            _log.info("pbt: member %d (trial %d, %s) exploits trial %d (member %d)", m, t.number, t.value,
                      donor.number, dlin["member"])
            start, parent, seed = int(dlin["end"]), donor.number, int(dlin["seed"])
            donor_n: int | None = donor.number
        elif failed:
            return None  # nothing to resume from: the member stops
        else:
            params, start, parent, seed, donor_n = dict(t.params), int(lin["end"]), t.number, int(lin["seed"]), None
        if start >= self.epochs:
            return None
        new = {"member": m, "interval": i + 1, "parent": parent, "donor": donor_n, "start": start,
               "end": min(start + self.policy.interval, self.epochs), "seed": seed}
        return params, new

    def _explore(self, donor: FrozenTrial, rng: np.random.Generator) -> dict[str, Any]:
        current = dict(donor.params)
        if self._pb2 is None:
            return explore_pbt(self.policy, self.space, self.names, current, rng)
        names = [n for n in self.names if n in current and isinstance(self.space[n], FloatParam | IntParam)]
        bounds: Bounds = {}
        for n in names:
            p = self.space[n]
            if isinstance(p, FloatParam | IntParam):
                bounds[n] = (float(p.low), float(p.high), bool(p.log))
        t_now = float(donor.user_attrs[ATTR_LINEAGE]["end"])
        running = sorted(self.shared.tally.running.values(), key=lambda t: t.number)
        pending = [{n: float(t.params[n]) for n in names if n in t.params}  # the members running an interval
                   for t in running if t.number in self.population]
        new = self._pb2.explore(self._history(names), bounds, {n: float(current[n]) for n in names}, rng,
                                t_now, pending=pending)
        for n in names:
            current[n] = fit(self.space[n], float(new.get(n, current[n])))
        return current

    def _history(self, names: list[str]) -> list[tuple[float, dict[str, float], float]]:
        """(end epoch, hyperparams, reward change over the interval) of every complete interval with a
        complete parent (the change is signed so that larger is better)."""
        out = []
        for t in self.population.trials():
            lin = t.user_attrs[ATTR_LINEAGE]
            parent = self._trial(lin.get("parent"))
            if t.state != TrialState.COMPLETE or t.value is None or parent is None or parent.value is None:
                continue
            change = t.value - parent.value if self.policy.maximize else parent.value - t.value
            out.append((float(lin["end"]), {n: float(t.params[n]) for n in names if n in t.params}, float(change)))
        return out


def refuse_pbt_study(study: optuna.Study, own_id: str, stopping: Callable[[], bool] | None = None) -> None:
    """A driver without ``search.scheduler: {type: pbt}`` does not join a PBT study (``StudyTaken``): its
    asks would take PBT's queued intervals and train them from scratch. A study is PBT once a driver owns
    it (``PbtScheduling.own``) or while a PBT driver that has not claimed it yet runs (``stopping``: as for
    ``PbtScheduling.own``)."""
    pbt = _owner(Claims(study))[1]
    if pbt is None:
        info = first_alive(study, lambda info: bool(info.pbt), own_id, waiting=_waiting, stopping=stopping)
        pbt = info.id if info is not None else None
    if pbt is not None:
        raise StudyTaken(f"this study is run with search.scheduler pbt, owned by driver {_label(study, pbt)}, and "
                         "this spec has none: its trials would take pbt's queued intervals and train them from "
                         "scratch. Fix: run the study with its pbt spec, or give this spec another study.name")


def _owner(claims: Claims) -> tuple[int, str | None]:
    """The highest epoch of a PBT study's ownership and the driver that holds it (-1, None: none yet)."""
    held = {int(k[len(_OWNER):]): by for k, by in claims.holders(_OWNER).items() if k[len(_OWNER):].isdigit()}
    return (max(held), held[max(held)]) if held else (-1, None)


def _label(study: optuna.Study, driver_id: str) -> str:
    """``host:pid (run directory ...)`` of a driver, from its lease (its id when there is none)."""
    info = read_leases(study).get(driver_id)
    return f"{info.label} (run directory {info.run_dir})" if info is not None else driver_id


def _waiting(leases: list[LeaseInfo]) -> None:
    for info in leases:
        _log.warning("pbt: driver %s (run directory %s) of another host may run this study; waiting up to %g s to "
                     "see whether it still beats", info.label, info.run_dir, info.lease_s)


def _holds_files(directory: Path) -> bool:
    """Whether ``directory`` exists and holds anything (a checkpoint an attempt wrote, or a whole copy)."""
    try:
        return any(directory.iterdir())
    except OSError:
        return False


def _copy_into_place(src: Path, dst: Path) -> None:
    """``src``'s files into ``dst``, all or nothing: hard links (``hpoflow.run.fencing.link_tree``: no data
    copied, so the driver's loop does not wait for gigabytes) made beside ``dst`` first, then renamed into
    place (merged into a ``dst`` that exists already)."""
    tmp = dst.with_name(f".{dst.name}.copy-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    link_tree(src, tmp)
    try:
        os.rename(tmp, dst)  # dst absent (or empty): atomic
    except OSError:
        link_tree(tmp, dst)
        shutil.rmtree(tmp, ignore_errors=True)
