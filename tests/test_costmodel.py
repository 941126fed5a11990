"""dtrain.collectives.costmodel: NCCL's formulas on hand-computed cases (NCCL 2.30's src/graph/tuning.cc), the pick
changing with size, fits recovering known latency/bandwidth, the parsers, the cost of one all-reduce on every model,
and the CLI's verbs and one-line errors."""

import json
import math
from dataclasses import replace
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.collectives import costmodel as cm
from dtrain.collectives.costmodel.measurements import bench_row
from dtrain.common.errors import UserError
from dtrain.common.units import parse_sizes

DATA = Path(__file__).parent / "data"
H100 = cm.NcclModel(cm.topology("h100x8"))  # 12 channels x 30 GB/s, NVLink, one node of 8
H100x2 = cm.NcclModel(cm.topology("h100x8-ib:2"))  # 8 channels x 45 GB/s, 2 nodes of 8, Intel hosts
H100_NO_NVLS = cm.NcclModel(replace(cm.topology("h100x8"), nvls_enable=False))  # as NCCL_NVLS_ENABLE=0


def test_single_node_latencies_match_hand_computed_formulas():
    # Ring: base + 2(N-1) NVLink hops; Tree: base + 2 (ppn-1) NVLink hops (tuning.cc).
    hand = {("Ring", "LL"): 6.6 + 14 * 0.6, ("Ring", "LL128"): 14.0 + 14 * 1.9, ("Ring", "Simple"): 8.4 + 14 * 3.4,
            ("Tree", "LL"): 6.8 + 2 * 7 * 0.6, ("Tree", "LL128"): 14.0 + 2 * 7 * 1.25,
            ("Tree", "Simple"): 8.4 + 2 * 7 * 4.0}
    for (a, p), lat in hand.items():
        assert H100.latency_us(a, p) == pytest.approx(lat), (a, p)


def test_multi_node_latencies_and_ring_simple_factor():
    # 16 ranks: 30 ring steps, 2(nodes-1) = 2 of them over the network; the intra hop is at least the 1 us
    # network post overhead (x3 for Simple).
    assert H100x2.latency_us("Ring", "LL") == pytest.approx(6.6 + 28 * 1.0 + 2 * 2.7)
    assert H100x2.latency_us("Ring", "Simple") == pytest.approx(8.4 + 28 * 3.4 + 2 * 14.0)
    assert H100x2.latency_us("Tree", "LL") == pytest.approx(6.8 + 2 * (7 * 0.6 + 1 * 5.0))
    assert H100x2.latency_us("Tree", "Simple") == pytest.approx(8.4 + 2 * (7 * 4.0 + 1 * 14.0))
    # Ring/Simple multi-node latency x1.4 on Hopper once bytes/(channels*ranks) >= 64, x1.9 before Ampere.
    small, large = 64 * 8 * 16 - 1, 64 * 8 * 16
    assert H100x2.choice(small, "Ring", "Simple").lat_us == pytest.approx(H100x2.latency_us("Ring", "Simple"))
    assert H100x2.choice(large, "Ring", "Simple").lat_us == pytest.approx(1.4 * H100x2.latency_us("Ring", "Simple"))
    v100 = cm.NcclModel(cm.topology("v100x8-ib:2"))
    assert v100.choice(1 << 20, "Ring", "Simple").lat_us == pytest.approx(1.9 * v100.latency_us("Ring", "Simple"))
    # One node: no factor.
    assert H100.choice(1 << 30, "Ring", "Simple").lat_us == pytest.approx(H100.latency_us("Ring", "Simple"))


def test_bus_bandwidth_caps_by_protocol():
    bus = 12 * 30.0
    assert H100.bus_bw("Ring", "Simple") == pytest.approx(bus)
    assert H100.bus_bw("Ring", "LL") == pytest.approx(141.0)  # min(llMaxBw Hopper 1 node, bus x 0.5)
    assert H100.bus_bw("Ring", "LL128") == pytest.approx(min(bus * 0.92, 12 * 36.7))
    tree = min(bus * 0.92, 12 * 38.7)
    assert H100.bus_bw("Tree", "Simple") == pytest.approx(tree)
    assert H100.bus_bw("Tree", "LL") == pytest.approx(min(tree / 3.8, 141.0))
    assert H100.bus_bw("Tree", "LL128") == pytest.approx(min(tree * 7 / 9, 12 * 36.7))
    # Two nodes: Tree capped by perChMaxTreeBw Hopper [2 nodes] = 41.4 per channel; LL cap from the Intel row.
    assert H100x2.bus_bw("Tree", "Simple") == pytest.approx(min(360 * 0.92, 8 * 41.4))
    assert H100x2.bus_bw("Ring", "LL") == pytest.approx(39.0)
    # Algorithm bandwidth: Ring x N/(2(N-1)), Tree x 0.5.
    assert H100.alg_bw("Ring", "Simple") == pytest.approx(bus * 8 / 14)
    assert H100.alg_bw("Tree", "Simple") == pytest.approx(tree * 0.5)


def test_time_is_latency_plus_bytes_over_bandwidth_with_tree_correction():
    n = 1 << 30
    c = H100.choice(n, "Ring", "Simple")
    assert c.time_us == pytest.approx(56.0 + n / (1000 * 360 * 8 / 14))
    assert c.busbw == pytest.approx(n / (1000 * c.time_us) * 2 * 7 / 8)  # nccl-tests busbw convention
    # 256 KiB = 64 B * 2^12: Tree/LL correction 0.4, Tree/Simple 0.5 (NCCL's table).
    s = 64 << 12
    for proto, factor in (("LL", 0.4), ("Simple", 0.5)):
        got = H100.choice(s, "Tree", proto)
        assert got.bw == pytest.approx(factor * H100.alg_bw("Tree", proto))
    # At and above 512 MiB there is no correction.
    assert H100.choice(512 << 20, "Tree", "Simple").bw == pytest.approx(H100.alg_bw("Tree", "Simple"))


def test_pick_changes_from_ll_to_simple_on_one_node():
    # Without NVLS (NCCL_NVLS_ENABLE=0, or any node without NVSwitch): Ring LL -> LL128 -> Simple.
    assert (H100_NO_NVLS.pick(8).algo, H100_NO_NVLS.pick(8).proto) == ("Ring", "LL")
    assert (H100_NO_NVLS.pick(1 << 30).algo, H100_NO_NVLS.pick(1 << 30).proto) == ("Ring", "Simple")
    doc = cm.table(H100_NO_NVLS, parse_sizes("8:1G"))
    changes = cm.pick_changes(doc)
    assert [c[2] for c in changes] == ["Ring/LL128", "Ring/Simple"]
    # With NVLS (the default on an NVSwitch Hopper node) NVLS/Simple takes over from Ring/LL once its 25 us NVLink
    # SHARP latency is paid back.
    doc = cm.table(H100, parse_sizes("8:1G"))
    assert [(c[1], c[2]) for c in cm.pick_changes(doc)] == [("Ring/LL", "NVLS/Simple")]
    # The pick is always the least modeled time.
    for row in doc["rows"]:
        best = min(row["choices"], key=lambda c: c["time_us"])
        assert row["pick"] == {"algo": best["algo"], "proto": best["proto"]}


def test_pascal_has_no_ll128_and_tree_only_for_allreduce():
    p100 = cm.NcclModel(cm.topology("p100x8"))
    assert {c.proto for c in p100.choices(1 << 20)} == {"LL", "Simple"}
    assert {c.algo for c in H100_NO_NVLS.choices(1 << 20, "allgather")} == {"Ring"}
    # AllGather ring: N-1 steps, algbw = busbw x N/(N-1).
    ag = H100.choice(1 << 30, "Ring", "Simple", "allgather")
    assert ag.lat_us == pytest.approx(8.4 + 7 * 3.4)
    assert ag.bw == pytest.approx(360 * 8 / 7)


def test_nvls_on_one_hopper_node_by_hand():
    # NVLS graph 8 channels x 40 GB/s intra, 60 inter; Hopper NVLS efficiency 0.85 (tuning.cc).
    per_ch = min(40 * 0.85 * 7 / 8 * 2, 60)  # AllReduce pipelines two operations: x2
    nvls = H100.choice(1 << 30, "NVLS", "Simple")
    assert nvls.lat_us == pytest.approx(25.0)  # NCCL sets the NVLS latency to the NVLink hop's 25 us, no base
    assert nvls.bw == pytest.approx(8 * per_ch * 8 / 14)  # bus bandwidth x N / (2(N-1))
    assert nvls.busbw == pytest.approx(8 * per_ch, rel=0.01)  # nccl-tests busbw near 476 GB/s at 1 GiB
    # AllGather: x(ppn-1)/ppn instead of x2, and no conversion to algorithm bandwidth off the ring.
    ag = H100.choice(1 << 30, "NVLS", "Simple", "allgather")
    assert ag.bw == pytest.approx(8 * min(40 * 0.85 * 7 / 8 * 7 / 8, 60))
    # Simple only; never for Broadcast; not without NVSwitch or before Hopper; not with NCCL_NVLS_ENABLE=0.
    assert {c.proto for c in H100.choices(1 << 20) if c.algo == "NVLS"} == {"Simple"}
    assert "NVLS" not in {c.algo for c in H100.choices(1 << 20, "broadcast")}
    for model in (H100_NO_NVLS, cm.NcclModel(cm.topology("a100x8")), cm.NcclModel(cm.topology("v100x8"))):
        assert not {"NVLS", "NVLSTree"} & {c.algo for c in model.choices(1 << 20)}


def test_nvls_tree_across_nodes_by_hand():
    # Across nodes without SHARP: NVLSTree, not NVLS. Latency: the NVLink hop plus 2 log2(nodes) network levels.
    assert {c.algo for c in H100x2.choices(1 << 20)} == {"Tree", "Ring", "NVLSTree"}
    assert H100x2.latency_us("NVLSTree", "Simple") == pytest.approx(25.0 + 2 * 1 * 20.9)
    # Per channel: min(intra 40 x 0.85 x 7/8 x 2, inter 48 x 2 on <= 2 nodes, cap 57.7 at 2 nodes) = 57.7.
    assert H100x2.bus_bw("NVLSTree", "Simple") == pytest.approx(8 * 57.7)
    assert H100x2.alg_bw("NVLSTree", "Simple") == pytest.approx(8 * 57.7 * 16 / 30)
    four = cm.NcclModel(cm.topology("h100x8-ib:4"))  # inter 48 not doubled, cap 45.5 at >= 4 nodes
    assert four.bus_bw("NVLSTree", "Simple") == pytest.approx(8 * 45.5)
    assert four.latency_us("NVLSTree", "Simple") == pytest.approx(25.0 + 2 * 2 * 20.9)
    assert H100x2.pick(1 << 30).algo == "NVLSTree"
    # Blackwell applies Tree's per-size correction to NVLSTree too (256 KiB: Simple row, 0.5).
    b200 = cm.NcclModel(cm.topology("b200x8-ib:2"))
    assert b200.choice(64 << 12, "NVLSTree", "Simple").bw == pytest.approx(0.5 * b200.alg_bw("NVLSTree", "Simple"))
    assert H100x2.choice(64 << 12, "NVLSTree", "Simple").bw == pytest.approx(H100x2.alg_bw("NVLSTree", "Simple"))


def test_collnet_only_with_sharp_by_hand():
    assert not {"CollNetDirect", "CollNetChain"} & {c.algo for c in H100x2.choices(1 << 20)}
    a100 = cm.NcclModel(cm.topology("a100x8-ib-sharp:4"))  # 8 ranks a node, CollNet graph 8 x 24 GB/s
    assert {c.algo for c in a100.choices(1 << 20)} == {"Tree", "Ring", "CollNetDirect", "CollNetChain"}
    assert a100.latency_us("CollNetDirect", "Simple") == pytest.approx(2 * (3.7 + 7 * 0.4) + 31.0)
    assert a100.latency_us("CollNetChain", "Simple") == pytest.approx(2 * 7 * 2.8 + 30.0)
    assert a100.alg_bw("CollNetDirect", "Simple") == pytest.approx(8 * 24 * 0.5)  # one NIC per GPU: factor 1
    assert a100.alg_bw("CollNetChain", "Simple") == pytest.approx(8 * 24 * 0.5)
    h100 = cm.NcclModel(cm.topology("h100x8-ib-sharp:4"))
    assert h100.alg_bw("CollNetDirect", "Simple") == pytest.approx(8 * 48 * 0.85 * 0.5)  # x0.85 from Hopper on
    # With SHARP, NVLS runs across nodes too: the NVLink hop plus one network step.
    assert h100.latency_us("NVLS", "Simple") == pytest.approx(25.0 + 18.0)
    assert "NVLS" in {c.algo for c in h100.choices(1 << 20)}
    # CollNet serves AllReduce only here (its AllGather/ReduceScatter need the plugin's own, not modeled).
    assert {c.algo for c in a100.choices(1 << 20, "allgather")} == {"Ring"}


def test_pat_for_allgather_with_one_gpu_per_node_by_hand():
    eth = cm.NcclModel(cm.topology("a100x1-roce25:16"))  # 1 channel x 3.0 GB/s, 16 nodes of 1 GPU
    assert eth.latency_us("PAT", "Simple", "allgather") == pytest.approx(8.0 + 4 * 14.0 / 3.5 + 16 * 2.8)
    assert eth.alg_bw("PAT", "Simple", "allgather") == pytest.approx(3.0 * 0.75)  # not converted off the ring
    assert eth.pick(4 << 10, "allgather").algo == "PAT" and eth.pick(1 << 30, "allgather").algo == "Ring"
    assert "PAT" not in {c.algo for c in eth.choices(1 << 20)}  # never for AllReduce
    assert "PAT" not in {c.algo for c in H100.choices(1 << 20, "allgather")}  # 8 GPUs per node
    off = cm.NcclModel(replace(cm.topology("a100x1-roce25:16"), pat_enable=False))  # NCCL_PAT_ENABLE=0
    assert "PAT" not in {c.algo for c in off.choices(1 << 20, "allgather")}
    # One GPU per node: every ring step is a network step at Tree's network latency (tuning.cc).
    assert eth.latency_us("Ring", "Simple") == pytest.approx(8.4 + 30 * 14.0)


def test_topology_names():
    assert cm.topology("h100x8-ib:4").ranks == 32
    assert cm.topology("a100x1-roce25:16").ranks == 16 and cm.topology("h200x8").gpu == "H200"
    for bad in ("h300x8", "h100x8-ib", "h100x8-ib:1", "h100x8-ib:x", "h100x8:2", "a100x1-roce25", "b200x8-ib-sharp:2"):
        with pytest.raises(UserError):
            cm.topology(bad)


def test_fit_recovers_known_regimes_from_synthetic_data():
    sizes = [2 ** k for k in range(3, 31)]
    truth = [cm.Regime(1 << 20, 12.0, 40.0), cm.Regime(math.inf, 80.0, 150.0)]
    noisy = [next(r for r in truth if s <= r.max_bytes).time_us(s) * (1 + 0.01 * math.sin(7.1 * i))
             for i, s in enumerate(sizes)]
    fit = cm.fit_regimes(sizes, noisy)
    assert len(fit) == 2
    assert fit[0].lat_us == pytest.approx(12.0, rel=0.03) and fit[0].bw == pytest.approx(40.0, rel=0.03)
    assert fit[1].lat_us == pytest.approx(80.0, rel=0.05) and fit[1].bw == pytest.approx(150.0, rel=0.03)
    assert (1 << 20) <= fit[0].max_bytes < (2 << 20)
    # Exact single-regime data gives one regime and exact parameters.
    one = cm.fit_regimes(sizes, [5.0 + s / (1000 * 20.0) for s in sizes])
    assert len(one) == 1 and one[0].lat_us == pytest.approx(5.0) and one[0].bw == pytest.approx(20.0)


# The reducer path on the emulated 2-node testbed (1 Gbit/s), recorded: size (B), median and interquartile range of
# 20 operations (us). Small sizes scatter by up to 8x their median (the shared CPU's scheduler), large ones by 1-10 %.
TESTBED = [(8, 202.5, 14.9), (32, 341.9, 2400.6), (128, 460.0, 3702.2), (512, 3386.2, 3590.8), (2048, 425.4, 65.9),
           (8192, 443.6, 108.3), (32768, 441.5, 31.0), (131072, 1107.5, 43.7), (524288, 4398.4, 142.1),
           (2097152, 18181.5, 1965.6), (8388608, 72371.6, 3596.4), (33554432, 287247.8, 4187.6)]


# The same on another day: the small sizes' operations bimodal (interquartile ranges of 2-11x the median).
TESTBED_BIMODAL = [(8, 241.6, 158.9), (32, 468.4, 3571.7), (128, 583.5, 3346.0), (512, 290.2, 2501.7),
                   (2048, 467.4, 2335.3), (8192, 1594.5, 3510.6), (32768, 318.2, 3441.7), (131072, 1099.7, 53.2),
                   (524288, 4422.2, 806.1), (2097152, 17532.5, 265.6), (8388608, 70659.9, 809.8),
                   (33554432, 283767.3, 2470.1)]


def _fitted(regimes):
    return lambda n: next(r for r in regimes if n <= r.max_bytes).time_us(n)


def test_fit_weighs_each_size_by_its_measured_spread():
    sizes, medians, iqrs = zip(*TESTBED)
    spreads = [q / m for m, q in zip(medians, iqrs)]
    large = [(s, m) for s, m in zip(sizes, medians) if s >= 512 * 1024]
    weighted = _fitted(cm.fit_regimes(sizes, medians, spreads=spreads))
    assert all(abs(weighted(s) / m - 1) < 0.03 for s, m in large)
    # Unweighted, the noisy small sizes pull the large sizes' bandwidth 9 % off.
    plain = _fitted(cm.fit_regimes(sizes, medians))
    assert max(abs(plain(s) / m - 1) for s, m in large) > 0.05
    # Sizes scattering by several times their median still count (their spread is capped): without the cap the
    # small sizes weighed nothing and one regime put them all at a tenth of their medians.
    sizes, medians, iqrs = zip(*TESTBED_BIMODAL)
    bimodal = _fitted(cm.fit_regimes(sizes, medians, spreads=[q / m for m, q in zip(medians, iqrs)]))
    assert statistics.median(abs(bimodal(s) / m - 1) for s, m in zip(sizes, medians) if s <= 32768) < 0.5
    assert all(abs(bimodal(s) / m - 1) < 0.03 for s, m in zip(sizes, medians) if s >= 128 * 1024)
    # A benchmark's spread reaches the fit: the JSON's iqr_us.
    rows = [{"path": "reducer", "size": s, "time_us": m, "median_us": m, "iqr_us": q} for s, m, q in TESTBED]
    ms = cm.MeasurementSet([bench_row(r, "t") for r in rows])
    assert ms.rows[1].spread == pytest.approx(2400.6 / 341.9)
    assert cm.FittedModel.from_measurements(ms).time_us(8388608) == pytest.approx(weighted(8388608))


def test_a_fitted_regime_never_makes_a_bigger_message_markedly_faster():
    # Unconstrained, the weighted fit of TESTBED ended a regime at 1 KiB at 6.4 ms and started the next at 0.43 ms
    # (a line through the 8 B and the 512 B medians, the latter a scheduler outlier).
    sizes, medians, iqrs = zip(*TESTBED)
    grid = [2 ** k for k in range(3, 27)]
    for spreads in (None, [q / m for m, q in zip(medians, iqrs)]):
        for k in (2, 3, 4):
            t = _fitted(cm.fit_regimes(sizes, medians, max_regimes=k, spreads=spreads))
            assert min(t(b) / t(a) for a, b in zip(grid, grid[1:])) >= 0.9


def test_a_benchmark_with_median_operations_is_fitted_to_them_not_to_the_mean(tmp_path):
    # 200 us + bytes / 0.1 GB/s per operation; the means carry scheduler outliers of +2 ms at some small sizes.
    sizes = [8 * 4 ** k for k in range(12)]
    true = [200.0 + s / 100.0 for s in sizes]
    rows = [{"path": "reducer", "size": s, "time_us": t + (2000.0 if k % 3 == 1 else 0.0), "median_us": t}
            for k, (s, t) in enumerate(zip(sizes, true))]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    ms = cm.read_measurements(tmp_path / "b.json")
    assert [m.typical_us for m in ms.rows] == true
    fm = cm.FittedModel.from_measurements(ms)
    assert fm.time_us(8) == pytest.approx(200.0, rel=1e-3)
    assert fm.time_us(1 << 24) == pytest.approx(200.0 + (1 << 24) / 100, rel=1e-3)
    rep = cm.fit_report(ms, fm)
    assert rep["fit_error_pct"]["max_abs"] < 0.1 and rep["rows"][1]["measured_us"] == true[1]
    # Without medians (nccl-tests logs, GPU benchmarks) the mean is what there is.
    assert cm.Measurement(8, 900.0).typical_us == 900.0


def test_the_benchmarks_groups_rows_give_the_links_share_and_are_not_fitted(tmp_path):
    # --groups: 1, 2 and 4 groups each all-reducing 8 MiB at once: two move twice the bytes at 2 x 70 / 160 =
    # 0.875 of one group's rate, four at 4 x 70 / 350 = 0.8.
    sizes = [8 * 4 ** k for k in range(12)]
    rows = [{"path": "reducer", "size": s, "time_us": 200.0 + s / 100.0, "groups": None} for s in sizes]
    rows += [{"path": "groups", "size": 8 << 20, "time_us": t, "median_us": t, "groups": k}
             for k, t in ((1, 70.0), (2, 160.0), (4, 350.0))]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    ms = cm.read_measurements(tmp_path / "b.json")
    assert len(ms.rows) == len(sizes) and ms.link_efficiency == {1: 1.0, 2: 0.875, 4: 0.8}
    fm = cm.FittedModel.from_measurements(ms)
    assert fm.time_us(1 << 24) == pytest.approx(200.0 + (1 << 24) / 100, rel=1e-3)  # the groups' rows not in it
    # between measured counts interpolated, beyond the largest its share, one group (or none measured) 1
    assert [fm.link_efficiency(k) for k in (1, 2, 3, 4, 6)] == pytest.approx([1.0, 0.875, 0.8375, 0.8, 0.8])
    assert "k=2 0.875" in "\n".join(fm.header())
    again = cm.FittedModel.from_dict(json.loads(json.dumps(fm.to_dict())))
    assert again.link_efficiency(3) == pytest.approx(0.8375)
    assert cm.FittedModel.from_measurements(cm.read_measurements(DATA / "bench_gloo_synthetic.csv")
                                            ).link_efficiency(5) == 1.0
    # without the one-group row there is nothing to compare with
    (tmp_path / "c.json").write_text(json.dumps(rows[:len(sizes)] + rows[-2:]))
    assert cm.read_measurements(tmp_path / "c.json").link_efficiency is None
    # groups that reach more together than one (each CPU-starved alone): kept as measured, played as one group's rate
    faster = rows[:len(sizes)] + [{"path": "groups", "size": 8 << 20, "time_us": t, "median_us": t, "groups": k}
                                  for k, t in ((1, 400.0), (2, 420.0), (3, 900.0))]
    (tmp_path / "d.json").write_text(json.dumps(faster))
    fm = cm.FittedModel.from_measurements(cm.read_measurements(tmp_path / "d.json"))
    assert fm.together[2] == pytest.approx(2 * 400 / 420, rel=1e-3)
    assert [fm.link_efficiency(k) for k in (2, 3, 5)] == [1.0, 1.0, 1.0]


def test_read_nccl_tests_sample_and_fit():
    ms = cm.read_measurements(DATA / "all_reduce_perf_synthetic.log")
    assert ms.coll == "allreduce" and ms.ranks == 8 and len(ms.rows) == 28
    assert ms.rows[0].size == 8 and ms.rows[-1].size == 1 << 30
    fm = cm.FittedModel.from_measurements(ms)
    (regs,) = fm.fits.values()
    # The sample's generating parameters: 15 us + bytes/70 GB/s, then 60 us + bytes/185 GB/s (+-1.5 % noise).
    assert len(regs) == 2
    assert regs[0].lat_us == pytest.approx(15.0, rel=0.05) and regs[1].lat_us == pytest.approx(60.0, rel=0.05)
    assert regs[0].bw == pytest.approx(70.0, rel=0.03) and regs[1].bw == pytest.approx(185.0, rel=0.03)
    rep = cm.fit_report(ms, fm, H100)
    assert rep["fit_error_pct"]["max_abs"] < 3.0
    assert all("preset_err_pct" in r for r in rep["rows"])


def test_read_bench_csv_skips_wrong_rows_and_keeps_out_of_place():
    ms = cm.read_measurements(DATA / "bench_gloo_synthetic.csv")
    assert ms.skipped == 1 and ms.ranks == 2
    assert len(ms.rows) == len({m.size for m in ms.rows})  # in-place duplicates left out
    fm = cm.FittedModel.from_measurements(ms)
    assert fm.time_us(1 << 20) == pytest.approx(250 + (1 << 20) / 2500, rel=0.03)


def test_tuning_lines_label_sizes_and_fit_per_algo_proto(tmp_path):
    header = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw"
              "   busbw #wrong\n")
    lines = ["# Collective test starting: all_reduce_perf", header.rstrip()]
    for k in range(10, 27):
        s = 2 ** k
        algo, proto, lat, bw = ("RING", "LL", 15.0, 60.0) if s < 1 << 18 else ("RING", "SIMPLE", 55.0, 180.0)
        lines.append(f"node:1:1 [0] NCCL INFO AllReduce: {s} Bytes -> Algo {algo} proto {proto} channel{{Lo..Hi}}="
                     "{0..7}")
        t = lat + s / (1000 * bw)
        a = s / 1000 / t
        lines.append(f"{s:>12} {s // 4:>13} float sum -1 {t:8.2f} {a:7.2f} {a * 1.75:7.2f} 0 {t:8.2f} {a:7.2f} "
                     f"{a * 1.75:7.2f} 0")
    path = tmp_path / "tuned.log"
    path.write_text("\n".join(lines) + "\n")
    ms = cm.read_measurements(path)
    assert {m.label for m in ms.rows} == {"Ring/LL", "Ring/Simple"}
    fm = cm.FittedModel.from_measurements(ms)
    assert fm.fits["Ring/Simple"][0].bw == pytest.approx(180.0, rel=0.01)
    assert fm.time_us(1 << 16, algo="Ring", proto="LL") == pytest.approx(15 + (1 << 16) / 60000, rel=0.01)


def test_older_table_layout_launcher_labels_and_a_prompt_line(tmp_path):
    # nccl-tests before the `root` and `#wrong` columns: `error` is the largest deviation, wrong above the type's
    # tolerance (1e-5 for float); N/A where validation was off.
    old = ["#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error"]
    for k, err in zip(range(20, 25), ("2e-07", "N/A", "3e-04", "1e-06", "0e+00")):
        s = 1 << k
        t = 20 + s / 50_000
        old.append(f"{s:>12} {s // 4:>13} float sum {t:8.2f} {s / 1000 / t:7.2f} {s / 500 / t:7.2f} {err} "
                   f"{t:8.2f} {s / 1000 / t:7.2f} {s / 500 / t:7.2f} {err}")
    old.append("# Avg bus bandwidth    : 1.0")
    for name, label in (("plain", ""), ("srun", "0: "), ("mpi", "[1,0]<stdout>:")):
        path = tmp_path / f"{name}.log"
        path.write_text("\n".join(["[root@node-0 nccl-tests]# mpirun -np 2 ./build/all_reduce_perf -b 1M -e 16M"]
                                  + [label + ln for ln in old]) + "\n")
        ms = cm.read_measurements(path)
        assert [m.size >> 20 for m in ms.rows] == [1, 2, 8, 16] and ms.skipped == 1, name  # 4 MiB: 3e-04 > 1e-5
        assert ms.rows[0].time_us == pytest.approx(20 + (1 << 20) / 50_000, abs=0.01) and ms.avg_busbw == 1.0


def test_environment_forced_protocol_labels_rows(tmp_path):
    text = (DATA / "all_reduce_perf_synthetic.log").read_text().replace(
        "# Using devices", "node:1:1 [0] NCCL INFO NCCL_PROTO set by environment to LL128\n# Using devices")
    path = tmp_path / "forced.log"
    path.write_text(text)
    assert {m.label for m in cm.read_measurements(path).rows} == {"*/LL128"}


def test_bad_measurement_files(tmp_path):
    (tmp_path / "empty.log").write_text("# nothing\n")
    (tmp_path / "prose.txt").write_text("hello world\n")
    (tmp_path / "nocols.csv").write_text("a,b\n1,2\n")
    for name in ("empty.log", "prose.txt", "nocols.csv", "missing.csv"):
        with pytest.raises(UserError):
            cm.read_measurements(tmp_path / name)


def test_cli_json_table(capsys):
    cm.main(["--topology", "h100x8", "--sizes", "8,1G", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["topology"] == "h100x8" and doc["modeled"] is True
    assert [r["size"] for r in doc["rows"]] == [8, 1 << 30]
    assert doc["rows"][1]["pick"] == {"algo": "NVLS", "proto": "Simple"}
    assert {"algo", "proto", "time_us", "algbw", "busbw"} <= set(doc["rows"][0]["choices"][0])
    assert len(doc["rows"][0]["choices"]) == 7  # Ring/Tree x 3 protocols, NVLS/Simple
    cm.main(["--topology", "h100x8", "--sizes", "1G", "--json", "--nvls-enable", "0"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"][0]["pick"] == {"algo": "Ring", "proto": "Simple"} and len(doc["rows"][0]["choices"]) == 6


def test_cli_fit_saves_a_local_model(tmp_path, capsys):
    out = tmp_path / "local.json"
    cm.main(["fit", str(DATA / "bench_gloo_synthetic.csv"), "--out", str(out)])
    text = capsys.readouterr().out
    assert "err%" in text and "fit error" in text
    model = cm.load_model(f"local:{out}")
    assert model.time_us(1 << 20) == pytest.approx(250 + (1 << 20) / 2500, rel=0.03)
    cm.main(["--topology", f"local:{out}", "--sizes", "1K:1M"])
    assert "MODELED from a fit" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_bad_topology_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "dtrain.collectives.costmodel", "--topology", "nope"], capture_output=True,
                       text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "unknown topology 'nope'" in r.stderr
    with pytest.raises(SystemExit) as e:
        cm.main(["--topology", "h100x8", "--sizes", "big"])
    assert e.value.code == 2


# NCCL's own table, as rank 0 printed it on an H200 (NCCL 2.28.9; two ranks as two hosts over the socket transport)
H200_LOG = DATA / "nccl" / "h200_per_class_2.28.9.log"


def test_nccls_printed_table_is_read_from_a_recorded_log():
    model = cm.load_model(f"nccl-log:{H200_LOG}")
    assert isinstance(model, cm.NcclTableModel) and model.ranks is None  # this log has no INIT lines
    assert model.cells[("allreduce", "Ring", "LL")] == (16.6, 0.6)
    assert model.cells[("allreduce", "Ring", "Simple")] == (36.4, 1.2)
    assert model.cells[("allreduce", "Tree", "LL")] == (16.8, 0.2)
    # LL128 has bandwidth 0.0 over this network (disabled); the first table is used, not the later ones of the
    # per-class communicators, whose NCCL_PROTO left only one protocol enabled.
    assert {(c.algo, c.proto) for c in model.choices(1 << 20)} == {("Tree", "LL"), ("Tree", "Simple"),
                                                                   ("Ring", "LL"), ("Ring", "Simple")}


def test_nccl_table_times_and_the_pick_by_hand():
    model = cm.NcclTableModel.from_log(H200_LOG)
    assert model.time_us(8, algo="Ring", proto="LL") == pytest.approx(16.6 + 8 / 600)
    assert model.time_us(1 << 20, algo="Ring", proto="Simple") == pytest.approx(36.4 + (1 << 20) / 1200)
    # Ring/LL and Ring/Simple cross where 16.6 + S/600 = 36.4 + S/1200, at S = 23,760 B.
    assert (model.pick(16384).proto, model.pick(32768).proto) == ("LL", "Simple")
    with pytest.raises(UserError, match="disabled in NCCL's table"):
        model.time_us(1024, algo="Ring", proto="LL128")


def test_nccl_table_on_the_command_line_and_a_log_without_one(tmp_path, capsys):
    cm.main(["--topology", f"nccl-log:{H200_LOG}", "--sizes", "8,1M", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert [r["pick"] for r in doc["rows"]] == [{"algo": "Ring", "proto": "LL"}, {"algo": "Ring", "proto": "Simple"}]
    assert "NCCL's own latency/bandwidth table" in doc["notes"][0]
    other = tmp_path / "rank1.log"
    other.write_text("host:2:2 [0] NCCL INFO NCCL_HOSTID set by environment to rank1\n")
    with pytest.raises(UserError, match="rank1.log: no NCCL tuning table found"):
        cm.load_model(f"nccl-log:{other}")
    with pytest.raises(UserError, match="needs a file"):
        cm.load_model("nccl-log:")


def test_bad_command_lines_are_one_line_errors(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"path": "reducer", "size": s, "time_us": m, "median_us": m, "iqr_us": q}
                                 for s, m, q in TESTBED]))
    log = tmp_path / "torn.log"  # a tuning table with a cell cut short
    log.write_text("\n".join(H200_LOG.read_text().splitlines()[:17]).replace("16.8/   0.2", "16.8/") + "\n")
    for argv, msg in ((["--topology", "h100x8", "--sizes", ","], "bad sizes ','"),
                      (["--topology", "h100x8", "--channels", "0"], "--channels must be >= 1"),
                      (["--topology", "h100x8", "--bw-per-channel", "nan"], "a finite number > 0"),
                      (["--topology", f"local:{bench}", "--coll", "allgather"], "fitted on allreduce, not allgather"),
                      (["--topology", f"nccl-log:{log}"], "is not latency/bandwidth (a truncated log?)"),
                      (["fit", str(bench), "--out", str(tmp_path)], "is a directory"),
                      (["fit", str(bench), "--topology", f"fit:{bench}"], "not another fit"),
                      (["recommend", "--profile", "dtrain/profiles/base.yaml", "--topology", "h100x8"],
                       "unknown command 'recommend' (commands: table, fit")):
        with pytest.raises(SystemExit) as e:
            cm.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and msg in err, (argv, err)


def test_help_lists_the_verbs(capsys):
    with pytest.raises(SystemExit) as e:
        cm.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "table (the default)" in out and "fit FILE" in out and "fit:<fit.json" in out
    assert "recommend" not in out  # one home: python -m dtrain.analysis.recommend
    cm.main(["table", "--topology", "a100x8", "--sizes", "8,1G", "--json"])  # the default verb, named
    assert json.loads(capsys.readouterr().out)["rows"][1]["pick"] == {"algo": "Ring", "proto": "Simple"}


def test_fit_is_the_documented_spelling_and_local_its_alias(tmp_path, capsys):
    out = tmp_path / "fit.json"
    cm.main(["fit", str(DATA / "bench_gloo_synthetic.csv"), "--out", str(out)])
    capsys.readouterr()
    printed = {}
    for prefix in ("fit", "local"):
        cm.main(["--topology", f"{prefix}:{out}", "--sizes", "1K:1M"])
        printed[prefix] = capsys.readouterr().out
    assert printed["fit"] == printed["local"]
    bench = DATA / "bench_gloo_synthetic.csv"
    assert cm.load_model(f"fit:{bench}").time_us(1 << 20) == cm.load_model(f"local:{bench}").time_us(1 << 20)
    assert cm.load_model(f"fit:{bench}").name == f"fit:{bench}"
    with pytest.raises(UserError, match="'fit:<bench.csv"):
        cm.load_model("fit:")


def test_one_allreduce_costs_the_same_way_on_every_model():
    # allreduce_ms: NCCL's analytic model honours a forced choice; NCCL's printed table and a fit cost NCCL's pick /
    # the measured path (what dtrain.analysis.simulate's cost_ms has always charged). allreduce_latency_ms: a fit's latency
    # term, 0 on NCCL's models.
    n = 1 << 20
    assert H100.allreduce_ms(n) == pytest.approx(H100.time_us(n) / 1000)
    assert H100.allreduce_ms(n, "Ring", "LL") == pytest.approx(H100.time_us(n, algo="Ring", proto="LL") / 1000)
    assert H100.allreduce_ms(1 << 30, "Ring", "LL") > H100.allreduce_ms(1 << 30)  # NCCL picks Simple there
    assert H100.allreduce_latency_ms(n) == 0.0
    table = cm.NcclTableModel.from_log(H200_LOG)
    assert table.allreduce_ms(n, "Ring", "LL") == table.allreduce_ms(n) == pytest.approx(table.time_us(n) / 1000)
    assert table.allreduce_latency_ms(n) == 0.0
    fit = cm.FittedModel({"Ring/LL": [cm.Regime(math.inf, 15.0, 60.0)],
                          "Ring/Simple": [cm.Regime(math.inf, 10.0, 400.0)]}, ranks=8, name="fit")
    assert fit.allreduce_ms(n, "Ring", "LL") == fit.allreduce_ms(n) == pytest.approx((10.0 + n / 400000) / 1000)
    assert fit.allreduce_latency_ms(n) == pytest.approx(10.0 / 1000)
    for model in (H100, table, fit):
        assert isinstance(model, cm.CollectiveCost)


# ---- reduce-scatter and all-gather --------------------------------------------------------------------------------

def test_a_reduce_scatter_log_is_fitted_as_one_with_its_bus_factor(tmp_path, capsys):
    ms = cm.read_measurements(DATA / "reduce_scatter_perf_synthetic.log")
    fm = cm.FittedModel.from_measurements(ms)
    assert fm.coll == "reducescatter" and fm.colls == ["reducescatter"] and not fm.other_colls
    (regs,) = fm.fits.values()
    # The sample's generating parameters: 12 us + bytes/60 GB/s, then 30 us + bytes/170 GB/s (+-1.5 % noise).
    assert [r.lat_us for r in regs] == pytest.approx([12.0, 30.0], rel=0.05)
    assert [r.bw for r in regs] == pytest.approx([60.0, 170.0], rel=0.03)
    pick = fm.pick(1 << 30, "reducescatter")
    assert pick.busbw == pytest.approx(pick.algbw * 7 / 8)  # (n-1)/n on 8 ranks, not all-reduce's 2(n-1)/n
    with pytest.raises(UserError, match="fitted on reducescatter, not allreduce"):
        fm.allreduce_ms(1 << 20)
    # `fit --topology`: the preset's modeled time is of the same collective
    cm.main(["fit", str(DATA / "reduce_scatter_perf_synthetic.log"), "--topology", "h100x8", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["colls"] == ["reducescatter"] and {r["coll"] for r in rep["rows"]} == {"reducescatter"}
    row = rep["rows"][-1]
    assert row["preset_us"] == pytest.approx(H100.time_us(row["size"], "reducescatter"), abs=1e-3)
    assert row["preset_us"] != pytest.approx(H100.time_us(row["size"], "allreduce"), rel=0.1)


def _bench_rows(coll: str, lat: float, gbps: float, path: str = "raw", cpu: float | None = None) -> list[dict]:
    """A benchmark JSON's rows of one collective on 8 ranks: t = lat + size / gbps, both column groups; the in-place
    group 1 % slower."""
    rows = []
    for k in range(10, 25, 2):
        t = lat + (1 << k) / (1000 * gbps)
        for place, f in (("out-of-place", 1.0), ("in-place", 1.01)):
            rows.append({"coll": coll, "path": path, "place": place, "size": 1 << k, "count": 1 << (k - 3),
                         "type": "float", "redop": "none" if coll == "all_gather" else "sum", "time_us": t * f,
                         "wrong": 0, "cpu_us": cpu, "world_size": 8})
    return rows


def test_a_benchmark_of_several_collectives_is_fitted_per_collective(tmp_path, capsys):
    rows = (_bench_rows("all_reduce", 100.0, 1.0, cpu=50.0) + _bench_rows("all_reduce", 200.0, 1.0, "reducer", 60.0)
            + _bench_rows("reduce_scatter", 80.0, 2.0, cpu=40.0) + _bench_rows("all_gather", 60.0, 4.0, cpu=30.0))
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    ms = cm.read_measurements(path)
    assert ms.colls == ["allreduce", "allgather", "reducescatter"] and ms.coll == "allreduce"
    # all-reduce keeps its in-place rows (the out-of-place ones add a copy), the others their out-of-place ones
    kept = {(ms.coll_of(m), m.label): m.time_us for m in ms.rows if m.size == 1 << 10}
    assert kept[("allreduce", "raw")] == pytest.approx(1.01 * (100 + 1024 / 1000))
    assert kept[("reducescatter", "raw")] == pytest.approx(80 + 1024 / 2000)
    fm = cm.FittedModel.from_measurements(ms)
    assert fm.colls == ["allreduce", "allgather", "reducescatter"]
    n = 1 << 22
    assert fm.time_us(n, "reducescatter") == pytest.approx(80 + n / 2000, rel=1e-3)
    assert fm.time_us(n, "allgather") == pytest.approx(60 + n / 4000, rel=1e-3)
    assert fm.time_us(n) == pytest.approx(1.01 * (200 + n / 1000), rel=1e-3)  # all-reduce: the reducer, in place
    assert fm.pick(n, "allgather").busbw == pytest.approx(fm.pick(n, "allgather").algbw * 7 / 8)  # 8 ranks
    assert fm.cpu_us(0) == pytest.approx(60.0)  # the all-reduce's reducer path, not the other collectives'
    with pytest.raises(UserError, match="fitted on allreduce, allgather, reducescatter, not broadcast"):
        fm.time_us(n, "broadcast")
    assert "allreduce, allgather, reducescatter" in fm.header()[0]
    again = cm.FittedModel.from_dict(json.loads(json.dumps(fm.to_dict())))
    assert again.time_us(n, "allgather") == pytest.approx(fm.time_us(n, "allgather"))
    # the text report names each fit's and each row's collective
    cm.main(["fit", str(path)])
    out = capsys.readouterr().out
    assert out.startswith(f"# fit of {path}: allreduce, allgather, reducescatter, ")
    assert any(ln.split()[:3] == ["reducescatter", "raw", "sizes"] for ln in out.splitlines())
    assert any(ln.split()[2:4] == ["allgather", "raw"] for ln in out.splitlines())


def test_a_fit_of_one_collective_is_saved_as_before(tmp_path):
    """An all-reduce fit's saved form has no other collectives' key; one with them names each."""
    one = cm.FittedModel.from_measurements(cm.read_measurements(DATA / "bench_gloo_synthetic.csv")).to_dict()
    assert set(one) == {"kind", "name", "coll", "ranks", "source", "fits", "cpu", "host"}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(_bench_rows("all_reduce", 100.0, 1.0) + _bench_rows("all_gather", 60.0, 4.0)))
    d = cm.FittedModel.from_measurements(cm.read_measurements(path)).to_dict()
    assert d["coll"] == "allreduce" and set(d["other_colls"]) == {"allgather"}
    d["other_colls"]["alltoall"] = d["other_colls"]["allgather"]
    with pytest.raises(UserError, match="unknown collective 'alltoall'"):
        cm.FittedModel.from_dict(d, "b.fit.json")
