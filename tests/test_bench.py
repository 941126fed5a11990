"""dtrain.collectives.bench: the sweep's flags, the collectives' sizes, bandwidths, the correctness pass, the table,
and a 2-rank sweep (sizes and the bus-bandwidth factor: tests/test_units.py; the reduce-scatter and all-gather tables
under torchrun: tests/test_nccl_tests_format.py)."""

import json
import warnings

import pytest
import torch
import torch.distributed as dist

from dtrain.collectives import bench
from dtrain.collectives.bench.groups import all_reduce_together
from dtrain.collectives.costmodel.measurements import read_measurements
from conftest import launch_ranks
from dtrain.common.errors import UserError
from dtrain.common.units import bus_factor


# ---- parsing -----------------------------------------------------------------------------------------------------

def test_sweep_sizes_like_nccl_tests():
    assert bench.sweep_sizes(8, 128, 2, 0) == [8, 16, 32, 64, 128]
    assert bench.sweep_sizes(8, 100, 4, 0) == [8, 32]
    assert bench.sweep_sizes(1024, 4096, 2, 1024) == [1024, 2048, 3072, 4096]  # -i wins over -f
    assert bench.sweep_sizes(64, 64, 1, 0) == [64]
    with pytest.raises(UserError):
        bench.sweep_sizes(128, 8, 2, 0)
    with pytest.raises(UserError):
        bench.sweep_sizes(8, 128, 1, 0)


def test_dtypes_and_ops():
    assert bench.parse_dtypes("fp32") == ["float"] and bench.parse_dtypes("bf16") == ["bfloat16"]
    assert bench.parse_dtypes("all") == list(bench.DTYPES)
    with pytest.raises(UserError, match="unknown dtype 'float8'"):
        bench.parse_dtypes("float8")
    assert "avg" not in bench.parse_ops("all", "gloo") and "avg" in bench.parse_ops("all", "nccl")
    with pytest.raises(UserError, match="needs the nccl backend"):
        bench.parse_ops("avg", "gloo")


@pytest.mark.parametrize("argv,msg", [(["-b", "8X"], "bad size '8X'"), (["-d", "float8"], "unknown dtype"),
                                      (["-o", "xor"], "unknown op"), (["-b", "1M", "-e", "1K"], "larger than"),
                                      (["--overlap", "2Q"], "bad size '2Q'"),
                                      (["--overlap", "--path", "raw"], "--overlap measures the reducer path"),
                                      (["-b", "8", "-e", "1K", "-f", "nan"], "-f must be a finite number"),
                                      (["-b", "8", "-e", "1K", "-f", "inf"], "-f must be a finite number"),
                                      (["--json", "/nonexistent/dir/x.json"], "does not exist"),
                                      (["--csv", "."], "is a directory"),
                                      (["--path", "nope"], "argument --path: invalid choice"),
                                      (["--groups", "1"], "--groups must be at least 2"),
                                      (["--groups", "2", "--class", "ffn"], "--groups makes world groups"),
                                      (["--collective", "alltoall"], "unknown collective 'alltoall'"),
                                      (["--collective", "all_gather,all_gather"], "names a collective twice"),
                                      (["--collective", "reduce_scatter", "--path", "reducer"],
                                       "--path reducer: the reducer all-reduces"),
                                      (["--collective", "all_gather", "--overlap"], "add all_reduce to --collective")])
def test_bad_input_is_one_line_and_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dtrain.collectives.bench: error: ") and msg in err and err.count("\n") == 1


def test_collectives_by_name_in_order():
    assert bench.parse_collectives("all_reduce") == [bench.ALL_REDUCE]
    assert bench.parse_collectives("all_gather, reduce_scatter") == [bench.ALL_GATHER, bench.REDUCE_SCATTER]
    assert bench.parse_collectives("all") == [bench.ALL_REDUCE, bench.REDUCE_SCATTER, bench.ALL_GATHER]
    assert [c.program for c in bench.parse_collectives("all")] == ["all_reduce_perf", "reduce_scatter_perf",
                                                                   "all_gather_perf"]
    with pytest.raises(UserError, match="no collective"):
        bench.parse_collectives(",")


# ---- sizes and bandwidths ------------------------------------------------------------------------------------------

def test_count_and_size_as_nccl_tests_prints_them():
    # nccl-tests' GetCollByteCount (src/reduce_scatter.cu, src/all_gather.cu): a rank's share of the requested count,
    # rounded down to 16 bytes; the size column is every rank's share, the count column one rank's.
    for coll in (bench.REDUCE_SCATTER, bench.ALL_GATHER):
        assert coll.count(1 << 20, 4, 8) == (1 << 18) // 8 and coll.size((1 << 18) // 8, 4, 8) == 1 << 20
        assert coll.count(1000, 4, 8) == 28 and coll.size(28, 4, 8) == 896  # 31 floats a rank, down to 28 (112 B)
        assert coll.count(1000, 2, 3) == 160 and coll.count(1000, 1, 3) == 320 and coll.count(1000, 8, 3) == 40
        assert coll.count(64, 4, 8) == 0  # 2 floats a rank: under 16 bytes, nothing to measure
    assert coll.buffers(28, 8) == (28, 224) and bench.REDUCE_SCATTER.buffers(28, 8) == (224, 28)
    # all-reduce: count and size are the requested ones, one buffer in and out
    assert bench.ALL_REDUCE.count(1000, 4, 8) == 250 and bench.ALL_REDUCE.size(250, 4, 8) == 1000
    assert bench.ALL_REDUCE.buffers(250, 8) == (250, 250)


def test_bandwidths_in_gb_per_s():
    algbw, busbw = bench.bandwidths(1_000_000_000, 1_000_000.0, 4)  # 1 GB in one second on 4 ranks
    assert algbw == pytest.approx(1.0) and busbw == pytest.approx(1.5)
    assert bench.bandwidths(8, 0.0, 2) == (0.0, 0.0)
    # reduce-scatter and all-gather: busbw = algbw x (n-1)/n (nccl-tests' doc/PERFORMANCE.md)
    for coll in ("reducescatter", "allgather"):
        assert bench.bandwidths(1_000_000_000, 1_000_000.0, 4, coll) == pytest.approx((1.0, 0.75))


# ---- the correctness pass ----------------------------------------------------------------------------------------

def emulated_allreduce(rank, nranks, op, corrupt=None):
    """Rank `rank`'s view of an all-reduce over `nranks` ranks, the other ranks' inputs rebuilt from the pattern;
    `corrupt(t)` then damages the result, as a broken collective would."""
    def reduce(t):
        others = [torch.empty_like(t) for _ in range(nranks - 1)]
        for r, o in zip([r for r in range(nranks) if r != rank], others):
            bench.fill(o, bench.pattern(r, op, t.dtype))
        stack = torch.stack([t] + others)
        out = {"sum": lambda: stack.sum(0, dtype=t.dtype), "prod": lambda: stack.prod(0, dtype=t.dtype),
               "max": lambda: stack.amax(0), "min": lambda: stack.amin(0)}[op]()
        t.copy_(out)
        if corrupt:
            corrupt(t)
        return t

    return reduce


@pytest.mark.parametrize("dtype", list(bench.DTYPES))
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_correct_result_has_no_wrong_elements(dtype, op):
    dt = bench.DTYPES[dtype]
    assert bench.check(emulated_allreduce(1, 3, op), 1000, dt, op, 1, 3, "cpu") == 0


def test_check_catches_a_deliberately_wrong_result():
    def one_off(t):
        t[123] += 1

    def shifted(t):  # a chunk landing one element off: its values differ, so every element of it counts
        t[500:600] = t[501:601].clone()

    def stale(t):  # one rank's contribution missing from a slice
        t[:10] -= bench.pattern(0, "sum", t.dtype)[:10]

    for corrupt, wrong in [(one_off, 1), (shifted, 100), (stale, 10)]:
        assert bench.check(emulated_allreduce(1, 2, "sum", corrupt), 1000, torch.float32, "sum", 1, 2, "cpu") == wrong


def emulated_reduce_scatter(rank, nranks, op, corrupt=None):
    """Rank `rank`'s view of a reduce-scatter over `nranks` ranks: its share of the reduction of every rank's input,
    the other ranks' inputs rebuilt as the correctness pass fills them; `corrupt(out)` damages the result."""
    def run(t):
        count = t.numel() // nranks
        inputs = []
        for r in range(nranks):
            x = torch.empty_like(t)
            for c, share in enumerate(x.view(nranks, count)):
                bench.fill(share, bench.pattern(r, op, t.dtype), start=c)
            inputs.append(x)
        stack = torch.stack(inputs)
        full = {"sum": lambda: stack.sum(0, dtype=t.dtype), "max": lambda: stack.amax(0),
                "prod": lambda: stack.prod(0, dtype=t.dtype)}[op]()
        out = full.view(nranks, count)[rank].clone()
        if corrupt:
            corrupt(out, full.view(nranks, count))
        return out

    return run


def emulated_all_gather(rank, nranks, corrupt=None):
    """Rank `rank`'s view of an all-gather: every rank's input, as the correctness pass fills them, in rank order."""
    def run(t):
        shares = [t.clone() if r == rank else torch.empty_like(t) for r in range(nranks)]
        for r, x in enumerate(shares):
            if r != rank:
                bench.fill(x, bench.pattern(r, "sum", t.dtype), start=r)
        out = torch.cat(shares)
        if corrupt:
            corrupt(out.view(nranks, -1))
        return out

    return run


@pytest.mark.parametrize("dtype", ["float", "bfloat16", "int8", "double"])
def test_reduce_scatter_and_all_gather_results_have_no_wrong_elements(dtype):
    dt = bench.DTYPES[dtype]
    for op in ("sum", "prod", "max"):
        assert bench.check(emulated_reduce_scatter(2, 4, op), 600, dt, op, 2, 4, "cpu",
                           collective="reduce_scatter") == 0
    assert bench.check(emulated_all_gather(1, 3), 600, dt, "none", 1, 3, "cpu", collective="all_gather") == 0


def test_check_catches_a_wrong_reduce_scatter_or_all_gather():
    def one_off(out, *_):
        out.view(-1)[17] += 1

    def share(k):  # this rank handed share k of the reduction instead of its own
        return lambda out, shares: out.copy_(shares[k])

    def rs(rank, corrupt):
        return bench.check(emulated_reduce_scatter(rank, 4, "sum", corrupt), 771, torch.float32, "sum", rank, 4,
                           "cpu", collective="reduce_scatter")

    assert rs(2, one_off) == 1
    assert rs(2, share(1)) == 771  # a phase one step off: the 1..3 cycle of every element shifted
    # three steps off: the 1..3 cycle matches again, the period's restart (a prime length) does not
    assert 0 < rs(3, share(0)) < 771

    def swap(j, k):  # ranks j and k gathered into each other's place
        def corrupt(shares):
            shares[[j, k]] = shares[[k, j]].clone()
        return corrupt

    def stale(shares):  # rank 1's share never arrived: the output's zeros there
        shares[1].zero_()

    def ag(corrupt):
        return bench.check(emulated_all_gather(0, 4, corrupt), 771, torch.float32, "none", 0, 4, "cpu",
                           collective="all_gather")

    assert ag(stale) == 771 and ag(swap(0, 1)) > 771 and ag(swap(0, 3)) > 0


def test_check_against_the_mean():
    def mean(t):
        t.copy_((t + bench.pattern(1, "sum", t.dtype).repeat(4)[: t.numel()]) / 2)
        return t

    assert bench.check(mean, 1000, torch.bfloat16, "sum", 0, 2, "cpu", expect_op="avg") == 0
    assert bench.check(lambda t: t, 1000, torch.bfloat16, "sum", 0, 2, "cpu", expect_op="avg") > 0


@pytest.fixture
def one_rank_group():
    """A real (one-rank) gloo group in this process, so `measure` runs end to end."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Args:
    warmup, iters, check = 1, 3, 1


def test_measure_reports_wrong_elements_of_a_broken_path(one_rank_group):
    raw = bench.raw_path(None)
    row = bench.measure(raw, 4096, "float", "sum", _Args, None, 1, 0, torch.device("cpu"))
    assert row.wrong == 0 and row.size == 16384 and row.count == 4096 and row.time_us > 0

    def broken_bind(t, op):
        def fn():
            dist.all_reduce(t, group=None)
            t[7] += 1
        return fn, (lambda: t)

    broken = bench.BenchPath("raw", "broken", broken_bind)
    assert bench.measure(broken, 4096, "float", "sum", _Args, None, 1, 0, torch.device("cpu")).wrong == 1


@pytest.mark.parametrize("coll", ["reduce_scatter", "all_gather"])
def test_reduce_scatter_and_all_gather_paths_measure_and_check(one_rank_group, coll):
    c = bench.COLLECTIVES[coll]
    raw = bench.bench_paths("all", None, None, None, c)
    assert [(p.name, p.place, p.collective) for p in raw] == [("raw", "out-of-place", c), ("raw", "in-place", c)]
    for path in raw:
        op = "sum" if c.reduces else "none"
        row = bench.measure(path, 4096, "bfloat16", op, _Args, None, 1, 0, torch.device("cpu"))
        assert (row.coll, row.wrong, row.size, row.count, row.redop, row.place) == (coll, 0, 8192, 4096, op,
                                                                                     path.place)
    # no deprecated call (torch 2.13 warns of reduce_scatter_tensor and all_gather_into_tensor on every call)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path in raw:
            path.bind(torch.zeros(8), op)[0]()


def test_in_place_paths_use_the_ranks_own_share(one_rank_group):
    """In place, the reduce-scatter's output is the rank's share of its input (nccl-tests' recvbuff + rank x count)
    and the all-gather's input the rank's share of its output (the input copied there when bound)."""
    t = torch.arange(6, dtype=torch.float32)
    fn, result = bench.raw_reduce_scatter(None, "in-place").bind(t, "sum")
    fn()
    assert result().data_ptr() == t.data_ptr() and torch.equal(result(), torch.arange(6.0))
    fn, result = bench.raw_all_gather(None, "in-place").bind(t, "none")
    fn()
    assert result().data_ptr() != t.data_ptr() and torch.equal(result(), t)


def test_reducer_path_averages_correctly(one_rank_group):
    pytest.importorskip("dtrain.collectives.reducer", reason="dtrain/collectives/reducer.py is not in this checkout")
    path = bench.reducer_path(None, None, None)
    row = bench.measure(path, 1 << 16, "bfloat16", "sum", _Args, None, 1, 0, torch.device("cpu"))
    assert row.path == "reducer" and row.wrong == 0
    assert not path.can("sum", "int32") and not path.can("max", "float")


def test_reducer_path_cuts_the_size_into_capped_buckets(one_rank_group, monkeypatch):
    pytest.importorskip("dtrain.collectives.reducer", reason="dtrain/collectives/reducer.py is not in this checkout")
    from dtrain.collectives.settings import ClassSettings

    path = bench.reducer_path(None, "ffn", ClassSettings(bucket_cap_mb=0.01))  # 2621 fp32 elements a bucket
    t = torch.arange(10000, dtype=torch.float32)
    step, result = path.bind(t.clone(), "sum")
    sizes, real = [], dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda x, *a, **k: (sizes.append(x.numel()), real(x, *a, **k))[1])
    step()
    monkeypatch.undo()
    assert sizes == [2621, 2621, 2621, 2137]  # one collective per bucket, in order
    assert torch.equal(result(), t)  # the mean over one rank, gathered back from the buckets in order
    assert bench.check(lambda x: bench.run_bound(path.bind(x, "sum")), 10000, torch.float32, "sum", 0, 1, "cpu",
                       "avg") == 0


# ---- the table ---------------------------------------------------------------------------------------------------

def test_table_has_nccl_tests_columns_and_footer():
    def row(path, place, t):
        return bench.Row(path, 4 << 20, 1 << 20, "float", "sum", t, *bench.bandwidths(4 << 20, t, 2), 0, place=place)

    rows = [row("raw", "out-of-place", 2000.0), row("raw", "in-place", 1900.0), row("reducer", "in-place", 2100.0)]
    head = bench.header()
    # all_reduce_perf's heading rows, character for character (nccl-tests' src/common.cu formats)
    assert head[0] == "#" + " " * 62 + "out-of-place" + " " * 23 + "in-place" + " " * 10
    assert head[1] == ("#       size         count      type   redop    root     time   algbw   busbw #wrong     "
                       "time   algbw   busbw #wrong")
    assert head[2] == ("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            "
                       "(us)  (GB/s)  (GB/s)       ")
    text = bench.line(rows[0], rows[1])
    assert text == ("     4194304       1048576     float     sum      -1   2000.0    2.10    2.10      0   "
                    "1900.0    2.21    2.21      0")
    fields = text.split()
    assert fields[:5] == [str(4 << 20), str(1 << 20), "float", "sum", "-1"]  # root -1: an all-reduce has none
    foot = bench.footer(rows)
    assert foot[0] == "# Out of bounds values : 0 OK"
    # the mean over both column groups of the table's (raw) rows, as nccl-tests averages it; the reducer's is apart
    assert foot[1] == f"# Avg bus bandwidth    : {(rows[0].busbw + rows[1].busbw) / 2:g} " and foot[2] == "#"
    extra = bench.extra_lines(rows)
    assert all(ln.startswith("#") for ln in extra)  # the project's columns: comments to nccl-tests' parsers
    assert any("reducer" in ln and "in-place" in ln for ln in extra)
    assert any("reducer/raw busbw at >= 4 MiB : min 0.905" in ln for ln in extra)  # against the raw in-place row
    rows[0].wrong = 2
    assert bench.footer(rows)[0] == "# Out of bounds values : 2 FAILED"
    rows[2].wrong = 5  # the reducer's wrong elements are reported in its own comment, not in nccl-tests' footer
    assert bench.footer(rows)[0] == "# Out of bounds values : 2 FAILED"
    assert any("out of bounds values 5 FAILED" in ln for ln in bench.extra_lines(rows))
    assert bench.line(None, rows[1]).split()[5:9] == ["N/A"] * 4
    rows[1].wrong = None  # -c 0: not checked
    assert bench.line(rows[0], rows[1]).split()[-1] == "N/A"


def test_reduce_scatter_and_all_gather_lines_are_nccl_tests():
    """reduce_scatter_perf's and all_gather_perf's lines: size is every rank's share, count one rank's; redop the op,
    or none for all-gather; root -1; busbw = algbw x (n-1)/n; the footer names the program that concluded."""
    def row(coll, place, t):
        c = bench.COLLECTIVES[coll]
        size = c.size(1 << 18, 4, 4)
        return bench.Row("raw", size, 1 << 18, "float", "sum" if c.reduces else "none", t,
                         *bench.bandwidths(size, t, 4, c.coll), 0, place=place, coll=coll)

    rs = [row("reduce_scatter", "out-of-place", 4000.0), row("reduce_scatter", "in-place", 4100.0)]
    assert bench.line(*rs) == ("     4194304        262144     float     sum      -1   4000.0    1.05    0.79      0   "
                               "4100.0    1.02    0.77      0")
    ag = [row("all_gather", "out-of-place", 2000.0), row("all_gather", "in-place", 2000.0)]
    assert bench.line(*ag).split()[:5] == ["4194304", "262144", "float", "none", "-1"]
    foot = bench.footer(ag, "all_gather_perf")
    assert foot[1] == f"# Avg bus bandwidth    : {ag[0].busbw:g} " and foot[2:] == [
        "#", "# Collective test concluded: all_gather_perf"]


def test_out_of_place_keeps_its_input(one_rank_group):
    oop = bench.raw_path(None, "out-of-place")
    t = torch.arange(8, dtype=torch.float32)
    fn, result = oop.bind(t, "sum")
    fn()
    assert result() is not t and torch.equal(result(), t) and oop.place == "out-of-place"
    row = bench.measure(oop, 4096, "float", "sum", _Args, None, 1, 0, torch.device("cpu"))
    assert row.wrong == 0 and row.place == "out-of-place" and row.path == "raw"
    assert [(p.name, p.place) for p in bench.bench_paths("all", None, None, None)] == [
        ("raw", "out-of-place"), ("raw", "in-place"), ("reducer", "in-place")]


# ---- 2 ranks under torchrun --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_rank_sweep_on_loopback(tmp_path):
    out = tmp_path / "bench.json"
    cmd = ["-m", "dtrain.collectives.bench", "-b", "8", "-e", "1M", "-f", "32", "-w", "1", "-n", "3", "--class", "ffn",
           "--json", str(out), "--csv", str(tmp_path / "bench.csv"), "--overlap", "256"]
    r = launch_ranks(cmd, timeout=120)
    assert "nRanks 2 backend gloo" in r.stdout and "group: class ffn" in r.stdout
    assert "# nThread 1 nGpus 1 minBytes 8 maxBytes 1048576 step: 32(factor)" in r.stdout
    assert "# Out of bounds values : 0 OK" in r.stdout and "# Avg bus bandwidth    : " in r.stdout
    assert sum(1 for ln in r.stdout.splitlines() if ln.startswith("#  Rank ")) == 2
    rows = json.loads(out.read_text())
    assert {tuple(sorted(row)) for row in rows} == {tuple(sorted(bench.FIELDS))}
    for place in ("out-of-place", "in-place"):
        raw = [row for row in rows if row["path"] == "raw" and row["place"] == place]
        assert [row["size"] for row in raw] == [8, 256, 8192, 262144]
    # the table's data lines: the raw path's two column groups per size, in all_reduce_perf's 13 columns
    data = [ln.split() for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert [int(f[0]) for f in data] == [8, 256, 8192, 262144] and {len(f) for f in data} == {13}
    assert {f[4] for f in data} == {"-1"}
    for row in rows:
        assert row["wrong"] == 0 and row["type"] == "float" and row["redop"] == "sum"
        assert row["count"] * 4 == row["size"]
        assert row["busbw"] == pytest.approx(row["algbw"] * bus_factor("allreduce", 2))  # = algbw on 2 ranks
        assert row["algbw"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
        assert row["cpu_us"] > 0  # the process's CPU time per operation, gloo's threads included
        assert row["median_us"] > 0 and row["iqr_us"] >= 0  # on CPU every operation is timed on its own too
        # --overlap 256: the computation lost per all-reduce, measured for the reducer's rows up to 256 B only
        assert (row["host_us"] is not None) == (row["path"] == "reducer" and row["size"] <= 256)
    assert "# overlap: 16 reducer all-reduces launched during a matmul block" in r.stdout
    csv_lines = (tmp_path / "bench.csv").read_text().splitlines()
    assert csv_lines[0] == ",".join(bench.FIELDS) and len(csv_lines) == len(rows) + 1


@pytest.mark.slow
def test_groups_time_several_process_groups_at_once(tmp_path):
    out = tmp_path / "bench.json"
    cmd = ["-m", "dtrain.collectives.bench", "-b", "64K", "-e", "256K", "-f", "4", "-w", "1", "-n", "2", "--path", "raw",
           "--groups", "3", "--json", str(out)]
    r = launch_ranks(cmd, timeout=120)
    rows = json.loads(out.read_text())
    together = [row for row in rows if row["path"] == "groups"]
    # k = 1, 2, 3 groups, each all-reducing the sweep's largest size; the others are the sweep's rows
    assert [row["groups"] for row in together] == [1, 2, 3]
    assert {row["size"] for row in together} == {256 << 10}
    assert all(row["groups"] is None for row in rows if row["path"] != "groups")
    for row in together:
        assert row["time_us"] > 0 and row["algbw"] == pytest.approx(row["groups"] * row["size"] / row["time_us"] / 1e3)
    assert "# groups: k process groups, each all-reducing 262144 B of float at once" in r.stdout
    # read back as measurements: the sweep's rows fitted, the groups' rows the link's share per count
    ms = read_measurements(out)
    assert {m.size for m in ms.rows} == {64 << 10, 256 << 10} and set(ms.link_efficiency) == {1, 2, 3}
    assert ms.link_efficiency[1] == 1.0


def test_all_reduce_together_launches_at_the_given_offsets(one_rank_group):
    """`benchmarks/group_layouts.py --offsets`: the second all-reduce goes 50 ms after the first, the rank computing
    meanwhile, and the time runs from the first launch to the last completion; each sum is still right."""
    tensors = [torch.ones(1000), torch.full((10,), 2.0)]
    seconds = all_reduce_together(tensors, [None, None], torch.randn(256, 256), offsets=[0.0, 0.05])
    assert seconds >= 0.05
    assert torch.equal(tensors[0], torch.ones(1000)) and torch.equal(tensors[1], torch.full((10,), 2.0))
