"""dtrain nccl parse-log: NCCL's TUNING lines in both formats (2.21-2.23 numeric, >= 2.24 named) and its ENV
lines, read from constructed samples in tests/data/nccl, joined to a bucket plan; buckets off their requested choice
are listed and make the command exit 1. And the init table of a log recorded on an H200."""

import json
from pathlib import Path

import pytest

from dtrain.collectives import config, nccl
from dtrain.collectives.tools.nccl import main
from dtrain.collectives.settings import ClassSettings
from dtrain.common.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "nccl"


def read(name):
    return nccl.parse_log((DATA / name).read_text().splitlines())


def wanted():
    sync, coll = config.load(REPO / "dtrain" / "profiles" / "per_group.yaml")
    return {n: nccl.resolve(sync, coll, n) for n in nccl.class_names(sync)}


def test_named_format_lines():
    decisions, envs = read("per_group_2.24.log")
    first = decisions[0]
    assert (first.source, first.collective, first.nbytes, first.algo, first.proto, first.channels) == (
        "gpu0:4711", "allreduce", 4, "Ring", "LL", 1)
    assert nccl.Decision(20, "gpu0:4711", "allreduce", 1048576, "Ring", "LL", 2) in decisions
    assert any(d.collective == "broadcast" for d in decisions)
    assert [(e.var, e.value) for e in envs if e.var in ("NCCL_PROTO", "NCCL_ALGO")][:2] == [
        ("NCCL_PROTO", "allreduce:Simple"), ("NCCL_ALGO", "allreduce:Ring")]
    assert ("NCCL_IB_DISABLE", "1") in [(e.var, e.value) for e in envs]


def test_numeric_format_lines_and_unprefixed_lines():
    decisions, _ = read("per_group_2.21.log")
    assert {(d.nbytes, d.algo, d.proto, d.collective, d.channels) for d in decisions} >= {
        (8388608, "Ring", "Simple", None, None), (2097152, "Tree", "LL128", None, None)}
    bare, _ = nccl.parse_log(["AllReduce: 1048576 Bytes -> Algo NVLS_TREE proto SIMPLE channel{Lo..Hi}={0..15}",
                              "512 Bytes -> Algo 6 proto 2 time 3.5", "NCCL INFO Init COMPLETE"])
    assert [(d.algo, d.proto, d.channels) for d in bare] == [("NVLSTree", "Simple", 16), ("PAT", "Simple", None)]


def test_every_bucket_on_its_requested_choice():
    buckets = nccl.load_buckets(DATA / "buckets.jsonl")
    assert len(buckets) == 4  # one per bucket index, whatever the number of steps
    for log in ("per_group_2.24.log", "per_group_2.21.log"):
        table, mismatches = nccl.check_decisions(read(log)[0], buckets, wanted())
        assert mismatches == []
        rows = {r["communicator"]: r for r in table if r["communicator"] != "(no bucket)"}
        assert (rows["embedding"]["algorithm"], rows["embedding"]["protocol"]) == ("Ring", "Simple")
        assert (rows["projection"]["algorithm"], rows["projection"]["protocol"]) == ("Ring", "LL")


def test_a_bucket_off_its_choice_is_listed():
    table, mismatches = nccl.check_decisions(read("per_group_mismatch_2.24.log")[0],
                                             nccl.load_buckets(DATA / "buckets.jsonl"), wanted())
    assert [(m["index"], m["class"], m["observed"]) for m in mismatches] == [(2, "embedding", "Ring/LL128")]
    text = nccl.render_check(table, mismatches)
    assert ("bucket 2 (embedding, 8388608 B): requested protocol Simple, algorithm Ring, max_ctas 16, observed Ring/LL128"
            in text)


def test_same_size_in_two_classes_and_unseen_buckets():
    buckets = [{"index": 0, "class": "a", "nbytes": 4096}, {"index": 1, "class": "b", "nbytes": 4096},
               {"index": 2, "class": "c", "nbytes": 8192}]
    want = {"a": ClassSettings(protocol="LL"), "b": ClassSettings(protocol="Simple"), "c": ClassSettings()}
    ok = [nccl.Decision(1, "-", "allreduce", 4096, "Ring", "LL", 1),
          nccl.Decision(2, "-", "allreduce", 4096, "Ring", "Simple", 1),
          nccl.Decision(3, "-", "allreduce", 8192, "Tree", "LL", 1)]
    table, mismatches = nccl.check_decisions(ok, buckets, want)
    assert mismatches == [] and {r["communicator"] for r in table} == {"a|b", "c"}
    stray = ok + [nccl.Decision(4, "-", "allreduce", 4096, "Ring", "LL128", 1)]
    assert [m["index"] for m in nccl.check_decisions(stray, buckets, want)[1]] == [0, 1]
    unseen = nccl.check_decisions(ok[:2], buckets, want)[1]
    assert [(m["index"], m["observed"]) for m in unseen] == [(2, "no TUNING line of this size")]


def run_cli(capsys, *args):
    try:
        code = main(["parse-log", *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exit_codes(capsys):
    common = ["--profile", "dtrain/profiles/per_group.yaml", "--buckets", str(DATA / "buckets.jsonl")]
    code, out, _ = run_cli(capsys, str(DATA / "per_group_2.24.log"), *common)
    assert code == 0 and "every bucket on its requested choice" in out and "communicator  collective" in out
    code, out, _ = run_cli(capsys, str(DATA / "per_group_mismatch_2.24.log"), *common)
    assert code == 1 and "1 bucket(s) not on the requested choice" in out
    code, _, err = run_cli(capsys, str(DATA / "nope.log"))
    assert code == 2 and err.startswith("dtrain nccl: error: ") and err.count("\n") == 1


def test_verify_run_writes_its_check(tmp_path):
    cfg = config.load(REPO / "dtrain" / "profiles" / "per_group.yaml", ["collectives.parse_log=true"])
    run, logs = tmp_path / "run", tmp_path / "logs"
    run.mkdir()
    logs.mkdir()
    (run / "buckets.jsonl").write_text((DATA / "buckets.jsonl").read_text())
    (logs / "nccl.gpu0.4711.log").write_text((DATA / "per_group_mismatch_2.24.log").read_text())
    result = nccl.verify_run(*cfg, run, logs)
    assert result["decisions"] == 16 and [m["class"] for m in result["mismatches"]] == ["embedding"]
    assert "observed Ring/LL128" in (run / "nccl_check.txt").read_text()
    assert json.dumps(result)  # fit for a run summary


def recorded_run(tmp_path):
    """A run directory as the trainer leaves it: rank 0's NCCL log (ENV and TUNING lines recorded on an H200, NCCL
    2.28.9, two ranks as two NCCL hosts, dtrain/profiles/per_group.yaml with the projections on Simple) and the bucket plan
    of its first step."""
    (tmp_path / "nccl-logs").mkdir()
    (tmp_path / "nccl-logs" / "nccl.vm.516.log").write_text((DATA / "h200_per_class_2.28.9.log").read_text())
    (tmp_path / "buckets.jsonl").write_text((DATA / "h200_per_class_buckets.jsonl").read_text())
    return tmp_path


def test_a_recorded_h200_run_is_on_its_requested_choices(tmp_path):
    nccl.reset()  # no applied plan in this process: the logs are found in <run>/nccl-logs
    cfg = config.load(REPO / "dtrain" / "profiles" / "per_group.yaml",
                      ["collectives.parse_log=true", "sync.classes.projection.protocol=Simple"])
    result = nccl.verify_run(*cfg, recorded_run(tmp_path))
    assert result["mismatches"] == [] and result["decisions"] > 78
    text = (tmp_path / "nccl_check.txt").read_text()
    assert "every bucket on its requested choice" in text
    assert "NCCL_PROTO=allreduce:LL" in text and "NCCL_HOSTID=rank0" in text  # the ENV lines NCCL honoured
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("embedding", "norm_bias"))}
    assert rows["embedding"][2:5] == ["16384000", "Ring", "Simple"] and rows["norm_bias"][2:5] == ["393216", "Ring", "LL"]


def test_the_same_log_against_the_profile_that_asked_for_LL_lists_every_projection_bucket(tmp_path):
    nccl.reset()
    cfg = config.load(REPO / "dtrain" / "profiles" / "per_group.yaml", ["collectives.parse_log=true"])  # projection: LL
    result = nccl.verify_run(*cfg, recorded_run(tmp_path))
    assert len(result["mismatches"]) == 72 and {m["class"] for m in result["mismatches"]} == {"projection"}
    assert "72 bucket(s) not on the requested choice" in (tmp_path / "nccl_check.txt").read_text()


def test_no_check_without_parse_log_or_logs(tmp_path):
    nccl.reset()
    cfg = config.load(REPO / "dtrain" / "profiles" / "per_group.yaml")
    assert nccl.verify_run(*cfg, recorded_run(tmp_path)) is None  # parse_log off
    cfg = config.load(REPO / "dtrain" / "profiles" / "per_group.yaml", ["collectives.parse_log=true"])
    assert nccl.verify_run(*cfg, tmp_path / "elsewhere") is None and not (tmp_path / "elsewhere").exists()


def test_damaged_bucket_records_are_named_errors(tmp_path):
    p = tmp_path / "buckets.jsonl"
    p.write_text('{"bucket": 0, "class": "ffn", "bytes": 64}\n{"bucket": 1,, }\n{"bucket": 2}\n')
    with pytest.raises(UserError, match=r"buckets.jsonl:2: not a JSON record"):
        nccl.load_buckets(p)
    p.write_text('{"bucket": 0, "class": "ffn", "bytes": "64"}\n')
    with pytest.raises(UserError, match="not a byte count"):
        nccl.load_buckets(p)
    p.write_text('[1, 2]')
    with pytest.raises(UserError, match="not a JSON object"):
        nccl.load_buckets(p)


def test_the_init_table_of_the_first_communicator():
    table = nccl.parse_init_table((DATA / "h200_per_class_2.28.9.log").read_text().splitlines(), "h200.log")
    assert table.source == "vm:516:516" and table.ranks is None
    # The first communicator's table, not a later one restricted by its class's NCCL_PROTO (Tree/LL 0.2 there).
    assert table.cells["allreduce", "Tree", "LL"] == (16.8, 0.2)
    assert table.cells["allreduce", "Ring", "Simple"] == (36.4, 1.2)
    assert table.cells["allgather", "PAT", "Simple"] == (17.6, 1.8)  # the last block of algorithms
    assert {k[0] for k in table.cells} == set(nccl.COLLECTIVES)
    assert nccl.parse_init_table(["node:1:1 [0] NCCL INFO Init COMPLETE"], "x") is None
    lines = ["node:1:1 [0] NCCL INFO comm 0xab rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0",
             "node:1:1 [0] NCCL INFO   Algorithm   |    Tree |    Ring |",
             "node:1:1 [0] NCCL INFO   Protocol    | LL | LL128 | Simple | LL | LL128 | Simple |",
             "node:2:2 [0] NCCL INFO     AllReduce |  9.9/ 9.9 |  9.9/ 9.9 |  9.9/ 9.9 |",  # another process
             "node:1:1 [0] NCCL INFO     AllReduce |  6.8/ 1.0 | 14.0/ 2.0 |  8.4/ 3.0 |  6.6/ 4.0 |"]
    small = nccl.parse_init_table(lines, "x")
    assert small.ranks == 16 and small.cells["allreduce", "Ring", "LL"] == (6.6, 4.0) and len(small.cells) == 4
    with pytest.raises(UserError, match="x: NCCL tuning table cell '6.8/' in row AllReduce"):
        nccl.parse_init_table(lines[:2] + ["node:1:1 [0] NCCL INFO     AllReduce |  6.8/ |"], "x")
