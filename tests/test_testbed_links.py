"""dtrain.analysis.testbed.links: tc's rate and byte units, one node's link, and the testbed profile's `testbed:` section
(the strict loader: file:line errors for unknown keys and wrong types; the command line over the profile)."""

import argparse

import pytest

from dtrain.analysis.testbed import links
from dtrain.common.errors import UserError

from conftest import REPO


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5gbit", 25 * 10**8),
                                       ("500kbit", 5 * 10**5), ("none", None)])
def test_parse_rate(text, bits):
    assert links.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gbps", "fast", "0gbit", "1 gigabit", ""])
def test_parse_rate_rejects(text):
    with pytest.raises(UserError, match="bad link rate"):
        links.parse_rate(text)


def test_bytes_and_burst():
    assert links.parse_bytes("256kb") == 262144 and links.parse_bytes("1m") == 1 << 20
    assert links.parse_bytes("1500") == 1500
    with pytest.raises(UserError):
        links.parse_bytes("12 parsecs")
    assert links.default_burst(10**9) == 250_000  # 2 ms at 1 Gbit/s
    assert links.default_burst(10**7) == 64 * 1024  # never below one 64 KiB GSO packet
    assert links.Link(10**9).tbf_args() == ["tbf", "rate", "1000000000bit", "burst", "250000", "latency", "50ms"]
    assert links.format_rate(10**9) == "1gbit" and links.format_rate(None) == "unshaped"


def _up_args(**kw):
    base = dict(nodes=None, link=None, link_per_node=None, burst=None, latency_ms=None, congestion_control=None,
                intra_link=None)
    return argparse.Namespace(**{**base, **kw})


def test_links_from_command_line_over_profile_over_defaults():
    assert links.links_from(_up_args()) == [links.Link(10**9)] * 2
    profile = links.load_profile(REPO / "dtrain" / "profiles" / "testbed" / "1gbit.yaml")
    assert profile == links.TestbedSection(nodes=2, link="1gbit", burst="250kb", latency_ms=50.0)
    assert [(lk.rate, lk.burst) for lk in links.links_from(_up_args(), profile)] == [(10**9, 256000)] * 2
    three = links.links_from(_up_args(nodes=3, link="100mbit"), profile)
    assert [(lk.rate, lk.burst) for lk in three] == [(10**8, 256000)] * 3
    per_node = links.links_from(_up_args(link_per_node="1gbit,100mbit,none"))
    assert [lk.rate for lk in per_node] == [10**9, 10**8, None]
    listed = links.links_from(_up_args(), links.TestbedSection(link_per_node=["100mbit", "none"], burst=131072))
    assert [(lk.rate, lk.burst) for lk in listed] == [(10**8, 131072), (None, 131072)]
    with pytest.raises(UserError, match="2 rate"):
        links.links_from(_up_args(nodes=3, link_per_node="1gbit,1gbit"))


@pytest.mark.parametrize("shape, nodes, per_node", [("2x2", 2, 2), ("4x1", 4, 1), ("8x1", 8, 1)])
def test_the_shape_profiles_give_their_nodes_and_ranks(shape, nodes, per_node):
    profile = links.load_profile(REPO / "dtrain" / "profiles" / "testbed" / f"{shape}.yaml")
    assert profile.ranks_per_node == per_node
    made = links.links_from(_up_args(), profile)
    assert [(lk.rate, lk.intra_rate) for lk in made] == [(10**9, None)] * nodes  # loopback unshaped inside
    pcie = links.links_from(_up_args(intra_link="8gbit"), profile)  # the command line over the profile
    assert {lk.intra_rate for lk in pcie} == {8 * 10**9}
    assert pcie[0].intra_tbf_args()[:4] == ["tbf", "rate", "8000000000bit", "burst"]
    assert int(pcie[0].intra_tbf_args()[4]) > 64 * 1024  # above loopback's 64 KiB MTU: no packet dropped whole


def _sysctls(tmp_path, available, allowed):
    (tmp_path / "tcp_available_congestion_control").write_text(available + "\n")
    (tmp_path / "tcp_allowed_congestion_control").write_text(allowed + "\n")
    return tmp_path


def test_congestion_control_must_be_available_and_allowed(tmp_path, monkeypatch):
    monkeypatch.setattr(links, "TCP_SYSCTLS", _sysctls(tmp_path, "reno bbr cubic", "reno bbr"))
    links.check_congestion_control("bbr")
    with pytest.raises(UserError, match=r"'vegas' is not available in this kernel \(available: reno bbr cubic; "
                                        r"a module may add it: modprobe tcp_vegas\)"):
        links.check_congestion_control("vegas")
    with pytest.raises(UserError, match=r"'cubic' is not allowed .*tcp_allowed_congestion_control='reno bbr cubic'"):
        links.check_congestion_control("cubic")
    # command line over profile; checked before anything is made
    profile = links.TestbedSection(congestion_control="cubic")
    assert {lk.congestion_control for lk in links.links_from(_up_args(congestion_control="bbr"), profile)} == {"bbr"}
    with pytest.raises(UserError, match="'cubic' is not allowed"):
        links.links_from(_up_args(), profile)
    assert links.links_from(_up_args())[0].congestion_control is None  # the host's


@pytest.mark.parametrize("text,expected", [
    ("testbed:\n  nodes: 2\n  lnk: 1gbit\n",
     r"tb.yaml:3: unknown key 'testbed.lnk'; did you mean 'testbed.link'\? \(known: burst, congestion_control, intra_link, latency_ms"),
    ("testbed:\n  nodes: two\n", r"tb.yaml:2: 'testbed.nodes' must be int, got 'two'"),
    ("testbed:\n  latency_ms: .inf\n", r"tb.yaml:2: 'testbed.latency_ms' must be a finite number"),
    ("testbed:\n  link_per_node: [1gbit, 3]\n", r"tb.yaml:2: 'testbed.link_per_node"),
    ("model: {preset: tiny}\n", r"tb.yaml: no 'testbed:' section"),
    ("testbed: 1gbit\n", r"tb.yaml: no 'testbed:' section"),
    ("testbed: [1\n", r"tb.yaml:\d+: malformed YAML"),
])
def test_profile_section_is_strict(tmp_path, text, expected):
    p = tmp_path / "tb.yaml"
    p.write_text(text)
    with pytest.raises(UserError, match=expected):
        links.load_profile(p)


def test_missing_profile_is_one_line(tmp_path):
    with pytest.raises(UserError, match="nope.yaml: testbed profile not found"):
        links.load_profile(tmp_path / "nope.yaml")
