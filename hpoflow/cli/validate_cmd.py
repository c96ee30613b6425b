"""``hpoflow validate SPEC``: check a spec without running it, with every check ``hpoflow run`` makes
before its first trial (``hpoflow.api.preflight.check_runnable``): a spec that validates runs."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("validate", help="check a study spec without running it",
                       description="Check a study spec, and everything `hpoflow run` checks before its first "
                                   "trial (the engine fits the trials, the sampler and pruner build and can "
                                   "propose a trial of this study, HPOFLOW_N_TRIALS, storage_env, the oracle's "
                                   "cluster, the warm-start run; with a share of a GPU per rank, that some trial "
                                   "fits its share); errors give the key path, line, rule and fix.")
    p.add_argument("spec", help="study spec (YAML)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpoflow.spec import load_spec

    spec, text = load_spec(args.spec)  # a spec that does not load is refused before Optuna is imported
    from hpoflow.api.preflight import check_runnable, check_share

    check_runnable(spec, text, args.spec)
    check_share(spec, text, args.spec)
    r = spec.resources
    n = spec.search.n_trials
    ranks = f"{r.processes}-{r.elastic.max} process(es) per trial (elastic, {r.elastic.policy})" \
        if r.elastic is not None else f"{r.processes} process(es) per trial"
    if 0 < r.gpus_per_process < 1:
        ranks += f", each on a {r.gpus_per_process:g} share of a GPU"
    print(f"{args.spec}: valid — study {spec.study.name!r}, {len(spec.space)} parameters, "
          f"{spec.search.algorithm}, {n if n is not None else 'all grid'} trials, {ranks}, engine {spec.engine}")
    return 0
