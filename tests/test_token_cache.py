import json
import multiprocessing as mp
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.common.errors import UserError
from dtrain.engine.data import BatchStream, Pairs, TokenBatcher
from dtrain.engine.token_cache import CachedPairs, cache_key, ensure, keep_mask, normalise
from dtrain.engine.tokenizer import train_or_load

WORDS = {"en": "the a house cat dog sits on table green small big runs river city old".split(),
         "de": "der die das Haus Katze Hund sitzt auf Tisch grün klein groß läuft Fluss Stadt alt".split()}


def synthetic_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Sentence pairs whose target is a word-for-word image of the source (so lengths correlate, as in real data)."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        idx = [rng.randrange(len(WORDS["en"])) for _ in range(rng.randint(2, 20))]
        src.append(" ".join(WORDS["en"][i] for i in idx).capitalize() + ".")
        tgt.append(" ".join(WORDS["de"][i] for i in idx).capitalize() + ".")
    return src, tgt


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    src, tgt = synthetic_pairs(3000)
    tokenizer = train_or_load(src, tgt, 64, root / "bpe")
    return root, src, tgt, tokenizer


def _triples(src, tgt):
    return ((f"f:{i + 1}", s, t) for i, (s, t) in enumerate(zip(src, tgt)))


def test_cached_pairs_hold_what_pairs_encode_makes(corpus, tmp_path):
    _, src, tgt, tok = corpus
    folder = ensure(tmp_path, "k", tok, _triples(src, tgt), clean=False, max_len=16, describe={})
    cached, direct = CachedPairs(folder), Pairs.encode(tok, src, tgt, max_len=16)
    assert 0 < len(cached) == len(direct) < len(src)  # max_len dropped some, the same ones
    for i in range(len(direct)):
        assert torch.equal(cached.src[i], direct.src[i]) and torch.equal(cached.tgt[i], direct.tgt[i])
    assert cached.lengths() == direct.lengths()
    assert isinstance(cached.src.tok, np.memmap)  # mapped, not loaded
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["stats"]["read"] == len(src) and meta["stats"]["dropped_max_len"] == len(src) - len(direct)


def test_cleaning_rule_is_clean_corpus_n_on_token_counts():
    s = np.array([1, 10, 10, 16, 0, 250, 251, 2])
    t = np.array([1, 15, 16, 10, 3, 250, 250, 3])
    # ratio exactly 1.5 stays, above goes; either side 0 or above 250 goes
    assert keep_mask(s, t).tolist() == [True, True, False, False, False, True, False, True]
    assert normalise(" a\tb\x00c\u200b ") == "a b c"  # category C characters become spaces, outer space goes


def test_cleaning_drops_pairs_end_to_end(corpus, tmp_path):
    _, src, tgt, tok = corpus
    src2, tgt2 = src[:100] + ["", "Cat.", "The"], tgt[:100] + ["Katze.", " ".join(["Haus"] * 40), "Die\x07"]
    folder = ensure(tmp_path, "k", tok, _triples(src2, tgt2), clean=True, max_len=None, describe={})
    cached = CachedPairs(folder)
    stats = cached.meta["stats"]
    n_src = np.diff(cached.src.off)
    n_tgt = np.diff(cached.tgt.off)
    assert keep_mask(n_src, n_tgt).all()  # what is left passes the rule
    assert stats["dropped_clean"] >= 2 and stats["kept"] + stats["dropped_clean"] == 103
    # the empty and the 40-word line are among the dropped: the last pair cached is the cleaned "The" / "Die"
    assert tok.decode([cached.tgt[len(cached) - 1][1:-1].tolist()]) == ["Die"]


def test_empty_sentence_without_cleaning_is_an_error_and_leaves_nothing(corpus, tmp_path):
    _, src, tgt, tok = corpus
    with pytest.raises(UserError, match=r"f:51: empty sentence"):
        ensure(tmp_path, "k", tok, _triples(src[:50] + [""], tgt[:51]), clean=False, max_len=None, describe={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lock"]


def _build_in_child(args):
    root, model, src, tgt, marker = args
    from dtrain.engine.tokenizer import Tokenizer

    def pairs():
        Path(marker, f"built-{os.getpid()}").touch()  # only the process that builds iterates the pairs
        yield from _triples(src, tgt)
    return str(ensure(Path(root), "shared", Tokenizer(model), pairs(), clean=False, max_len=None, describe={}))


@pytest.mark.slow
def test_ranks_of_a_node_build_the_cache_once(corpus, tmp_path):
    _, src, tgt, tok = corpus
    marker = tmp_path / "markers"
    marker.mkdir()
    args = (str(tmp_path / "cache"), str(tok.model_file), src, tgt, str(marker))
    with mp.get_context("spawn").Pool(3) as pool:
        folders = pool.map(_build_in_child, [args] * 3)
    assert len(set(folders)) == 1 and len(list(marker.iterdir())) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name] == []
    assert len(CachedPairs(Path(folders[0]))) == len(src)


def test_cache_key_follows_the_inputs(corpus, tmp_path):
    _, _, _, tok = corpus
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("x\n"), b.write_text("y\n")
    key = cache_key([a, b], tok.model_file, clean=True)
    assert key == cache_key([a, b], tok.model_file, clean=True)
    assert key != cache_key([a, b], tok.model_file, clean=False)
    a.write_text("x longer\n")
    assert key != cache_key([a, b], tok.model_file, clean=True)


def test_rank_shards_are_disjoint_and_complete_and_resume_gives_the_same_order(corpus, tmp_path):
    _, src, tgt, tok = corpus
    cached = CachedPairs(ensure(tmp_path, "k", tok, _triples(src, tgt), clean=False, max_len=None, describe={}))
    world, lengths = 3, cached.lengths()
    batchers = [TokenBatcher(lengths, 400, seed=5, rank=r, world_size=world) for r in range(world)]
    steps = batchers[0].steps_per_epoch(0)
    shards = [{i for s in range(steps) for i in b.rank_batch(0, s)} for b in batchers]
    assert all(not shards[a] & shards[c] for a in range(world) for c in range(a + 1, world))
    dropped = {i for batch in batchers[0].epoch_batches(0)[steps * world:] for i in batch}
    assert set().union(*shards, dropped) == set(range(len(cached)))

    def stream():
        return BatchStream(cached, TokenBatcher(lengths, 400, seed=5, rank=1, world_size=world))
    straight = stream()
    expected = [straight.next().src for _ in range(steps + 5)]  # crosses into epoch 1
    first = stream()
    for _ in range(steps - 2):
        first.next()
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    for want in expected[steps - 2:]:
        assert torch.equal(resumed.next().src, want)


def test_a_damaged_cache_is_a_one_line_error(corpus, tmp_path):
    _, src, tgt, tok = corpus
    folder = ensure(tmp_path, "k", tok, _triples(src[:10], tgt[:10]), clean=False, max_len=None, describe={})
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "pairs": 11}))
    with pytest.raises(UserError, match="inconsistent"):
        CachedPairs(folder)
