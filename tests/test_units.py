"""dtrain.common.units: the one size grammar (every spelling the cost model and the benchmark accepted), the short human
form, and nccl-tests' bus-bandwidth factor."""

import pytest

from dtrain.common.errors import UserError
from dtrain.common.units import bus_factor, human, parse_size, parse_sizes


@pytest.mark.parametrize("text,n", [("8", 8), ("64K", 65536), ("64k", 65536), ("256M", 256 << 20), ("1G", 1 << 30),
                                    ("128MB", 128 << 20), ("8b", 8), (" 8 ", 8), ("1GiB", 1 << 30),
                                    ("4MiB", 4 << 20), ("512B", 512), ("1T", 1 << 40), ("1.5M", 3 << 19),
                                    ("0.5K", 512), ("0", 0), ("9007199254740993", 9007199254740993)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["8X", "", "-1", "M", "1..5M", "1,5M", "8 K B x"])
def test_parse_size_rejects(text):
    with pytest.raises(UserError, match=f"bad size '{text}'"):
        parse_size(text)


def test_parse_sizes():
    assert parse_sizes("8:64") == [8, 16, 32, 64]
    assert parse_sizes("1K:1M:32") == [1024, 32768, 1 << 20]
    assert parse_sizes("8:1G:4")[:3] == [8, 32, 128] and parse_sizes("8:1G")[-1] == 1 << 30
    assert parse_sizes("1M,4MiB,1G") == [1 << 20, 4 << 20, 1 << 30]
    assert parse_sizes("64M") == [64 << 20]
    for bad in ("1X", "8:4", "8:64:1", "1:2:3:4", ",", "0:8"):
        with pytest.raises(UserError):
            parse_sizes(bad)


def test_human():
    assert [human(n) for n in (8, 1023, 1024, 1536, 64 << 20, 1 << 30, 3 << 29)] == \
        ["8B", "1023B", "1K", "1.5K", "64M", "1G", "1.5G"]


@pytest.mark.parametrize("n,factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (16, 1.875)])
def test_allreduce_bus_factor_is_2_n_minus_1_over_n(n, factor):
    assert bus_factor("allreduce", n) == pytest.approx(factor)


def test_bus_factors_of_the_other_collectives():
    assert bus_factor("allgather", 8) == bus_factor("reducescatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0
    with pytest.raises(UserError, match="collective 'alltoall'"):
        bus_factor("alltoall", 8)
