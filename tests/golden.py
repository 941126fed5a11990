"""Golden outputs: what the command-line tools print for fixed inputs, pinned so that a restructuring can show it
changed no behaviour (`python tests/golden.py --write` pins them anew; `tests/test_golden.py` compares).

Each case is (file name, module, argv). The commands run in this process (`runpy`), so the suite pays torch's
import once; outputs that name a temporary folder have it replaced by `<out>`, the user cache by `<cache>` and the checkout's own
path by `<repo>`.
"""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
import tempfile
from pathlib import Path

from dtrain.common.paths import cache_root

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "data" / "golden"
SMOKE = "tests/data/runs/smoke"
BENCH = f"{SMOKE}/bench.json"
PRESETS = ("h100x8", "a100x8", "v100x8", "p100x8", "h100x8-ib:2", "a100x8-ib:4", "v100x8-ib:2", "p100x8-ib:2")
PROFILES = ("base", "big", "ll", "ll128", "multi30k-cpu", "per_group", "simple", "smoke", "tree", "tuner")

SIMULATE = "dtrain.analysis.simulate"
COSTMODEL = "dtrain.collectives.costmodel"
RECOMMEND = "dtrain.analysis.recommend"
NCCL = "dtrain.collectives.tools.nccl"
REPORT = "dtrain.analysis.report"


def cases() -> list[tuple[str, str, list[str]]]:
    out = []
    run = f"{SMOKE}/smoke-bucketed-bucket_cap_mb=1"
    measured = [f"{SMOKE}/{d}" for d in ("smoke-ddp", "smoke-flat", "smoke-bucketed-bucket_cap_mb=0.05",
                                          "smoke-bucketed-bucket_cap_mb=1")]
    out.append(("simulate-local.txt", SIMULATE, ["--run", run, "--topology", f"local:{BENCH}"]))
    out.append(("simulate-local.json", SIMULATE, ["--run", run, "--topology", f"local:{BENCH}", "--json"]))
    out.append(("simulate-measured.txt", SIMULATE,
                ["--run", run, "--topology", f"local:{BENCH}", "--measured", *measured]))
    out.append(("simulate-every-step.txt", SIMULATE,
                ["--run", run, "--topology", f"local:{BENCH}", "--measured", *measured, "--every-step"]))
    out.append(("simulate-h100x8-ib2.txt", SIMULATE, ["--run", run, "--topology", "h100x8-ib:2", "--median"]))
    out.append(("simulate-paper.txt", SIMULATE, ["--run", run, "--topology", "p100x8", "--paper"]))
    for p in PRESETS:
        out.append((f"costmodel-{p.replace(':', '-')}.json", COSTMODEL, ["--topology", p, "--json"]))
    out.append(("costmodel-h100x8.txt", COSTMODEL, ["--topology", "h100x8"]))
    out.append(("costmodel-fit.txt", COSTMODEL, ["fit", BENCH, "--topology", "h100x8"]))
    out.append(("costmodel-nccl-log.txt", COSTMODEL, ["--topology", "nccl-log:tests/data/nccl/h200_per_class_2.28.9.log"]))
    out.append(("recommend-base.json", RECOMMEND,
                ["--profile", "dtrain/profiles/base.yaml", "--topology", "h100x8-ib:2", "--json"]))
    out.append(("recommend-smoke-local.txt", RECOMMEND,
                ["--profile", "dtrain/profiles/smoke.yaml", "--topology", f"local:{BENCH}", "--run", run]))
    for p in PROFILES:
        out.append((f"nccl-plan-{p}.txt", NCCL, ["groups", "--profile", f"dtrain/profiles/{p}.yaml"]))
    out.append(("report", REPORT, [SMOKE, "--bench", BENCH, "--out", "<out>"]))
    return out


def run_case(module: str, argv: list[str]) -> dict[str, str]:
    """{name: text}: stdout (and stderr, if any), plus every text file a command wrote under `<out>`."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.replace("<out>", tmp) for a in argv]
        stdout, stderr = io.StringIO(), io.StringIO()
        old = sys.argv
        sys.argv = [module, *args]
        code = 0
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code or 0
        finally:
            sys.argv = old
        result = {"stdout": stdout.getvalue().replace(tmp, "<out>")}
        # runpy's own warning about a module imported before it runs is about this harness, not the command
        err = "".join(line for line in stderr.getvalue().splitlines(keepends=True)
                      if not line.startswith("<frozen runpy>"))
        if err or code:
            result["stderr"] = f"exit {code}\n" + err.replace(tmp, "<out>")
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file() and f.suffix in (".md", ".csv", ".json", ".txt", ".yaml"):
                result[str(f.relative_to(tmp))] = f.read_text().replace(tmp, "<out>")
        return result


def render(name: str, module: str, argv: list[str]) -> str:
    parts = {k: v.replace(str(cache_root()), "<cache>").replace(str(REPO), "<repo>")
             for k, v in run_case(module, argv).items()}
    if list(parts) == ["stdout"]:
        return parts["stdout"]
    return "".join(f"===== {k}\n{v}" for k, v in parts.items())


if __name__ == "__main__":
    import os

    os.chdir(REPO)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, module, argv in cases():
        text = render(name, module, argv)
        if "--write" in sys.argv:
            (GOLDEN / (name if "." in name else name + ".txt")).write_text(text)
        print(f"{name}: {len(text)} chars", file=sys.__stderr__)
