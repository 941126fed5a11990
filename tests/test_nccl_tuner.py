"""dtrain's NCCL tuner plugin, built with the system C compiler and driven through ctypes as NCCL would drive it:
every exported version (v3-v6), init per communicator with its class in the environment, getCollInfo on a cost
table shaped like NCCL's for several classes and sizes, the disabled-cell rule (logged once), finalize."""

import ctypes
import os
import shutil

import pytest

from collectives import config, nccl

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
    return nccl.cell_name(min((i for i, t in enumerate(table) if t >= 0), key=lambda i: table[i]))


def f32(table):
    return [ctypes.c_float(t).value for t in table]


def test_every_version_is_exported_with_its_layout(lib):
    for v in VERSIONS:
        h = nccl.TunerHarness(lib, v)
        assert h.api.name == b"dtrain"
    assert not nccl.TunerHarness(lib, 6).api.getChunkSize  # optional in v6: NULL keeps NCCL's chunk size


@pytest.mark.parametrize("version", VERSIONS)
def test_forced_cells_per_class_and_size(lib, rules, monkeypatch, version):
    h = nccl.TunerHarness(lib, version)
    expected = {  # class -> {size: (cell, channels)}; 0 channels = NCCL's count
        "small": {1024: ("Ring/LL", 2), 65536: ("Ring/LL", 2), 65537: ("Ring/Simple", 0), 64 << 20: ("Ring/Simple", 0)},
        "proto_only": {1024: ("*/LL128", 0), 64 << 20: ("*/LL128", 0)},  # *: the cheapest LL128 cell
        "algo_only": {1024: ("Tree/LL", 6), 64 << 20: ("Tree/Simple", 6)},
        "elsewhere": {1024: ("Tree/Simple", 0), 64 << 20: ("Tree/Simple", 0)},  # no rules of its own: `*`
    }
    for cls, sizes in expected.items():
        ctx = comm(h, cls, monkeypatch)
        for n, (cell, channels) in sizes.items():
            before = f32(nccl.sample_cost_table(n))
            after, nch, rc = h.get_coll_info(ctx, "allreduce", n, before)
            if cell.startswith("*/"):
                cell = chosen([t if nccl.cell_name(i).endswith(cell[1:]) else -1.0 for i, t in enumerate(before)])
            assert rc == 0 and (chosen(after), nch) == (cell, channels), (version, cls, n)
            assert sum(1 for a, b in zip(after, before) if a != b) <= 1  # one cell written, to 0.0
        assert h.finalize(ctx) == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_disabled_cell_keeps_nccls_choice_and_is_logged_once(lib, rules, monkeypatch, version):
    h = nccl.TunerHarness(lib, version)
    ctx = comm(h, "off", monkeypatch)
    for n in (1024, 1 << 20, 64 << 20):
        before = f32(nccl.sample_cost_table(n))  # NVLS disabled (-1.0), as on a machine without NVLink SHARP
        after, nch, rc = h.get_coll_info(ctx, "allreduce", n, before)
        assert (rc, after, nch) == (0, before, 0)  # table, and channel count, left alone
    notes = [fmt for level, fmt in h.messages if "disabled by NCCL" in fmt]
    assert len(notes) == 1
    h.finalize(ctx)


@pytest.mark.parametrize("version", VERSIONS)
def test_communicators_without_a_class_and_other_collectives_are_left_alone(lib, rules, monkeypatch, version):
    h = nccl.TunerHarness(lib, version)
    world = comm(h, None, monkeypatch)
    before = f32(nccl.sample_cost_table(1 << 20))
    assert h.get_coll_info(world, "allreduce", 1 << 20, before) == (before, 0, 0)
    small = comm(h, "small", monkeypatch)
    assert h.get_coll_info(small, "broadcast", 1024, before) == (before, 0, 0)  # the rules are allreduce's
    h.finalize(world)
    h.finalize(small)


def test_malformed_or_missing_rules_fail_init(lib, tmp_path, monkeypatch):
    bad = tmp_path / "bad.csv"
    bad.write_text("small,allreduce,0,-1,rign,ll,2\n")
    h = nccl.TunerHarness(lib, 6)
    monkeypatch.setenv("DTRAIN_TUNER_RULES", str(bad))
    with pytest.raises(RuntimeError, match="init returned"):
        comm(h, "small", monkeypatch)
    monkeypatch.setenv("DTRAIN_TUNER_RULES", str(tmp_path / "missing.csv"))
    with pytest.raises(RuntimeError, match="init returned"):
        comm(h, "small", monkeypatch)


def test_profile_rules_table_for_every_version():
    cfg = config.load("profiles/tuner.yaml")
    rows = nccl.tuner_table(cfg, sizes=(4096, 64 << 20))
    by = {(r["version"], r["class"], r["bytes"]): r for r in rows}
    for v in VERSIONS:
        assert by[v, "embedding", 4096]["chosen"] == "Ring/Simple" and by[v, "embedding", 4096]["channels"] == 16
        assert by[v, "projection", 64 << 20]["chosen"] == "Ring/LL"
        assert by[v, "norm_bias", 64 << 20]["chosen"].endswith("/LL")
        assert by[v, "ffn", 4096]["chosen"].startswith("Tree/")
        assert not by[v, "world", 4096]["forced"] and not by[v, "other", 64 << 20]["forced"]
    text = nccl.render_tuner_table(rows)
    assert text.splitlines()[0].split()[:4] == ["class", "bytes", "NCCL's", "pick"]


def test_build_is_cached_by_source_hash(lib):
    assert lib == nccl.tuner_lib_path() and nccl.build_tuner() == lib
    assert os.path.getsize(lib) > 0
