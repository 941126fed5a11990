"""BLEU with confidence intervals: sacreBLEU's paired bootstrap resampling between a baseline run and every other run
scored on the same references, and the spread across training seeds where a configuration was trained with several.

    python -m dtrain.analysis.significance runs/sweep-bleu-cost-testbed
    python -m dtrain.analysis.significance runs/a runs/b --baseline a --split val --markdown

The test is sacreBLEU's own (`sacrebleu.significance.PairedTest`, type "bs": what `sacrebleu --paired-bs` runs),
after Koehn 2004, "Statistical Significance Tests for Machine Translation Evaluation" (EMNLP) and Moses'
bootstrap-hypothesis-difference-significance.pl: the test sentences are resampled with replacement (1,000 times by
default), the same resamples for the baseline and the system. A system's 95% interval is the bootstrap mean ± half
the width between the resamples' 2.5th and 97.5th percentile scores; the p-value is the share of resamples whose
difference, centred on the resamples' mean difference, exceeds the observed one (two-sided). p < 0.05: significant.

Each run is scored from its `hyps.<split>.txt` against the split's reference file, found as `dtrain.engine.evaluate` finds it
(the run's data.dir, else $DTRAIN_DATA_DIR/multi30k, else the cache), so the scores are recomputed, not read from
eval.jsonl. Runs are compared only on identical references. A run whose translations are the baseline's, line for
line, gets p = 1 (sacreBLEU's test would return its smallest p there: see `paired_bootstrap`). The seed of the bootstrap is fixed (sacreBLEU's
SACREBLEU_SEED, default 12345), so a table is reproducible.

Seeds: runs whose config.yaml differs only in `seed` are one configuration. Each run is then compared with the
baseline configuration's run of the same seed where there is one (paired by seed), and a second table gives each
configuration's mean BLEU and spread across its seeds, with how many of its seeds differ significantly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pandas as pd
from sacrebleu.significance import PairedTest

from dtrain.analysis.runs import Run, load_runs
from dtrain.common.errors import ArgumentParser, UserError, exit_on_user_error
from dtrain.engine.bleu import bleu_metric
from dtrain.engine.data import MULTI30K_SPLITS, multi30k_dir, multi30k_split

PROG = "dtrain.analysis.significance"
ALPHA = 0.05
SAMPLES = 1000  # sacreBLEU's default number of bootstrap resamples
SEED = 12345  # sacreBLEU's default SACREBLEU_SEED
SPLITS = ("test", "val")


class NotComparable(UserError):
    """Translations that cannot be scored together (other references, or not one a reference line): the report
    skips its section with this message, the command stops with it."""


@dataclass
class System:
    """One run's translations of a split and the references they are scored against."""

    run: Run
    hypotheses: list[str]
    references: tuple[str, ...]
    reference_file: str  # where the references came from, for messages
    configuration: str = ""  # runs differing only in seed share it
    seed: int | None = None


def hypotheses_file(run: Run, split: str) -> Path:
    return run.path / f"hyps.{split}.txt"


def has_hypotheses(run: Run) -> bool:
    return any(hypotheses_file(run, s).is_file() for s in SPLITS)


def read_hypotheses(run: Run, split: str) -> list[str]:
    """The lines `dtrain.engine.evaluate` wrote ('\\n'.join(hypotheses) + '\\n'), an empty translation kept as ''."""
    path = hypotheses_file(run, split)
    if not path.is_file():
        raise UserError(f"{run.path}: no hypotheses for split {split} ({path.name}); "
                        f"python -m dtrain.engine.evaluate --run {run.path} --split {split} writes them")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not valid UTF-8") from None
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines


@lru_cache(maxsize=None)
def _references(directory: str, split: str, src: str, tgt: str) -> tuple[str, ...]:
    return tuple(multi30k_split(Path(directory), split, src, tgt)[1])


def references(run: Run, split: str) -> tuple[tuple[str, ...], str]:
    """The split's target side, found from the run's config.yaml as `dtrain.engine.evaluate` finds it; and its file name."""
    d = run.cfg.data
    directory = multi30k_dir(d.dir, d.cache_dir, d.src, d.tgt)
    return _references(str(directory), split, d.src, d.tgt), f"{directory}/{MULTI30K_SPLITS[split]}.{d.tgt}"


def pick_split(runs: list[Run]) -> str:
    """The split every run's BLEU record names, else the first of test, val that every run has hypotheses for."""
    recorded = {r.bleu.get("split") for r in runs if r.bleu and r.bleu.get("split")}
    if len(recorded) == 1 and all(hypotheses_file(r, next(iter(recorded))).is_file() for r in runs):
        return recorded.pop()
    for split in SPLITS:
        if all(hypotheses_file(r, split).is_file() for r in runs):
            return split
    return next(iter(recorded), SPLITS[0])  # some run lacks it: load_systems names that run


def load_systems(runs: list[Run], split: str, strict: bool = True) -> tuple[list[System], list[Run]]:
    """The scored runs' systems on `split` and the runs left out. The no-communication baseline is never scored;
    a run without hypotheses is an error when `strict`, else left out. Every system must have as many hypotheses as
    the references have lines, and the same references (`NotComparable` otherwise)."""
    systems, left_out = [], []
    for run in runs:
        if not run.communicates:
            continue
        if not strict and not hypotheses_file(run, split).is_file():
            left_out.append(run)
            continue
        hyps = read_hypotheses(run, split)
        refs, ref_file = references(run, split)
        if len(hyps) != len(refs):
            raise NotComparable(f"{hypotheses_file(run, split)}: {len(hyps)} hypotheses for the {len(refs)} "
                                f"{split} references of {ref_file}")
        if systems and refs != systems[0].references:
            raise NotComparable(f"{run.path}: its {split} references ({ref_file}) differ from those of "
                                f"{systems[0].run.path} ({systems[0].reference_file}); BLEU on different references "
                                "cannot be compared")
        seed = run.config.get("seed") if isinstance(run.config, dict) else None
        systems.append(System(run, hyps, refs, ref_file, seed=seed if isinstance(seed, int) else None))
    _name_configurations(systems)
    return systems, left_out


def _name_configurations(systems: list[System]) -> None:
    """Runs whose config.yaml differs only in `seed` are one configuration, named after its first run's directory
    with any 'seed=N' part removed (its label where two configurations would get one name)."""
    groups: dict[str, list[System]] = {}
    for s in systems:
        config = {k: v for k, v in s.run.config.items() if k != "seed"} if isinstance(s.run.config, dict) else {}
        groups.setdefault(json.dumps(config, sort_keys=True, default=str) or s.run.label, []).append(s)
    names = {key: re.sub(r"[-_]?seed=[^-_/]+", "", members[0].run.path.name) or members[0].run.label
             for key, members in groups.items()}
    clashing = {n for n in names.values() if list(names.values()).count(n) > 1}
    for key, members in groups.items():
        name = members[0].run.label if names[key] in clashing else names[key]
        for s in members:
            s.configuration = name


def pick_baseline(systems: list[System], wanted: str | None) -> System:
    """The run named by --baseline (its label, directory name or path), else the first DDP run, else the first."""
    if not systems:
        raise UserError("no run to compare: none has hypotheses (hyps.<split>.txt)")
    if wanted:
        for s in systems:
            if wanted in (s.run.label, s.run.path.name, str(s.run.path)):
                return s
        raise UserError(f"--baseline {wanted}: no such scored run among the inputs "
                        f"({', '.join(s.run.label for s in systems)})")
    return next((s for s in systems if s.run.strategy == "ddp"), systems[0])


@contextlib.contextmanager
def _sacrebleu_seed(seed: int):
    """sacreBLEU reads its bootstrap seed from SACREBLEU_SEED when a test is built; set for this test only."""
    old = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if old is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = old


def paired_bootstrap(baseline: System, others: list[System], samples: int = SAMPLES, seed: int = SEED
                     ) -> tuple[list[dict], str]:
    """sacreBLEU's paired bootstrap test of each of `others` against `baseline`: one row per system, the baseline's
    first (p_value None), and the test's signature."""
    if samples < 1 or seed < 1:  # sacreBLEU takes 0 for "its default" and a seed of 0 for "unseeded"
        raise UserError(f"the bootstrap needs a positive number of samples and a positive seed, got {samples}, {seed}")
    named = [(baseline.run.label, baseline.hypotheses)] + [(s.run.label, s.hypotheses) for s in others]
    with _sacrebleu_seed(seed):
        test = PairedTest(named, {"BLEU": bleu_metric()}, [list(baseline.references)], test_type="bs",
                          n_samples=samples)
        signatures, scores = test()
    (name, results), = ((k, v) for k, v in scores.items() if k != "System")
    rows = []
    for s, result in zip([baseline, *others], results):
        p = result.p_value
        if p is not None and s.hypotheses == baseline.hypotheses:
            # Every resample then differs by exactly 0 and sacreBLEU counts none "greater than" the observed 0,
            # returning its smallest p, 1/(samples+1): identical translations are no difference at all.
            p = 1.0
        rows.append({"run": s.run.label, "configuration": s.configuration, "seed": s.seed,
                     "bleu": result.score, "mean": result.mean, "ci": result.ci,
                     "low": result.mean - result.ci, "high": result.mean + result.ci,
                     "baseline": baseline.run.label, "delta": result.score - results[0].score,
                     "p_value": p, "significant": None if p is None else bool(p < ALPHA)})
    return rows, str(signatures[name])


def paired_table(systems: list[System], baseline: System, samples: int = SAMPLES, seed: int = SEED
                 ) -> tuple[pd.DataFrame, str]:
    """Every system against the baseline: the baseline configuration's run of the same seed where the baseline
    configuration has several seeds, else the baseline run. One row per run, in input order."""
    partners: dict[int | None, System] = {}
    for s in systems:
        if s.configuration == baseline.configuration:
            partners.setdefault(s.seed, s)
    by_seed = len(partners) > 1
    partners[baseline.seed] = baseline  # the named baseline stands for its own seed
    groups: dict[int, tuple[System, list[System]]] = {id(baseline): (baseline, [])}
    for s in systems:
        partner = partners.get(s.seed, baseline) if by_seed else baseline
        if s is partner:
            groups.setdefault(id(s), (s, []))
        else:
            groups.setdefault(id(partner), (partner, []))[1].append(s)
    rows, signature = {}, ""
    for partner, others in groups.values():
        found, signature = paired_bootstrap(partner, others, samples, seed)
        rows.update({id(s): r for s, r in zip([partner, *others], found)})
    return pd.DataFrame([rows[id(s)] for s in systems]), signature


def seed_table(paired: pd.DataFrame, baseline: System) -> pd.DataFrame:
    """Per configuration: its runs and seeds, mean BLEU and its spread across seeds (sample standard deviation,
    min, max), the difference of means to the baseline configuration, and in how many of its seeds the paired test
    found a significant difference. Empty when no configuration has runs of two seeds."""
    if not any(g["seed"].nunique() > 1 for _, g in paired.groupby("configuration", sort=False)):
        return pd.DataFrame()
    base_mean = paired.loc[paired["configuration"] == baseline.configuration, "bleu"].mean()
    rows = []
    for name, g in paired.groupby("configuration", sort=False):
        tested = g["significant"].dropna()
        rows.append({"configuration": name, "runs": len(g), "seeds": ",".join(str(int(v)) for v in sorted(g["seed"].dropna())),
                     "mean_bleu": g["bleu"].mean(), "sd": statistics.stdev(g["bleu"]) if len(g) > 1 else float("nan"),
                     "min": g["bleu"].min(), "max": g["bleu"].max(), "delta_mean": g["bleu"].mean() - base_mean,
                     "significant_seeds": f"{int(tested.sum())} of {len(tested)}" if len(tested) else ""})
    return pd.DataFrame(rows)


@dataclass
class Analysis:
    """What the CLI prints and the report shows."""

    split: str
    baseline: System
    systems: list[System]
    left_out: list[Run]
    paired: pd.DataFrame
    seeds: pd.DataFrame
    signature: str
    samples: int

    def caption(self) -> str:
        runs = ", ".join(f"{s.run.label} ({s.run.path})" for s in self.systems)
        gone = (f" Left out (no hyps.{self.split}.txt): {', '.join(r.label for r in self.left_out)}."
                if self.left_out else "")
        seeds = ("Runs of several seeds are paired with the baseline configuration's run of the same seed; "
                 "the second table gives each configuration's mean and spread across its seeds."
                 if len(self.seeds) else "Each configuration has one seed here: no spread across seeds.")
        return (f"BLEU on split {self.split} ({len(self.baseline.references)} sentences, references "
                f"{self.baseline.reference_file}), recomputed from each run's hyps.{self.split}.txt. Runs: {runs}."
                f"{gone} bleu: sacreBLEU's corpus score; 95% CI: the bootstrap mean ± half the 2.5-97.5 percentile "
                f"range of {self.samples} resamples; p: sacreBLEU's paired bootstrap test against the baseline "
                f"({self.baseline.run.label} unless the row says otherwise), significant when p < {ALPHA}. "
                f"{seeds} Signature: {self.signature}.")


def analyse(runs: list[Run], split: str | None = None, baseline: str | None = None, samples: int = SAMPLES,
            seed: int = SEED, strict: bool = True) -> Analysis:
    if split is not None and split not in SPLITS:
        raise UserError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    scored = [r for r in runs if r.communicates]
    split = split or pick_split([r for r in scored if strict or has_hypotheses(r)])
    systems, left_out = load_systems(scored, split, strict)
    base = pick_baseline(systems, baseline)
    if len(systems) < 2:
        raise NotComparable(f"one run with hyps.{split}.txt ({base.run.label}): nothing to compare it with")
    paired, signature = paired_table(systems, base, samples, seed)
    return Analysis(split, base, systems, left_out, paired, seed_table(paired, base), signature, samples)


def display_paired(t: pd.DataFrame) -> pd.DataFrame:
    """The paired table as text: BLEU with its interval, the difference and its p-value."""
    def p_text(row):
        return "" if row["p_value"] is None or pd.isna(row["p_value"]) else f"{row['p_value']:.3f}"

    return pd.DataFrame({
        "run": t["run"], "seed": t["seed"].map(lambda s: "" if s is None or pd.isna(s) else str(int(s))),
        "BLEU": t["bleu"].map(lambda v: f"{v:.2f}"),
        "95% CI": [f"{m:.2f} ± {c:.2f} [{lo:.2f}, {hi:.2f}]" for m, c, lo, hi in
                   zip(t["mean"], t["ci"], t["low"], t["high"])],
        "baseline": [("(baseline)" if r == b else b) for r, b in zip(t["run"], t["baseline"])],
        "Δ BLEU": [("" if r == b else f"{d:+.2f}") for r, b, d in zip(t["run"], t["baseline"], t["delta"])],
        "p": [p_text(row) for _, row in t.iterrows()],
        "significant": [("" if s is None or pd.isna(s) else "yes" if s else "no") for s in t["significant"]],
    })


def display_seeds(t: pd.DataFrame) -> pd.DataFrame:
    def num(v, sign=""):
        return "" if pd.isna(v) else f"{v:{sign}.2f}"

    return pd.DataFrame({"configuration": t["configuration"], "runs": t["runs"].astype(str), "seeds": t["seeds"],
                         "mean BLEU": t["mean_bleu"].map(num), "sd": t["sd"].map(num),
                         "min–max": [f"{a:.2f}–{b:.2f}" for a, b in zip(t["min"], t["max"])],
                         "Δ mean": t["delta_mean"].map(lambda v: num(v, "+")),
                         "significant seeds": t["significant_seeds"]})


def markdown(t: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
    return "\n".join(lines + ["| " + " | ".join(str(v).replace("|", "/") for v in row) + " |"
                              for row in t.itertuples(index=False)])


def aligned(t: pd.DataFrame) -> str:
    cells = [list(t.columns)] + [[str(v) for v in row] for row in t.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(t.columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def main(argv=None) -> int:
    ap = ArgumentParser(prog=PROG, description="BLEU with 95% confidence intervals and sacreBLEU's paired bootstrap "
                                               "test of each run against a baseline run.")
    ap.add_argument("runs", nargs="+", help="run directories, or folders of them (a sweep's output)")
    ap.add_argument("--baseline", help="run compared with (its directory name; default: the first ddp run, else "
                                       "the first run)")
    ap.add_argument("--split", help="test or val (default: the split the runs' BLEU records name)")
    ap.add_argument("--samples", type=int, default=SAMPLES, help=f"bootstrap resamples (default {SAMPLES})")
    ap.add_argument("--seed", type=int, default=SEED, help=f"seed of the resampling (default {SEED}, sacreBLEU's)")
    ap.add_argument("--markdown", action="store_true", help="Markdown tables instead of aligned text")
    with exit_on_user_error(PROG):
        args = ap.parse_args(argv)
        runs = load_runs(args.runs)
        if not runs:
            raise UserError(f"no run directories in {', '.join(args.runs)} (a run holds steps.jsonl)")
        names = [r.label for r in runs]
        for r in runs:  # runs of two sweeps with one name: their sweep's name in front
            if names.count(r.label) > 1:
                r.label = f"{r.path.parent.name}/{r.path.name}"
        a = analyse(runs, args.split, args.baseline, args.samples, args.seed)
        show = markdown if args.markdown else aligned
        print(show(display_paired(a.paired)))
        if len(a.seeds):
            print()
            print(show(display_seeds(a.seeds)))
        print()
        print(a.caption())
    return 0


if __name__ == "__main__":
    sys.exit(main())
