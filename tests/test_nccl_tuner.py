"""dtrain's NCCL tuner plugin, built with the system C compiler and driven through ctypes as NCCL would drive it:
every exported version (v3-v6), init per communicator with its class in the environment, getCollInfo on a cost
table shaped like NCCL's for several classes and sizes, the disabled-cell rule (logged once), finalize; and a config
file of NCCL's example tuner plugin, read unchanged and applied as that plugin matches it."""

import ctypes
import os
import shutil

import pytest

from dtrain.collectives import config, nccl
from dtrain.collectives.tools import tuner_check
from dtrain.collectives.nccl.settings import COLLECTIVES
from dtrain.collectives.nccl.tuner import read_example_config
from dtrain.common.errors import UserError

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

VERSIONS = (3, 4, 5, 6)
RULES = """\
# class,collective,min_bytes,max_bytes,algorithm,protocol,channels
small,allreduce,0,65536,ring,ll,2
small,allreduce,65537,-1,ring,simple,-1
proto_only,allreduce,0,-1,-1,ll128,-1
algo_only,allreduce,0,-1,tree,-1,6
off,allreduce,0,-1,nvls,simple,4
*,allreduce,0,-1,tree,simple,-1
"""


@pytest.fixture(scope="module")
def lib():
    return nccl.build_tuner()


@pytest.fixture
def rules(tmp_path, monkeypatch):
    path = tmp_path / "rules.csv"
    path.write_text(RULES)
    monkeypatch.setenv("DTRAIN_TUNER_RULES", str(path))
    return path


def comm(h, cls, monkeypatch, nranks=8, nnodes=1):
    """A communicator's plugin context, created while its class is in the environment (as class_group does)."""
    if cls is None:
        monkeypatch.delenv("DTRAIN_TUNER_CLASS", raising=False)
    else:
        monkeypatch.setenv("DTRAIN_TUNER_CLASS", cls)
    ctx = h.init(nranks, nnodes)
    monkeypatch.delenv("DTRAIN_TUNER_CLASS", raising=False)  # restored: only init reads it
    return ctx


def chosen(table):
    return tuner_check.cell_name(min((i for i, t in enumerate(table) if t >= 0), key=lambda i: table[i]))


def f32(table):
    return [ctypes.c_float(t).value for t in table]


def test_every_version_is_exported_with_its_layout(lib):
    for v in VERSIONS:
        h = tuner_check.TunerHarness(lib, v)
        assert h.api.name == b"dtrain"
    assert not tuner_check.TunerHarness(lib, 6).api.getChunkSize  # optional in v6: NULL keeps NCCL's chunk size


@pytest.mark.parametrize("version", VERSIONS)
def test_forced_cells_per_class_and_size(lib, rules, monkeypatch, version):
    h = tuner_check.TunerHarness(lib, version)
    expected = {  # class -> {size: (cell, channels)}; 0 channels = NCCL's count
        "small": {1024: ("Ring/LL", 2), 65536: ("Ring/LL", 2), 65537: ("Ring/Simple", 0), 64 << 20: ("Ring/Simple", 0)},
        "proto_only": {1024: ("*/LL128", 0), 64 << 20: ("*/LL128", 0)},  # *: the cheapest LL128 cell
        "algo_only": {1024: ("Tree/LL", 6), 64 << 20: ("Tree/Simple", 6)},
        "elsewhere": {1024: ("Tree/Simple", 0), 64 << 20: ("Tree/Simple", 0)},  # no rules of its own: `*`
    }
    for cls, sizes in expected.items():
        ctx = comm(h, cls, monkeypatch)
        for n, (cell, channels) in sizes.items():
            before = f32(tuner_check.sample_cost_table(n))
            after, nch, rc = h.get_coll_info(ctx, "allreduce", n, before)
            if cell.startswith("*/"):
                cell = chosen([t if tuner_check.cell_name(i).endswith(cell[1:]) else -1.0 for i, t in enumerate(before)])
            assert rc == 0 and (chosen(after), nch) == (cell, channels), (version, cls, n)
            assert sum(1 for a, b in zip(after, before) if a != b) <= 1  # one cell written, to 0.0
        assert h.finalize(ctx) == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_disabled_cell_keeps_nccls_choice_and_is_logged_once(lib, rules, monkeypatch, version):
    h = tuner_check.TunerHarness(lib, version)
    ctx = comm(h, "off", monkeypatch)
    for n in (1024, 1 << 20, 64 << 20):
        before = f32(tuner_check.sample_cost_table(n))  # NVLS disabled (-1.0), as on a machine without NVLink SHARP
        after, nch, rc = h.get_coll_info(ctx, "allreduce", n, before)
        assert (rc, after, nch) == (0, before, 0)  # table, and channel count, left alone
    notes = [fmt for level, fmt in h.messages if "disabled by NCCL" in fmt]
    assert len(notes) == 1
    h.finalize(ctx)


@pytest.mark.parametrize("version", VERSIONS)
def test_communicators_without_a_class_and_other_collectives_are_left_alone(lib, rules, monkeypatch, version):
    h = tuner_check.TunerHarness(lib, version)
    world = comm(h, None, monkeypatch)
    before = f32(tuner_check.sample_cost_table(1 << 20))
    assert h.get_coll_info(world, "allreduce", 1 << 20, before) == (before, 0, 0)
    small = comm(h, "small", monkeypatch)
    assert h.get_coll_info(small, "broadcast", 1024, before) == (before, 0, 0)  # the rules are allreduce's
    h.finalize(world)
    h.finalize(small)


def test_malformed_or_missing_rules_fail_init(lib, tmp_path, monkeypatch):
    bad = tmp_path / "bad.csv"
    bad.write_text("small,allreduce,0,-1,rign,ll,2\n")
    h = tuner_check.TunerHarness(lib, 6)
    monkeypatch.setenv("DTRAIN_TUNER_RULES", str(bad))
    with pytest.raises(RuntimeError, match="init returned"):
        comm(h, "small", monkeypatch)
    monkeypatch.setenv("DTRAIN_TUNER_RULES", str(tmp_path / "missing.csv"))
    with pytest.raises(RuntimeError, match="init returned"):
        comm(h, "small", monkeypatch)


def test_profile_rules_table_for_every_version():
    cfg = config.load("dtrain/profiles/tuner.yaml")
    rows = tuner_check.tuner_table(*cfg, sizes=(4096, 64 << 20))
    by = {(r["version"], r["class"], r["bytes"]): r for r in rows}
    for v in VERSIONS:
        assert by[v, "embedding", 4096]["chosen"] == "Ring/Simple" and by[v, "embedding", 4096]["channels"] == 16
        assert by[v, "projection", 64 << 20]["chosen"] == "Ring/LL"
        assert by[v, "norm_bias", 64 << 20]["chosen"].endswith("/LL")
        assert by[v, "ffn", 4096]["chosen"].startswith("Tree/")
        assert not by[v, "world", 4096]["forced"] and not by[v, "other", 64 << 20]["forced"]
    text = tuner_check.render_tuner_table(rows)
    assert text.splitlines()[0].split()[:4] == ["class", "bytes", "NCCL's", "pick"]


def test_build_is_cached_by_source_hash(lib):
    assert lib == nccl.tuner_lib_path() and nccl.build_tuner() == lib
    assert os.path.getsize(lib) > 0


# ---- NCCL's example tuner plugin's config, read unchanged ----------------------------------------------------------

# The example plugin's format (NCCL's ext-tuner/example/README.md): 8 fields, or 9 with numPipeOps, or 10 with regBuff.
EXAMPLE = """\
# a user's nccl_tuner.conf for NCCL's example plugin
collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff

allreduce,0,8192,tree,ll,3,1,-1
allreduce,0,8192,ring,ll,5,-1,-1
allreduce,8193,1048576,nvls,simple,4,-1,-1,-1,-1
allreduce,8193,1048576,ring,ll128,-1,-1,8,1,-1
allreduce,8193,1048576,tree,simple,7,-1,-1,-1,-1
allreduce,1048577,4294967295,ring,simple,9,-1,-1,-1,1
allreduce,1048577,-1,tree,ll128,-1,2,16
broadcast,0,-1,ring,ll,2,-1,-1,2
"""


def example_file(tmp_path, text=EXAMPLE, name="nccl_tuner.conf"):
    path = tmp_path / name
    path.write_text(text)
    return path


def expected_by_example(rules, coll, nbytes, nnodes, nranks, pipe_ops, reg_buff, table):
    """What NCCL's example plugin does with its config (its pluginGetCollInfo): the first matching line whose cell
    NCCL has not disabled wins; channels -1 keeps the count. None: no line applies."""
    for r in rules:
        if r.matches(coll, nbytes, nnodes, nranks, pipe_ops, reg_buff):
            cell = NCCL_ALGO_NAMES.index(r.algorithm) * 3 + ("ll", "ll128", "simple").index(r.protocol)
            if table[cell] >= 0:
                return tuner_check.cell_name(cell), 0 if r.channels == -1 else r.channels
    return None


NCCL_ALGO_NAMES = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")


def test_example_config_is_read_as_the_example_plugin_reads_it(tmp_path):
    rules = read_example_config(example_file(tmp_path))
    assert [r.line for r in rules] == [4, 5, 6, 7, 8, 9, 10, 11]  # comments, the heading, blank lines skipped
    first, last = rules[0], rules[-1]
    assert (first.collective, first.min_bytes, first.max_bytes, first.algorithm, first.protocol, first.channels,
            first.n_nodes, first.n_ranks, first.num_pipe_ops, first.reg_buff) == (
        "allreduce", 0, 8192, "tree", "ll", 3, 1, -1, -1, -1)  # 8 fields: numPipeOps and regBuff any
    assert rules[6].max_bytes is None and last.num_pipe_ops == 2 and last.reg_buff == -1
    assert rules[5].reg_buff == 1 and rules[3].n_ranks == 8 and rules[3].num_pipe_ops == 1
    assert first.matches("allreduce", 8192, 1, 8) and not first.matches("allreduce", 8193, 1, 8)
    assert not first.matches("allreduce", 1024, 2, 16) and rules[1].matches("allreduce", 1024, 2, 16)


@pytest.mark.parametrize("line,msg", [
    ("allreduce,0,-1,Tree,ll,2,-1,-1", "unknown algorithm 'Tree'"),  # the example plugin: silently ring
    ("allreduce,0,-1,-1,ll,2,-1,-1", "unknown algorithm '-1'"),
    ("all_reduce,0,-1,ring,ll,2,-1,-1", "unknown collective_type 'all_reduce'"),
    ("allreduce,0,-1,ring,LL,2,-1,-1", "unknown protocol 'LL'"),
    ("allreduce,0,-1,ring,ll,2,-1", "7 fields"),
    ("allreduce,0,-1,ring,ll,2,-1,-1,-1,-1,-1", "11 fields"),
    ("allreduce,0,-1,ring,ll,two,-1,-1", "channels must be"),
    ("allreduce,0,-1,ring,ll,0,-1,-1", "channels must be"),
    ("allreduce,-5,-1,ring,ll,2,-1,-1", "min_bytes must be"),
    ("allreduce,4096,1024,ring,ll,2,-1,-1", "below min_bytes"),
    ("allreduce,0,-1,ring,ll,2,0,-1", "nNodes must be"),
    ("allreduce,0,-1,ring,ll,2,-1,-1,-1,2", "regBuff must be 0, 1 or -1"),
])
def test_bad_example_config_is_one_line_naming_file_and_line(tmp_path, line, msg):
    path = example_file(tmp_path, "# ok so far\nallreduce,0,-1,ring,ll,2,-1,-1\n" + line + "\n")
    with pytest.raises(UserError) as e:
        read_example_config(path)
    text = str(e.value)
    assert text.startswith(f"{path}:3: ") and msg in text and "\n" not in text


def test_missing_example_config_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot read the tuner config .*missing.conf"):
        read_example_config(tmp_path / "missing.conf")


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_applies_an_example_config_as_the_example_plugin(lib, tmp_path, monkeypatch, version):
    path = example_file(tmp_path)
    rules = read_example_config(path)
    monkeypatch.delenv("DTRAIN_TUNER_RULES", raising=False)
    monkeypatch.setenv("NCCL_TUNER_CONFIG_FILE", str(path))
    h = tuner_check.TunerHarness(lib, version)
    seen = set()
    for nranks, nnodes in ((8, 1), (16, 2), (8, 2)):
        ctx = comm(h, None, monkeypatch, nranks, nnodes)  # every communicator, with or without a class
        for coll in ("allreduce", "broadcast", "allgather"):
            for n in (1024, 8192, 8193, 1 << 20, (1 << 20) + 1, 1 << 32, (1 << 32) + 1):
                for pipe_ops in (1, 2):
                    for reg_buff in (0, 1):
                        before = f32(tuner_check.sample_cost_table(n, nranks, nnodes))
                        after, nch, rc = h.get_coll_info(ctx, coll, n, before, pipe_ops, reg_buff)
                        # v3 does not pass regBuff: a line asking for one value cannot match there
                        want = expected_by_example([r for r in rules if version > 3 or r.reg_buff == -1], coll, n,
                                                   nnodes, nranks, pipe_ops, reg_buff, before)
                        got = None if after == before and nch == 0 else (chosen(after), nch)
                        assert rc == 0 and got == want, (version, nranks, nnodes, coll, n, pipe_ops, reg_buff)
                        seen.add(want)
        h.finalize(ctx)
    # the cases above reach each kind of line: node-specific, the nvls line NCCL disabled falling through to the
    # next, rank- and numPipeOps-specific, regBuff-specific (v4+), no bound, another collective, and no line at all
    assert {("Tree/LL", 3), ("Ring/LL", 5), ("Ring/LL128", 0), ("Tree/Simple", 7), ("Tree/LL128", 0),
            ("Ring/LL", 2), None} <= seen
    assert (("Ring/Simple", 9) in seen) == (version > 3)
    assert any("is disabled by NCCL here" in fmt for _, fmt in h.messages)  # the nvls line, logged


def test_class_rules_come_before_the_example_config(lib, tmp_path, monkeypatch):
    dtrain_rules = tmp_path / "rules.csv"
    dtrain_rules.write_text("ffn,allreduce,0,4096,ring,simple,-1\n"
                            "allreduce,0,-1,tree,simple,6,-1,-1\n")  # an example-format line in dtrain's file: all
    monkeypatch.setenv("DTRAIN_TUNER_RULES", str(dtrain_rules))
    monkeypatch.setenv("NCCL_TUNER_CONFIG_FILE", str(example_file(tmp_path)))
    h = tuner_check.TunerHarness(lib, 6)
    ffn, world = comm(h, "ffn", monkeypatch), comm(h, None, monkeypatch)
    call = lambda ctx, n: h.get_coll_info(ctx, "allreduce", n, f32(tuner_check.sample_cost_table(n)))
    after, nch, _ = call(ffn, 1024)
    assert (chosen(after), nch) == ("Ring/Simple", 0)  # the class's own rule first
    after, nch, _ = call(ffn, 8192)
    assert (chosen(after), nch) == ("Tree/Simple", 6)  # then the rules file's example-format line, every class's
    after, nch, _ = call(world, 1024)
    assert (chosen(after), nch) == ("Tree/Simple", 6)  # the world communicator too, before NCCL_TUNER_CONFIG_FILE's
    h.finalize(ffn)
    h.finalize(world)


def test_plugin_refuses_an_example_config_the_check_refuses(lib, tmp_path, monkeypatch):
    bad = example_file(tmp_path, "allreduce,0,-1,Ring,ll,2,-1,-1\n")
    with pytest.raises(UserError, match=r"bad.conf:1: unknown algorithm 'Ring'"):
        read_example_config(bad.rename(tmp_path / "bad.conf"))
    monkeypatch.delenv("DTRAIN_TUNER_RULES", raising=False)
    monkeypatch.setenv("NCCL_TUNER_CONFIG_FILE", str(tmp_path / "bad.conf"))
    h = tuner_check.TunerHarness(lib, 5)
    with pytest.raises(RuntimeError, match="init returned"):
        comm(h, None, monkeypatch)
    assert any("malformed rule" in fmt for _, fmt in h.messages)


def test_the_projects_example_configs_round_trip(lib, tmp_path, monkeypatch):
    """`tuner-config`'s files for the example plugin read back unchanged, and the plugin forces what they ask."""
    cfg = config.load("dtrain/profiles/tuner.yaml")
    path = example_file(tmp_path, nccl.example_tuner_csv(*cfg, "projection", 8, 1, 12, "tuner"))
    rules = read_example_config(path)
    assert {r.collective for r in rules} == set(COLLECTIVES) and all(r.max_bytes is None for r in rules)
    rows = tuner_check.tuner_table(*cfg, sizes=(4096, 64 << 20), versions=(6,), example_config=str(path))
    by = {(r["class"], r["bytes"]): r for r in rows}
    assert by["world", 64 << 20]["chosen"] == "Ring/LL" and by["world", 64 << 20]["channels"] == 12
    with pytest.raises(UserError, match="missing.conf"):
        tuner_check.tuner_table(*cfg, example_config=str(tmp_path / "missing.conf"))
