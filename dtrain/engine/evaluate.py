"""Decode a split with beam search and score it with sacreBLEU; used at the end of training and on saved runs.

    python -m dtrain.engine.evaluate --run runs/<name> --split test          # averaged model if the run wrote one
    torchrun --nproc_per_node=2 -m dtrain.engine.evaluate --run runs/<name>  # sentences sharded over ranks
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from dtrain.collectives import dist as ddist
from dtrain.common.errors import UserError, exit_on_user_error
from dtrain.engine import checkpoint
from dtrain.engine import config as config_mod
from dtrain.engine import corpus as corpora
from dtrain.engine.bleu import corpus_bleu
from dtrain.engine.config import EvalConfig, RunConfig
from dtrain.engine.data import multi30k_split
from dtrain.engine.decode import translate
from dtrain.engine.log import RunWriter
from dtrain.engine.model import Transformer, sdpa_backend
from dtrain.engine.paper_bleu import tokenized_bleu
from dtrain.engine.startup import locate_corpus
from dtrain.engine.tokenizer import Tokenizer


def score_split(model: Transformer, tokenizer: Tokenizer, cfg: RunConfig, ecfg: EvalConfig, device) -> dict:
    """BLEU of `model` on `ecfg.split`; each rank decodes every world-th sentence, rank 0 gathers and scores.

    Returns the score record on rank 0 (hypotheses included under "hypotheses"), None elsewhere.
    """
    if cfg.data.corpus == "multi30k":
        directory = locate_corpus(cfg)  # found on rank 0, so a missing corpus is the same error on every rank
        src, ref = multi30k_split(directory, ecfg.split, cfg.data.src, cfg.data.tgt)
    else:
        src, ref = corpora.split_text(cfg.data, ecfg.split)
    rank, world = ddist.rank(), ddist.world_size()
    mine = list(range(rank, len(src), world))
    progress, what = None, f"decoding {ecfg.split} (rank 0)"
    # In a terminal a bar; elsewhere (a batch job's log file) a line when decoding starts and one when it ends
    # instead of the bar's redraws.
    plain = rank == 0 and not sys.stderr.isatty()
    if plain:
        print(f"{what}: {len(mine):,} sentences, beam {ecfg.beam}", file=sys.stderr, flush=True)
    elif rank == 0:
        progress = tqdm(total=len(mine), desc=what, unit="sent", leave=False)
    t0 = time.perf_counter()
    hyps = translate(model, tokenizer, [src[i] for i in mine], ecfg.beam, ecfg.length_penalty, ecfg.max_len_b,
                     ecfg.batch_size, device, progress)
    if progress is not None:
        progress.close()
    if plain:
        print(f"{what}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    shards = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(list(zip(mine, hyps)), shards, dst=0)
    else:
        shards = [list(zip(mine, hyps))]
    if rank != 0:
        return None
    ordered = [""] * len(src)
    for shard in shards:
        for i, h in shard:
            ordered[i] = h
    record = {"split": ecfg.split, "beam": ecfg.beam, "length_penalty": ecfg.length_penalty,
              "sentences": len(src), "decode_s": round(time.perf_counter() - t0, 1), **corpus_bleu(ordered, ref)}
    if cfg.data.corpus.startswith("wmt14-"):  # the paper's tokenized BLEU beside sacreBLEU's (docs/data.md)
        record["tokenized_bleu"] = tokenized_bleu(ordered, ref, cfg.data.tgt)
    record["hypotheses"] = ordered
    return record


def write_score(run_dir: Path, record: dict, **extra) -> dict:
    """Hypotheses to `<run>/hyps.<split>.txt`, the score (without them) appended to eval.jsonl; returns the latter."""
    hyps = record.pop("hypotheses")
    (Path(run_dir) / f"hyps.{record['split']}.txt").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    record = {"kind": "bleu", **extra, **record}
    RunWriter(run_dir, True).eval(record)
    return record


def load_model_for_eval(run_dir: Path, which: str, vocab: int, cfg: RunConfig) -> tuple[Transformer, str]:
    avg = Path(run_dir) / checkpoint.AVERAGED
    if which == "averaged" and avg.is_file():
        state, label = checkpoint.load(avg)["model"], "averaged"
    else:
        path = checkpoint.latest(run_dir)
        if path is None:
            raise UserError(f"{run_dir}: no complete checkpoint to evaluate")
        state, label = checkpoint.load(path)["model"], path.name
    model = Transformer.from_config(cfg.model, vocab)
    try:
        model.load_state_dict(state)
    except RuntimeError:
        raise UserError(f"{run_dir}: checkpoint does not fit the model in {run_dir}/config.yaml") from None
    return model, label


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dtrain.engine.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a run directory written by dtrain.engine.train")
    ap.add_argument("--split", choices=["val", "test"], default="test")
    ap.add_argument("--beam", type=int, help="beam size (default: the run's eval.beam; 1 = greedy)")
    ap.add_argument("--checkpoint", choices=["averaged", "latest"], default="averaged")
    args = ap.parse_args(argv)
    with exit_on_user_error("dtrain.engine.evaluate"):
        # Checked here: the run's eval section was validated with its profile, but this override bypasses that.
        if args.beam is not None and args.beam < 1:
            raise UserError(f"--beam must be at least 1 (1 = greedy), got {args.beam}")
        run_dir = Path(args.run)
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"{run_dir}: not a run directory (no config.yaml)")
        cfg = config_mod.load_recorded(run_dir / "config.yaml")
        overrides = {"split": args.split} | ({"beam": args.beam} if args.beam is not None else {})
        ecfg = EvalConfig(**{**cfg.eval.__dict__, **overrides})
        device, _ = ddist.init(cfg.collectives)
        if not (run_dir / "bpe.model").is_file():
            raise UserError(f"{run_dir}: no bpe.model (the run's tokenizer)")
        tokenizer = Tokenizer(run_dir / "bpe.model")
        model, label = load_model_for_eval(run_dir, args.checkpoint, tokenizer.vocab_size, cfg)
        with sdpa_backend(cfg.train.sdpa_backend, device):
            record = score_split(model.to(device), tokenizer, cfg, ecfg, device)
        if record is not None:
            record = write_score(run_dir, record, model=label)
            print(f"BLEU {record['bleu']} on {record['split']} ({record['sentences']} sentences, beam "
                  f"{record['beam']}, model {label}) {record['signature']}")
        ddist.cleanup()


if __name__ == "__main__":
    sys.exit(main())
