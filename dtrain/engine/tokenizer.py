"""Joint SentencePiece BPE over source and target: trained once on the training split, cached by corpus hash.

Sits between the raw corpus (`dtrain.engine.data.read_parallel`) and token batching. Ids: 0 pad, 1 unk, 2 bos, 3 eos.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import sentencepiece as spm

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class Tokenizer:
    def __init__(self, model_file: str | Path):
        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, lines: list[str]) -> list[list[int]]:
        return self.sp.encode(lines, out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Token ids → detokenized text (SentencePiece restores the original spacing)."""
        return self.sp.decode(ids)


def corpus_hash(lines_src: list[str], lines_tgt: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines_src + ["\0"] + lines_tgt:
        h.update(line.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:16]


def train_or_load(lines_src: list[str], lines_tgt: list[str], vocab_size: int, cache_dir: Path) -> Tokenizer:
    """Return the cached BPE model for this corpus and size, training it first if needed.

    Written to a temporary name and renamed, so concurrent or interrupted runs never see half a model.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"bpe-{corpus_hash(lines_src, lines_tgt)}-{vocab_size}.model"
    if target.exists():
        return Tokenizer(target)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        text = Path(tmp) / "train.txt"
        text.write_text("\n".join(lines_src + lines_tgt) + "\n", encoding="utf-8")
        prefix = Path(tmp) / "bpe"
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
            character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            num_threads=os.cpu_count() or 1, minloglevel=2, hard_vocab_limit=False,
        )
        os.replace(f"{prefix}.model", target)
    return Tokenizer(target)
