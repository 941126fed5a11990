"""One reader for nccl-tests' output and the benchmark's: a real, published all_reduce_perf output
(tests/data/nccl_tests_format/, its source beside it), a published all_gather_perf output
(tests/data/nccl_tests_published/), synthetic reduce_scatter_perf and all_gather_perf samples, and
`dtrain.collectives.bench`'s own tables (all-reduce; reduce-scatter and all-gather), run here on 2 gloo ranks, all read
by `dtrain.collectives.costmodel.measurements` and by the column layout nccl-tests' parsers assume."""

import json
import re

import pytest

from dtrain.collectives.costmodel import FittedModel
from dtrain.collectives.costmodel.measurements import read_measurements
from dtrain.common.errors import UserError
from conftest import REPO, launch_ranks

DATA = REPO / "tests" / "data"
REAL = DATA / "nccl_tests_format" / "h100x16_2nodes_roce_nccl2.21.5_all_reduce_perf.txt"
REAL_ALL_GATHER = DATA / "nccl_tests_published" / "h200x8_2node_rdma_all_gather.txt"
SYNTHETIC = {"reducescatter": DATA / "reduce_scatter_perf_synthetic.log",
             "allgather": DATA / "all_gather_perf_synthetic.log"}


def table(text: str) -> list[list[str]]:
    """The data lines as a column parser of nccl-tests' output takes them: every line not starting with `#` whose
    first field is a size, split on blanks."""
    return [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
            and ln.split()[0].isdigit()]


def check_layout(text: str, trimmed: bool = False) -> list[list[str]]:
    """What all_reduce_perf's output (and reduce_scatter_perf's, all_gather_perf's) promises a parser: its heading
    rows, 13 columns a row (size, count, type, redop, root -1, then out-of-place and in-place time/algbw/busbw/#wrong),
    and the two footer lines. `trimmed`: an output stored where trailing blanks were cut (a Markdown page)."""
    lines = text.splitlines()
    heads = [ln for ln in lines if re.match(r"#\s+size\s+count\s+type\s+redop\s+root\s+time", ln)]
    assert heads and heads[0].split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                                          "#wrong", "time", "algbw", "busbw", "#wrong"]
    assert any(ln.split() == ["#", "out-of-place", "in-place"] for ln in lines)
    rows = table(text)
    assert rows and {len(r) for r in rows} == {13} and {r[4] for r in rows} == {"-1"}
    assert re.search(r"^# Out of bounds values : 0 OK$", text, re.M)
    assert re.search(r"^# Avg bus bandwidth    : [0-9.e+-]+" + ("$" if trimmed else " $"), text, re.M)
    return rows


def footer_avg(text: str) -> float:
    return float(re.search(r"^# Avg bus bandwidth\s*:\s*(\S+)", text, re.M).group(1))


def test_real_all_reduce_perf_output():
    text = REAL.read_text()
    rows = check_layout(text)
    ms = read_measurements(REAL)
    assert [m.size for m in ms.rows] == [1 << 30, 2 << 30, 4 << 30, 8 << 30, 16 << 30]
    assert [m.time_us for m in ms.rows] == [4511.2, 8825.9, 17437.0, 34719.0, 69338.0]  # the out-of-place group
    assert ms.rows[0].busbw == 446.28 and ms.rows[-1].algbw == 247.77
    assert ms.ranks == 16 and ms.coll == "allreduce" and ms.skipped == 0
    assert ms.avg_busbw == 458.452
    # nccl-tests' footer is the mean busbw over both column groups of every size: what the benchmark's footer copies
    both = [float(r[7]) for r in rows] + [float(r[11]) for r in rows]
    assert sum(both) / len(both) == pytest.approx(ms.avg_busbw, abs=5e-4)


@pytest.mark.slow
def test_the_benchmark_table_reads_like_all_reduce_perf(tmp_path):
    out = tmp_path / "bench.json"
    cmd = ["-m", "dtrain.collectives.bench", "-b", "1K", "-e", "256K", "-f", "4", "-w", "1", "-n", "3", "--json", str(out)]
    r = launch_ranks(cmd, timeout=120)
    log = tmp_path / "bench.txt"
    log.write_text(r.stdout)
    rows = check_layout(r.stdout)
    ms = read_measurements(log)  # the same reader, the same path through it, as the real output above
    assert [m.size for m in ms.rows] == [1024, 4096, 16384, 65536, 262144]
    assert ms.ranks == 2 and ms.coll == "allreduce" and ms.skipped == 0
    # the rows read are the table's out-of-place group, which the JSON holds unrounded
    oop = {d["size"]: d for d in json.loads(out.read_text()) if d["path"] == "raw" and d["place"] == "out-of-place"}
    for m, cols in zip(ms.rows, rows):
        assert m.time_us == float(cols[5]) == pytest.approx(oop[m.size]["time_us"], rel=0.01, abs=0.01)
        assert m.busbw == pytest.approx(oop[m.size]["busbw"], abs=0.005)
    # the footer is nccl-tests': the mean busbw over both groups of the raw rows (the JSON's), the reducer's apart
    raw = [d["busbw"] for d in json.loads(out.read_text()) if d["path"] == "raw"]
    assert ms.avg_busbw == footer_avg(r.stdout) == pytest.approx(sum(raw) / len(raw), rel=1e-5)
    # the project's own columns (median, iqr, the reducer path) are `#` lines, invisible to that reader
    extra = [ln for ln in r.stdout.splitlines() if " reducer " in ln and "in-place" in ln]
    assert len(extra) == 5 and all(ln.startswith("#") for ln in extra)


def test_benchmark_json_keeps_each_paths_in_place_rows(tmp_path):
    """The JSON holds both groups of the raw path: the fit takes its in-place rows (the collective as training calls
    it), the reducer's as they are; a path measured out of place only keeps those."""
    def row(path, place, size, t):
        return {"path": path, "place": place, "size": size, "count": size // 4, "type": "float", "redop": "sum",
                "time_us": t, "algbw": size / t / 1e3, "busbw": size / t / 1e3, "wrong": 0}

    rows = [row("raw", "out-of-place", s, t) for s, t in ((1024, 21.0), (4096, 24.0))]
    rows += [row("raw", "in-place", s, t) for s, t in ((1024, 11.0), (4096, 14.0))]
    rows += [row("reducer", "in-place", s, t) for s, t in ((1024, 31.0), (4096, 34.0))]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    ms = read_measurements(path)
    assert sorted((m.label, m.size, m.time_us) for m in ms.rows) == [
        ("raw", 1024, 11.0), ("raw", 4096, 14.0), ("reducer", 1024, 31.0), ("reducer", 4096, 34.0)]
    path.write_text(json.dumps([r for r in rows if r["place"] == "out-of-place"]))
    assert [m.time_us for m in read_measurements(path).rows] == [21.0, 24.0]


@pytest.mark.parametrize("coll", sorted(SYNTHETIC))
def test_synthetic_reduce_scatter_and_all_gather_samples(coll, tmp_path):
    """The samples' layout is nccl-tests' and the reader takes their collective from the starting line, with
    nccl-tests' sizes (size = count x 4 B x 8 ranks) and bus factor ((n-1)/n)."""
    text = SYNTHETIC[coll].read_text()
    rows = check_layout(text)
    assert {r[3] for r in rows} == {"none" if coll == "allgather" else "sum"}
    assert all(int(r[0]) == int(r[1]) * 4 * 8 for r in rows)
    ms = read_measurements(SYNTHETIC[coll])
    assert ms.coll == coll and ms.colls == [coll] and ms.ranks == 8 and len(ms.rows) == len(rows) == 21
    assert all(m.coll == coll and m.busbw == pytest.approx(m.algbw * 7 / 8, abs=0.011) for m in ms.rows)
    both = [float(r[7]) for r in rows] + [float(r[11]) for r in rows]
    assert ms.avg_busbw == footer_avg(text) == pytest.approx(sum(both) / len(both), abs=5e-4)
    # Without the starting line (nccl-tests before June 2025) the rows tell: redop none, or size = count x itemsize x ranks
    bare = tmp_path / "bare.log"
    bare.write_text("\n".join(ln for ln in text.splitlines() if "Collective test" not in ln))
    assert read_measurements(bare).coll == coll
    # and an all-reduce's rows (size = count x itemsize) stay an all-reduce's
    bare.write_text((DATA / "all_reduce_perf_synthetic.log").read_text().replace("Collective test", "-"))
    assert read_measurements(bare).coll == "allreduce"


def test_real_all_gather_perf_output():
    """A published all_gather_perf output without the starting line: an all-gather by its rows, 16 ranks by its
    rank lines, every row read from its out-of-place group."""
    text = REAL_ALL_GATHER.read_text()
    rows = check_layout(text, trimmed=True)
    ms = read_measurements(REAL_ALL_GATHER)
    assert ms.coll == "allgather" and ms.ranks == 16 and ms.skipped == 0 and len(ms.rows) == len(rows) == 24
    assert [m.size for m in ms.rows] == [1024 << k for k in range(24)]
    assert [m.time_us for m in ms.rows[-2:]] == [12400.0, 24739.0] and ms.rows[-1].busbw == 325.52
    assert ms.avg_busbw == 121.902


def test_a_log_of_several_tables_and_one_the_cost_model_does_not_model(tmp_path):
    """Tables one after the other in one log (a job script running several programs) each keep their collective;
    a collective the cost model does not model is a one-line error naming it."""
    both = tmp_path / "both.log"
    both.write_text((DATA / "all_reduce_perf_synthetic.log").read_text() + SYNTHETIC["reducescatter"].read_text())
    ms = read_measurements(both)
    assert ms.colls == ["allreduce", "reducescatter"] and ms.coll == "allreduce" and ms.ranks == 8
    assert [m.coll for m in ms.rows] == ["allreduce"] * 28 + ["reducescatter"] * 21
    other = tmp_path / "alltoall.log"
    other.write_text(SYNTHETIC["allgather"].read_text().replace("all_gather_perf", "alltoall_perf"))
    with pytest.raises(UserError, match="measurements of 'alltoall_perf', which the cost model does not model"):
        read_measurements(other)


@pytest.mark.slow
def test_the_benchmarks_reduce_scatter_and_all_gather_tables(tmp_path):
    """One 2-rank run of both collectives: a table each in nccl-tests' layout (size = count x 4 B x 2 ranks, redop
    sum / none, busbw = algbw / 2), no wrong element, the JSON's rows, and the reader taking both tables (printed or
    JSON) apart by collective."""
    out = tmp_path / "bench.json"
    cmd = ["-m", "dtrain.collectives.bench", "-b", "1K", "-e", "64K", "-f", "8", "-w", "1", "-n", "3",
           "--collective", "reduce_scatter,all_gather", "--json", str(out)]
    r = launch_ranks(cmd, timeout=120)
    tables = r.stdout.split("# Collective test starting: ")[1:]
    assert [t.split("\n", 1)[0] for t in tables] == ["reduce_scatter_perf", "all_gather_perf"]
    for table, redop in zip(tables, ("sum", "none")):
        rows = check_layout(table)
        assert [int(f[0]) for f in rows] == [1024, 8192, 65536] and {f[3] for f in rows} == {redop}
        assert all(int(f[0]) == int(f[1]) * 4 * 2 for f in rows)
        assert "# Collective test concluded: " + table.split("\n", 1)[0] in table
    rows = json.loads(out.read_text())
    assert [(d["coll"], d["place"]) for d in rows[:2]] == [("reduce_scatter", "out-of-place"),
                                                           ("reduce_scatter", "in-place")]
    assert {d["coll"] for d in rows} == {"reduce_scatter", "all_gather"} and len(rows) == 12
    for d in rows:
        assert d["wrong"] == 0 and d["path"] == "raw" and d["size"] == d["count"] * 8
        assert d["busbw"] == pytest.approx(d["algbw"] / 2)
    log = tmp_path / "bench.txt"
    log.write_text(r.stdout)
    for path in (log, out):
        ms = read_measurements(path)
        assert ms.colls == ["allgather", "reducescatter"] and ms.ranks == 2 and len(ms.rows) == 6
        fm = FittedModel.from_measurements(ms)
        assert fm.colls == ["allgather", "reducescatter"] and fm.time_us(65536, "reducescatter") > 0
