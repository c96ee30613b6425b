"""``hpoflow validate SPEC``: check a spec (and that its trials fit the engine it names) without running."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("validate", help="check a study spec without running it",
                       description="Check a study spec; errors give the key path, line, rule and fix.")
    p.add_argument("spec", help="study spec (YAML)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpoflow.engines import check_fit
    from hpoflow.spec import load_spec
    from hpoflow.trial import TrialRequest

    spec, _ = load_spec(args.spec)
    r = spec.resources
    check_fit(spec.engine, spec.engine_option_values(),
              TrialRequest.shape(r.processes, r.cpus_per_process, r.gpus_per_process, r.nodes))
    n = spec.search.n_trials
    ranks = f"{r.processes}-{r.elastic.max} process(es) per trial (elastic, {r.elastic.policy})" \
        if r.elastic is not None else f"{r.processes} process(es) per trial"
    print(f"{args.spec}: valid — study {spec.study.name!r}, {len(spec.space)} parameters, "
          f"{spec.search.algorithm}, {n if n is not None else 'all grid'} trials, {ranks}, engine {spec.engine}")
    return 0
