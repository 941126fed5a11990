"""What every rank needs before its first step: the corpus, the shared tokenizer and the checkpoint to resume from,
decided on rank 0 and shared through the process group, so that only one rank downloads or trains anything.

Each decision goes through `collectives.dist.main_decides`: rank 0 sends either its result or its error, so when it
fails (no corpus under data.dir, a failed download) every rank raises the same one-line UserError and exits alike,
instead of the others dying on a closed connection while rank 0 reports the cause.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from collectives import dist as ddist
from dtrain import checkpoint
from dtrain.config import RunConfig
from dtrain.data import Pairs, cache_root, multi30k_dir, multi30k_split
from dtrain.tokenizer import Tokenizer, train_or_load


class Corpus(NamedTuple):
    data_dir: Path
    tokenizer: Tokenizer
    train: Pairs  # encoded, cut to data.train_limit
    val: Pairs


def locate_corpus(cfg: RunConfig) -> Path:
    """Rank 0 finds (or downloads) the corpus; the others take its word, so only one rank ever downloads."""
    d = cfg.data
    return Path(ddist.main_decides(lambda: str(multi30k_dir(d.dir, d.cache_dir, d.src, d.tgt))))


def shared_tokenizer(cfg: RunConfig, src: list[str], tgt: list[str]) -> Tokenizer:
    """Rank 0 trains (or loads the cached) BPE model; the others load the file it names."""
    bpe_dir = cache_root(cfg.data.cache_dir) / "bpe"
    return Tokenizer(ddist.main_decides(
        lambda: str(train_or_load(src, tgt, cfg.data.vocab_size, bpe_dir).model_file)))


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The latest complete checkpoint of `run_dir` as rank 0 finds it, the same on every rank; None: there is none,
    start from step 0."""
    found = ddist.main_decides(lambda: str(checkpoint.latest(run_dir) or ""))
    return Path(found) if found else None


def load_corpus(cfg: RunConfig) -> Corpus:
    """The training and validation pairs, encoded with the BPE model trained on the whole training split."""
    d = cfg.data
    data_dir = locate_corpus(cfg)
    train_src, train_tgt = multi30k_split(data_dir, "train", d.src, d.tgt)
    tokenizer = shared_tokenizer(cfg, train_src, train_tgt)  # on the whole split, before train_limit
    if d.train_limit:
        train_src, train_tgt = train_src[: d.train_limit], train_tgt[: d.train_limit]
    train = Pairs.encode(tokenizer, train_src, train_tgt, d.max_len)
    val = Pairs.encode(tokenizer, *multi30k_split(data_dir, "val", d.src, d.tgt))
    return Corpus(data_dir, tokenizer, train, val)
