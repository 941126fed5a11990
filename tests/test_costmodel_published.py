"""Published nccl-tests all_reduce_perf logs (tests/data/nccl_tests_published/<name>.txt, each with its source in
<name>.source.md): `costmodel fit` on every other size predicts the sizes it did not see, and the analytical preset
matching each log's hardware is compared with the log's large-message bus bandwidth. The comparisons are written up
in docs/costmodel.md, whose tables this test checks against what the code computes. A published all_gather_perf log
(ALL_GATHER) is fitted the same way, as an all-gather."""

import re
import statistics
from pathlib import Path

import pytest

from dtrain.collectives import costmodel as cm
from dtrain.collectives.costmodel.measurements import read_measurements

PUBLISHED = Path(__file__).parent / "data" / "nccl_tests_published"
DOC = Path(__file__).parent.parent / "docs" / "costmodel.md"
LOGS = ("a100x8_1node", "a100x8_2node_efa", "a100x8_16node_ib", "b200x8_2node_ib", "gh200x1_2node_slingshot",
        "gh200x4_2node_slingshot", "h100x8_2node_tcpxo", "h200x1_2node_roce", "l40sx1_2node_sockets",
        "l40sx2_2node_roce", "v100x8_1node")
# The preset matching each log's hardware (None: no preset models that machine; see docs/costmodel.md).
PRESET = {"a100x8_1node": "a100x8", "a100x8_2node_efa": "a100x8-ib:2", "a100x8_16node_ib": "a100x8-ib:16",
          "b200x8_2node_ib": "b200x8-ib:2", "h100x8_2node_tcpxo": "h100x8-ib:2", "v100x8_1node": "v100x8",
          "gh200x1_2node_slingshot": None, "gh200x4_2node_slingshot": None, "h200x1_2node_roce": None,
          "l40sx1_2node_sockets": None, "l40sx2_2node_roce": None}
MIB = 1 << 20
# Held-out sizes >= 1 MiB are predicted within 10 %, except these, each measured and explained in
# docs/costmodel.md ("Fit on half the sizes"): (half, size) -> why the fit cannot reach them.
OVER_10 = {
    "a100x8_1node": {(0, 1 * MIB), (0, 64 * MIB), (1, 8 * MIB), (1, 32 * MIB)},  # the curve bends between samples
    "b200x8_2node_ib": {(0, 1 * MIB), (0, 4 * MIB), (1, 128 * MIB)},  # a 512 KiB outlier, a 1-4 MiB plateau
    "gh200x1_2node_slingshot": {(0, 128 * MIB), (1, 4 * MIB)},  # four training sizes a half
    "gh200x4_2node_slingshot": {(0, 1 * MIB), (0, 4 * MIB), (0, 16 * MIB), (1, 8 * MIB), (1, 128 * MIB)},  # noise
    "h200x1_2node_roce": {(0, 32 * MIB), (1, 1 * MIB), (1, 64 * MIB)},  # a step from 32 to 64 MiB
    "l40sx1_2node_sockets": {(0, 1 * MIB)},  # a step: 512 KiB and 1 MiB take the same time
    "l40sx2_2node_roce": {(0, 1 * MIB), (1, 2 * MIB)},  # a step from 1 to 2 MiB
    "a100x8_2node_efa": {(0, 1 * MIB), (1, 2 * MIB)},  # the curve bends between the sampled sizes
    "v100x8_1node": {(0, 1 * MIB)},  # likewise
    "a100x8_16node_ib": {(1, 64 * MIB), (1, 1024 * MIB)},  # the bus bandwidth stalls from 32 to 64 MiB
}
HARD_LIMIT = 0.30  # no held-out size >= 1 MiB is further off than this, explained or not
ALL_GATHER = "h200x8_2node_rdma_all_gather"  # 16 H200 ranks over GPUDirect-RDMA; no `Collective test` line


# A launcher's label in front of each line (Open MPI's --tag-output), as the reader strips it
_LABEL = re.compile(r"^\[\d+,\d+\]<stdout>:")


def _is_row(line: str) -> bool:
    f = _LABEL.sub("", line).split()
    return len(f) > 6 and f[0].isdigit() and f[1].isdigit()


def _half(src: Path, dst: Path, keep: set[int]) -> None:
    """The log with only the data rows of sizes in `keep`: every other line (headers, comments) as published."""
    lines = [ln for ln in src.read_text().splitlines() if not _is_row(ln) or int(_LABEL.sub("", ln).split()[0]) in keep]
    dst.write_text("\n".join(lines) + "\n")


def measured_times(name: str) -> dict[int, float]:
    """{size: µs} of a log, the first row of each size (the mean time, nccl-tests' `time` column)."""
    measured = {}
    for m in read_measurements(PUBLISHED / f"{name}.txt").rows:
        measured.setdefault(m.size, m.time_us)
    return measured


def held_out_errors(name: str, tmp_path: Path, coll: str = "allreduce") -> dict[int, dict[int, float]]:
    """{half: {size: relative error}} of `costmodel fit` on sizes 0, 2, 4, ... (half 0) or 1, 3, 5, ... (half 1)
    of the sorted distinct sizes, predicting the others (`measured_times`) of the log's collective `coll`."""
    src = PUBLISHED / f"{name}.txt"
    measured = measured_times(name)
    sizes = sorted(measured)
    out = {}
    for half in (0, 1):
        train = set(sizes[half::2])
        part, saved = tmp_path / f"{name}.{half}.txt", tmp_path / f"{name}.{half}.json"
        _half(src, part, train)
        cm.main(["fit", str(part), "--out", str(saved)])
        model = cm.load_model(f"fit:{saved}")
        out[half] = {s: model.time_us(s, coll) / measured[s] - 1 for s in sizes if s not in train}
    return out


def interpolated_errors(name: str) -> dict[int, float]:
    """{size: relative error} at held-out sizes >= 1 MiB of the straight line through the two training sizes around
    each (the same halves as `held_out_errors`)."""
    measured = measured_times(name)
    sizes = sorted(measured)
    out = {}
    for half in (0, 1):
        train = sizes[half::2]
        for s in sizes:
            if s < MIB or s in train:
                continue
            hi = next((x for x in train if x > s), None)
            lo, hi = (train[-2], train[-1]) if hi is None else (train[train.index(hi) - 1], hi)
            t = measured[lo] + (measured[hi] - measured[lo]) * (s - lo) / (hi - lo)
            out[s] = t / measured[s] - 1  # each size is held out by one half
    return out


def error_by_range(errors: dict[int, dict[int, float]]) -> dict[str, tuple[float, float]]:
    """(median, max) |relative error| per size range, both halves together."""
    ranges = {"< 64 KiB": (0, 64 << 10), "64 KiB - 1 MiB": (64 << 10, MIB), ">= 1 MiB": (MIB, float("inf"))}
    out = {}
    for label, (lo, hi) in ranges.items():
        errs = [abs(e) for half in errors.values() for s, e in half.items() if lo <= s < hi]
        if errs:
            out[label] = (statistics.median(errs), max(errs))
    return out


def preset_comparison(name: str) -> tuple[int, float, float, str]:
    """(size, measured busbw, modeled busbw, NCCL's modeled pick) at the log's largest size."""
    top = max(read_measurements(PUBLISHED / f"{name}.txt").rows, key=lambda m: m.size)
    pick = cm.NcclModel(cm.topology(PRESET[name])).pick(top.size)
    return top.size, top.busbw, pick.busbw, f"{pick.algo}/{pick.proto}"


def _doc_rows(section: str) -> dict[str, list[str]]:
    """The rows of the table under `## <section>` in docs/costmodel.md, up to the next heading: first cell -> the
    other cells."""
    text = DOC.read_text().split(f"## {section}", 1)[1]
    rows = {}
    for line in text.splitlines():
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= set("-: "):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_every_published_log_has_its_source_and_is_read_whole():
    for name in LOGS:
        src = (PUBLISHED / f"{name}.source.md").read_text()
        assert re.search(r"https://github\.com/\S+", src), name
        for field in ("GPU", "Nodes", "NCCL", "Command"):
            assert f"**{field}**" in src, (name, field)
        ms = read_measurements(PUBLISHED / f"{name}.txt")
        rows = [ln for ln in (PUBLISHED / f"{name}.txt").read_text().splitlines() if _is_row(ln)]
        assert len(ms.rows) == len(rows) and ms.skipped == 0, name  # every data row read, none dropped
        assert ms.coll == "allreduce"


@pytest.mark.parametrize("name", LOGS)
def test_a_fit_on_half_the_sizes_predicts_the_other_half(name, tmp_path, capsys):
    errors = held_out_errors(name, tmp_path)
    capsys.readouterr()
    over = {(half, s) for half, errs in errors.items() for s, e in errs.items() if s >= MIB and abs(e) > 0.10}
    assert over == OVER_10.get(name, set()), {k: round(100 * errors[k[0]][k[1]], 1) for k in over}
    assert max(abs(e) for errs in errors.values() for s, e in errs.items() if s >= MIB) <= HARD_LIMIT
    # The per-range errors docs/costmodel.md reports are the ones measured here.
    doc = _doc_rows("Fit on half the sizes")[name]
    for label, (median, worst) in error_by_range(errors).items():
        cell = doc[["< 64 KiB", "64 KiB - 1 MiB", ">= 1 MiB"].index(label)]
        assert cell == f"{100 * median:.1f} / {100 * worst:.1f}", (name, label, cell)


@pytest.mark.parametrize("name", [n for n in LOGS if PRESET[n]])
def test_the_matching_preset_against_the_log_is_what_the_docs_say(name):
    _, measured, modeled, pick = preset_comparison(name)
    doc = _doc_rows("Presets against the logs")[name]
    assert doc[0].strip("`") == PRESET[name] and doc[1] == pick
    assert doc[2] == f"{measured:.1f}" and doc[3] == f"{modeled:.1f}"
    err = 100 * (modeled / measured - 1)
    assert doc[4] == f"{err:+.1f}"
    # Within 15 % or explained: the docs give a reason for every preset further off than that.
    assert abs(err) <= 15 or len(doc[5]) > 40, (name, err)


@pytest.mark.parametrize("name", LOGS)
def test_interpolation_between_training_sizes_is_what_the_docs_say(name, tmp_path, capsys):
    """docs/costmodel.md's comparison: the worst held-out size >= 1 MiB interpolated, beside the fit's worst."""
    interp = interpolated_errors(name)
    worst = max(interp, key=lambda s: abs(interp[s]))
    fit = max(abs(e) for errs in held_out_errors(name, tmp_path).values() for s, e in errs.items() if s >= MIB)
    capsys.readouterr()
    doc = _doc_rows("Against interpolation")[name]
    where = f" ({worst // MIB} MiB)" if abs(interp[worst]) > 0.10 else ""
    assert doc == [f"{100 * abs(interp[worst]):.1f} %{where}", f"{100 * fit:.1f} %"], (doc, interp)


def test_the_published_all_gather_is_fitted_as_one(tmp_path):
    """Read whole as an all-gather of 16 ranks (from its rows and rank lines); the fit of every other size predicts
    each held-out size >= 1 MiB within 10 %, and its bus bandwidth is the log's ((n-1)/n of algbw, all-gather's)."""
    src = PUBLISHED / f"{ALL_GATHER}.txt"
    assert re.search(r"https://github\.com/\S+", (PUBLISHED / f"{ALL_GATHER}.source.md").read_text())
    ms = read_measurements(src)
    assert ms.coll == "allgather" and ms.ranks == 16 and ms.skipped == 0
    assert len(ms.rows) == len([ln for ln in src.read_text().splitlines() if _is_row(ln)])
    for errors in held_out_errors(ALL_GATHER, tmp_path, "allgather").values():
        errors = {size: e for size, e in errors.items() if size >= MIB}
        assert max(abs(e) for e in errors.values()) < 0.10, errors
    top = max(ms.rows, key=lambda m: m.size)
    pick = cm.FittedModel.from_measurements(ms).pick(top.size, "allgather")
    assert pick.busbw == pytest.approx(pick.algbw * 15 / 16) and pick.busbw == pytest.approx(top.busbw, rel=0.02)
