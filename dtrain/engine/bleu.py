"""sacreBLEU on detokenized output, with the signature that makes the score reproducible."""

from __future__ import annotations

from sacrebleu.metrics import BLEU


def bleu_metric() -> BLEU:
    """The one BLEU configuration (sacreBLEU's defaults: 13a tokenization, exponential smoothing, mixed case), shared
    by the score at the end of training and the significance tests run on saved translations."""
    return BLEU()


def corpus_bleu(hypotheses: list[str], references: list[str]) -> dict:
    """{"bleu": score, "signature": sacreBLEU's signature string, "details": brevity penalty and n-gram precisions}."""
    metric = bleu_metric()
    result = metric.corpus_score(hypotheses, [references])
    return {
        "bleu": round(result.score, 2),
        "signature": str(metric.get_signature()),
        "bp": round(result.bp, 4),
        "precisions": [round(p, 2) for p in result.precisions],
        "sys_len": result.sys_len,
        "ref_len": result.ref_len,
    }
