"""The acceptance corpus at full size: every public program of tests/corpus/programs.py, unchanged, as hpoflow
command trials in every mode: warm and isolated (``training.isolate``), 1 rank and, for a program that
runs distributed, 2 ranks (``resources.processes: 2``), with the median pruner and with promotion ASHA
(``search.scheduler: asha``); and, with ``--concurrent``, 2 trials at once, each in its own working
directory (the trial's directory: ``training.workdir``'s default).

The programs are fetched from PyPI by pip, pinned by sha256, into ``${XDG_CACHE_HOME:-~/.cache}/hpoflow-corpus``
(``HPOFLOW_CORPUS_CACHE`` overrides it), with stand-in data made there; nothing else is downloaded. A
program that cannot be had is a row saying why. Prints one row per run (program, source and version,
mode, ranks, result, trials complete of those run, wall seconds), the candidates left out and why, then
one JSON line.

    python bench/corpus.py [--programs KEY,...] [--trials 4] [--only-warm] [--concurrent] [--timeout 900]

About 10-15 minutes on 2 cores for the whole matrix (the reduced case is tests/corpus/test_corpus.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import BENCH, emit

ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from tests.corpus import programs as corpus  # noqa: E402  (the corpus, as the tests run it)
from tests.corpus import sources  # noqa: E402


def modes(program: corpus.Program, trials: int, only_warm: bool, concurrent: bool) -> list[corpus.Mode]:
    out = []
    if program.reads:  # no report can be read: one trial a mode shows that the program runs to its end
        trials = 1
    for isolate in (False,) if only_warm else (False, True):
        for ranks in (1, 2) if program.distributed else (1,):
            for search in ("pruner", "asha"):
                out.append(corpus.Mode(isolate=isolate, ranks=ranks, search=search, n_trials=trials))
    if concurrent and program.cpus == 1:
        out.append(corpus.Mode(search="plain", n_trials=2, max_concurrent=2))
    return out


def result(program: corpus.Program, mode: corpus.Mode, o: corpus.Outcome) -> str:
    failed = sum(s == "FAIL" for s in o.states())
    if program.reads:
        codes = {tuple(corpus.exit_codes(o, int(t["number"]), mode.ranks)) for t in o.trials}
        ran = all(all(c == 0 for c in cs) for cs in codes) and bool(codes)
        return f"no report, as documented; program {'exited 0 on every rank' if ran else 'did not end cleanly'}"
    if o.rc == 0 and failed == 0 and o.summary.get("n_complete", 0) >= 1:
        expect = list((program.expect_2 or program.expect) if mode.ranks == 2 else program.expect)
        wrong = {}
        for t in o.trials:
            steps = corpus.reported_steps(o, int(t["number"]))
            if steps != expect[:len(steps)] or (t["state"] == "COMPLETE" and steps != expect):
                wrong[t["number"]] = steps
        return "ok" if not wrong else f"complete, but reported steps {wrong} (expected {expect})"
    if o.rc == 124:
        return "timed out"
    return f"failed ({failed} of {len(o.trials)} trials; rc {o.rc}): {o.cause()[:300]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default="", help="comma-separated keys (default: all)")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--only-warm", action="store_true")
    ap.add_argument("--concurrent", action="store_true", help="also 2 trials at once (each in its own directory)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per study")
    args = ap.parse_args()
    keys = [k for k in args.programs.split(",") if k] or [p.key for p in corpus.PROGRAMS]
    rows: list[dict[str, object]] = []
    header = f"{'program':26} {'source':44} {'mode':24} {'ranks':>5} {'complete':>9} {'wall s':>7}  result"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="hpoflow-corpus-bench-") as tmp:
        for key in keys:
            p = corpus.BY_KEY[key]
            a = sources.ARCHIVES[p.archive]
            src = f"{a.name}=={a.version}:{p.path.rsplit('/', 1)[-1]}"
            for i, mode in enumerate(modes(p, args.trials, args.only_warm, args.concurrent)):
                work = Path(tmp) / f"{key}-{i}"
                try:
                    prep = corpus.prepare(p, work)
                except sources.Unavailable as exc:
                    row = {"program": key, "source": src, "mode": "-", "ranks": "-", "result": f"skipped: {exc}",
                           "complete": "-", "wall_s": 0.0}
                    rows.append(row)
                    print(f"{key:26} {src:44} {'-':24} {'-':>5} {'-':>9} {0.0:7.1f}  skipped: {exc}", flush=True)
                    break
                o = corpus.run(prep, mode, work, f"{key}-{i}", timeout_s=args.timeout)
                res = result(p, mode, o)
                complete = f"{o.summary.get('n_complete', 0)}/{len(o.trials)}"
                rows.append({"program": key, "source": src, "mode": mode.label, "ranks": mode.ranks, "result": res,
                             "complete": complete, "wall_s": round(o.wall_s, 1)})
                print(f"{key:26} {src:44} {mode.label:24} {mode.ranks:>5} {complete:>9} {o.wall_s:7.1f}  {res}",
                      flush=True)
    print()
    print("Candidates left out:")
    for name, where, why in corpus.CANDIDATES:
        print(f"- {name} [{where}]: {why}")
    emit({"corpus_runs": len(rows), "corpus_ok": sum(r["result"] == "ok" for r in rows),
          "corpus_skipped": sum(str(r["result"]).startswith("skipped") for r in rows), "rows": rows})


if __name__ == "__main__":
    main()
