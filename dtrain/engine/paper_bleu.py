"""BLEU as the Transformer paper reports it, beside sacreBLEU's: tokenised BLEU with compound splitting.

The paper's newstest2014 scores come from tensor2tensor's utils/get_ende_bleu.sh:

1. the system output goes through Moses' replace-unicode-punctuation.perl, then both it and the reference through
   Moses' tokenizer.perl (-l <target language>; default options: HTML-escaping on, aggressive hyphen splitting off);
2. every hyphen between two non-space characters is split out as `##AT##-##AT##`
   (perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g': "rich-text" → "rich ##AT##-##AT## text"), the convention of
   the Stanford NMT and GNMT papers that the paper's table compares with;
3. Moses' multi-bleu.perl: case-sensitive BLEU over whitespace tokens, one reference, no smoothing.

sacreBLEU (Post, 2018, "A Call for Clarity in Reporting BLEU Scores") scores detokenised text with its own fixed
tokenisation and prints a signature. The two differ, and the tokenised one is higher on German, mainly because
step 2 turns one token ("Rich-Text-Format") into several that are easy to get right. docs/data.md says more.
Moses' scripts are reimplemented by `sacremoses`; multi-bleu.perl is small enough to restate here.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from dtrain.common.errors import UserError
from dtrain.engine.bleu import corpus_bleu

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """get_ende_bleu.sh's perl substitution; like perl's s///g, matches do not overlap ("a-b-c" keeps its 2nd)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1))


def multi_bleu(hypotheses: list[str], references: list[str]) -> dict:
    """multi-bleu.perl with one reference: clipped n-gram precisions (n = 1..4) summed over the corpus, their
    geometric mean, times the brevity penalty exp(1 − r/c) when the output is shorter (c < r); 0 when any
    precision is 0 (the script's log(0) stands in as a huge negative number)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    correct, total = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hn, rn = _ngrams(h, n), _ngrams(r, n)
            correct[n - 1] += sum(min(c, rn[g]) for g, c in hn.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    precisions = [c / t if t else 0.0 for c, t in zip(correct, total)]
    bp = math.exp(1 - ref_len / hyp_len) if 0 < hyp_len < ref_len else (1.0 if hyp_len else 0.0)
    score = bp * math.exp(sum(math.log(p) for p in precisions) / 4) if all(precisions) else 0.0
    return {"bleu": round(100 * score, 2), "bp": round(bp, 4), "precisions": [round(100 * p, 2) for p in precisions],
            "sys_len": hyp_len, "ref_len": ref_len}


def _moses():
    """sacremoses' normalizer and tokenizer classes. sacremoses is the `wmt` extra: only runs on WMT14, scored as the
    paper scores them, import it, and `check_available` lets them fail at start rather than after training."""
    try:
        from sacremoses import MosesPunctNormalizer, MosesTokenizer
    except ModuleNotFoundError:
        raise UserError("data.corpus wmt14-*: the paper's tokenized BLEU needs sacremoses: "
                        "pip install 'dtrain[wmt]'") from None
    return MosesPunctNormalizer, MosesTokenizer


def check_available() -> None:
    _moses()


def tokenize(lines: list[str], lang: str, replace_punct: bool) -> list[str]:
    """Moses tokenisation (step 1) and compound splitting (step 2) of detokenised lines."""
    MosesPunctNormalizer, MosesTokenizer = _moses()
    tok = MosesTokenizer(lang=lang)
    norm = MosesPunctNormalizer(lang=lang)
    out = []
    for line in lines:
        if replace_punct:
            line = norm.replace_unicode_punct(line)
        out.append(split_compounds(tok.tokenize(line, return_str=True, escape=True)))
    return out


def tokenized_bleu(hypotheses: list[str], references: list[str], lang: str) -> dict:
    """The paper's score: get_ende_bleu.sh's three steps on detokenised output and raw references."""
    result = multi_bleu(tokenize(hypotheses, lang, replace_punct=True), tokenize(references, lang, False))
    result["signature"] = f"tokenized-bleu|moses-tok:{lang}|compound-split:##AT##|multi-bleu.perl"
    return result


def paper_scores(hypotheses: list[str], references: list[str], lang: str) -> dict:
    """Both scores, each labelled: {"sacrebleu": ..., "tokenized_bleu": ...} (each with "bleu" and "signature")."""
    return {"sacrebleu": corpus_bleu(hypotheses, references),
            "tokenized_bleu": tokenized_bleu(hypotheses, references, lang)}
