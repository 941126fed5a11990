import gzip
import random

import pytest

from dtrain.engine.data import TokenBatcher, multi30k_split, pack, read_parallel
from dtrain.common.errors import UserError


def _lengths(n=500, seed=0):
    rng = random.Random(seed)
    return [rng.randint(3, 40) for _ in range(n)]


def test_every_pair_exactly_once_per_epoch():
    lengths = _lengths()
    b = TokenBatcher(lengths, max_tokens=200, seed=1)
    for epoch in range(3):
        seen = [i for batch in b.epoch_batches(epoch) for i in batch]
        assert sorted(seen) == list(range(len(lengths)))


def test_batches_respect_the_token_budget_and_are_length_sorted():
    lengths = _lengths()
    for batch in TokenBatcher(lengths, max_tokens=200, seed=1).epoch_batches(0):
        assert max(lengths[i] for i in batch) * len(batch) <= 200
        ls = [lengths[i] for i in batch]
        assert ls == sorted(ls)


def test_rank_shards_are_disjoint_and_cover_the_epoch():
    lengths = _lengths()
    world = 3
    ranks = [TokenBatcher(lengths, 200, seed=7, rank=r, world_size=world) for r in range(world)]
    steps = ranks[0].steps_per_epoch(0)
    assert all(r.steps_per_epoch(0) == steps for r in ranks)
    per_rank = [{i for s in range(steps) for i in r.rank_batch(0, s)} for r in ranks]
    for a in range(world):
        for c in range(a + 1, world):
            assert not per_rank[a] & per_rank[c]
    total = len(ranks[0].epoch_batches(0))
    covered = set().union(*per_rank)
    dropped = [i for batch in ranks[0].epoch_batches(0)[steps * world :] for i in batch]
    assert total - steps * world < world  # at most world - 1 batches dropped
    assert covered | set(dropped) == set(range(len(lengths)))


def test_order_is_a_pure_function_of_seed_and_epoch():
    lengths = _lengths()
    a, b = TokenBatcher(lengths, 200, seed=3), TokenBatcher(lengths, 200, seed=3)
    b.epoch_batches(5)  # a different history must not matter
    assert a.epoch_batches(1) == b.epoch_batches(1)
    assert a.epoch_batches(1) != a.epoch_batches(2)
    assert a.epoch_batches(1) != TokenBatcher(lengths, 200, seed=4).epoch_batches(1)


def test_pack_starts_new_batch_when_budget_exceeded():
    assert pack([0, 1, 2], [5, 5, 10], 10) == [[0, 1], [2]]


def _write(path, lines, gz=True, raw=None):
    data = raw if raw is not None else ("\n".join(lines) + "\n").encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def test_read_parallel_gzip_and_plain(tmp_path):
    _write(tmp_path / "a.en.gz", ["a b", "c"])
    _write(tmp_path / "a.de", ["x y", "z"], gz=False)
    assert read_parallel(tmp_path / "a.en.gz", tmp_path / "a.de") == (["a b", "c"], ["x y", "z"])


def test_bad_corpora_name_file_and_line(tmp_path):
    _write(tmp_path / "a.en.gz", ["one", "two", "three"])
    _write(tmp_path / "a.de.gz", ["eins", "zwei"])
    with pytest.raises(UserError, match=r"a.de.gz:3: line counts differ"):
        read_parallel(tmp_path / "a.en.gz", tmp_path / "a.de.gz")
    _write(tmp_path / "b.de.gz", None, raw=b"gut\n\xff\xfe kaputt\nnoch\n")
    with pytest.raises(UserError, match=r"b.de.gz:2: not valid UTF-8"):
        read_parallel(tmp_path / "a.en.gz", tmp_path / "b.de.gz")
    with pytest.raises(UserError, match=r"missing.en.gz: file not found"):
        read_parallel(tmp_path / "missing.en.gz", tmp_path / "a.de.gz")
    _write(tmp_path / "e.en.gz", None, raw=b"")
    _write(tmp_path / "e.de.gz", None, raw=b"")
    with pytest.raises(UserError, match=r"e.en.gz: empty split"):
        read_parallel(tmp_path / "e.en.gz", tmp_path / "e.de.gz")


def test_multi30k_splits(multi30k_dir):
    src, tgt = multi30k_split(multi30k_dir, "test", "en", "de")
    assert len(src) == len(tgt) == 1000
    src, tgt = multi30k_split(multi30k_dir, "val", "en", "de")
    assert len(src) == 1014


def test_multi30k_lookup_order_and_no_network(tmp_path, monkeypatch, multi30k_dir):
    from dtrain.engine import data

    monkeypatch.setenv("DTRAIN_DATA_DIR", str(multi30k_dir.parent))
    assert data.multi30k_dir(None, str(tmp_path / "cache")) == multi30k_dir
    # Nothing anywhere and no network: a one-line error naming where it looked, nothing half-downloaded left.
    monkeypatch.delenv("DTRAIN_DATA_DIR")

    def no_network(*a, **k):
        raise data.urllib.error.URLError("no route to host")

    monkeypatch.setattr(data.urllib.request, "urlopen", no_network)
    with pytest.raises(UserError, match="Multi30k not found .* download of train.en.gz failed"):
        data.multi30k_dir(None, str(tmp_path / "cache"))
    assert not list((tmp_path / "cache" / "multi30k").glob("*"))
    # With no data.dir and no DTRAIN_DATA_DIR, the cache is the one place searched, and the message says so.
    with pytest.raises(UserError, match=r"\(searched [^,]*cache/multi30k\) and download"):
        data.multi30k_dir(None, str(tmp_path / "cache"))


def test_named_data_dir_must_hold_the_corpus(tmp_path, monkeypatch, multi30k_dir):
    from dtrain.engine import data

    # The folder itself or its multi30k/ subfolder.
    assert data.multi30k_dir(str(multi30k_dir), str(tmp_path / "cache")) == multi30k_dir
    assert data.multi30k_dir(str(multi30k_dir.parent), str(tmp_path / "cache")) == multi30k_dir

    def no_download(*a, **k):
        raise AssertionError("a named data.dir must not lead to a download")

    monkeypatch.setattr(data.urllib.request, "urlopen", no_download)
    # A named folder without the files is an error even though $DTRAIN_DATA_DIR holds them: no silent fallback.
    monkeypatch.setenv("DTRAIN_DATA_DIR", str(multi30k_dir.parent))
    nowhere = tmp_path / "nowhere"
    with pytest.raises(UserError, match=rf"^data.dir {nowhere}: no Multi30k there \(train.en, train.de, val.en, "
                                        r"val.de, test_2016_flickr.en, test_2016_flickr.de missing from "):
        data.multi30k_dir(str(nowhere), str(tmp_path / "cache"))
    # A partial copy in its multi30k/ folder: the message lists what that copy lacks.
    partial = tmp_path / "partial" / "multi30k"
    partial.mkdir(parents=True)
    for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz"):
        (partial / name).write_bytes((multi30k_dir / name).read_bytes())
    (partial / "test_2016_flickr.en").write_text("a plain-text file counts too\n")
    with pytest.raises(UserError, match=rf"\(test_2016_flickr.de missing from {partial}, as .gz or plain text\)"):
        data.multi30k_dir(str(partial.parent), str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
