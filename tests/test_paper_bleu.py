import random

import pytest
from sacrebleu.metrics import BLEU

from dtrain.engine.paper_bleu import multi_bleu, paper_scores, split_compounds, tokenize, tokenized_bleu


def test_compound_splitting_follows_the_perl_substitution():
    assert split_compounds("rich-text format") == "rich ##AT##-##AT## text format"
    # s///g does not rescan what it replaced: the second hyphen of a-b-c shares its left character with the first
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_compounds("x - y -z w-") == "x - y -z w-"  # a hyphen next to a space is left alone


def test_multi_bleu_brevity_penalty_and_zero_precision():
    # four of five reference words, all n-grams right: 100 · exp(1 − 5/4)
    r = multi_bleu(["a b c d"], ["a b c d e"])
    assert r["precisions"] == [100.0, 100.0, 100.0, 100.0]
    assert r["bleu"] == pytest.approx(100 * 2.718281828 ** (1 - 5 / 4), abs=0.01)
    assert multi_bleu(["a b c"], ["a b c"])["bleu"] == 0.0  # no 4-grams at all: precision 0, so BLEU 0
    assert multi_bleu(["The cat"], ["the cat"])["precisions"][0] == 50.0  # case-sensitive


def test_multi_bleu_agrees_with_sacrebleu_on_pretokenised_text():
    rng = random.Random(0)
    words = "der die das und ist ein Haus Katze sitzt auf dem Tisch".split()
    refs = [" ".join(rng.choices(words, k=rng.randint(6, 15))) for _ in range(50)]
    hyps = [" ".join(w if rng.random() < 0.7 else rng.choice(words) for w in r.split()[: rng.randint(4, 15)])
            for r in refs]
    ours = multi_bleu(hyps, refs)
    theirs = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(hyps, [refs])
    assert ours["bleu"] == pytest.approx(theirs.score, abs=0.01)
    assert ours["sys_len"] == theirs.sys_len and ours["ref_len"] == theirs.ref_len


def test_moses_tokenisation_escapes_and_splits_punctuation():
    assert tokenize(["Das kostet 3,5 % & mehr."], "de", False) == ["Das kostet 3,5 % &amp; mehr ."]
    # the output (only) has its Unicode punctuation replaced first, as get_ende_bleu.sh does
    assert tokenize(["ein，Test"], "de", True) == ["ein , Test"]


def test_both_scores_are_labelled_and_compound_splitting_raises_the_tokenised_one():
    hyps, refs = ["Das ist ein Rich-Text-Format ."], ["Das ist ein Rich-Text-Dokument ."]
    scores = paper_scores(hyps, refs, "de")
    assert scores["sacrebleu"]["signature"].startswith("nrefs:1|case:mixed")
    assert scores["tokenized_bleu"]["signature"].startswith("tokenized-bleu|moses-tok:de")
    # the split compound shares "Rich ##AT##-##AT## Text ##AT##-##AT##" with the reference: more matching n-grams
    assert scores["tokenized_bleu"]["bleu"] > scores["sacrebleu"]["bleu"]
    assert tokenized_bleu(refs, refs, "de")["bleu"] == 100.0
