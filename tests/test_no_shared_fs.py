"""No shared filesystem between ranks: 2 gloo ranks, each started in its own folder (its "local disk"), so a relative
path names a different file on each rank, as one absolute path does on two machines. What rank 0 has on its disk
(the resume checkpoint, the averaged model, the BPE model it trained) must reach rank 1 through the process group;
a corpus that rank 1 lacks or holds in another version is the same one-line error on both ranks."""

import gzip
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO

from dtrain.engine import checkpoint

# Each decision, printed by each rank as one JSON object: its answer, or the error's type and message.
SCRIPT = textwrap.dedent('''
    import dataclasses, hashlib, json, sys
    from pathlib import Path
    from dtrain.collectives import dist as ddist
    from dtrain.engine import checkpoint, config, startup
    from dtrain.engine.data import multi30k_split
    cfg = config.load(sys.argv[1])
    ddist.init(cfg.collectives)
    def data(**kw):
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **kw))
    def outcome(fn):
        try:
            return {"ok": fn()}
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
    def tokenizer(c):
        src, tgt = multi30k_split(startup.locate_corpus(cfg), "val", "en", "de")
        tok = startup.shared_tokenizer(c, src, tgt)
        blob = tok.model_file.read_bytes()
        return {"file": str(tok.model_file.resolve()), "sha256": hashlib.sha256(blob).hexdigest(),
                "ids": tok.encode(["two dogs play in the snow"])}
    def resumed():
        path, state = startup.resume_state(Path("run"))
        return {"path": str(path), "visible here": path.is_file(), "step": state["step"],
                "w": state["model"]["w"].tolist(), "rng": state["rng"],
                "sync": [s and s["q"].tolist() for s in state["sync"]]}
    def averaged():
        model = checkpoint.average_on_main(Path("run"), 2)
        return {"w": model["w"].tolist(), "dtype": str(model["w"].dtype),
                "file here": Path("run/averaged.pt").is_file()}
    print(json.dumps({
        "corpus": outcome(lambda: str(startup.locate_corpus(cfg))),
        "other version": outcome(lambda: str(startup.locate_corpus(data(dir="own")))),
        "missing on rank 1": outcome(lambda: str(startup.locate_corpus(data(dir="only-rank-0")))),
        "tokenizer": outcome(lambda: tokenizer(cfg)),
        "tokenizer again": outcome(lambda: tokenizer(cfg)),
        "rank 1 cache blocked": outcome(lambda: tokenizer(data(cache_dir="cache"))),
        "resume": outcome(resumed),
        "nothing to resume": outcome(lambda: startup.resume_state(Path("no-run"))),
        "averaged": outcome(averaged),
        "nothing to average": outcome(lambda: checkpoint.average_on_main(Path("no-run"), 2)),
    }))
    ddist.cleanup()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks_on_own_disks(script, disks, envs, timeout=300) -> list[dict]:
    """Run `script` as ranks 0 and 1 of one job, rank r in folder disks[r] with envs[r] added; each rank's JSON."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(REPO / "dtrain" / "profiles" / "smoke.yaml")], cwd=disk,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                   "PYTHONPATH": str(REPO), **env})
             for r, (disk, env) in enumerate(zip(disks, envs))]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def _copy_corpus(src, dst, change_line=None):
    """The six files of `src` in `dst`, plain text; `change_line`: the first line of train.de altered."""
    dst.mkdir(parents=True)
    for f in src.glob("*.gz"):
        text = gzip.decompress(f.read_bytes())
        if change_line and f.name == "train.de.gz":
            text = change_line.encode() + b"\n" + text.split(b"\n", 1)[1]
        (dst / f.name.removesuffix(".gz")).write_bytes(text)


def _state(step: int, w: float) -> dict:
    """A training state as 3 ranks wrote it: "rng" and "sync" hold one entry per rank."""
    return {"step": step, "model": {"w": torch.full((3,), w)}, "optimizer": {}, "scheduler": {}, "data": {},
            "rng": [f"rank {r} at {step}" for r in range(3)], "sync": [{"q": torch.full((2,), r)} for r in range(3)],
            "model_hash": "h", "world_size": 3}


@pytest.mark.slow
def test_what_rank_0_has_reaches_rank_1_through_the_process_group(tmp_path, multi30k_dir):
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for d in disks:
        d.mkdir()
    caches = [tmp_path / "cache0", tmp_path / "cache1"]
    # Rank 0's disk: the run with two checkpoints, its Multi30k under $DTRAIN_DATA_DIR "data" (a relative path: a
    # folder rank 1 does not have), copies under data.dir "own" and "only-rank-0", a cache folder.
    _copy_corpus(multi30k_dir, disks[0] / "data" / "multi30k")
    for step, w in ((10, 1.0), (20, 2.0)):
        checkpoint.save(disks[0] / "run", step, _state(step, w), keep=5)
    _copy_corpus(multi30k_dir, disks[0] / "own")
    _copy_corpus(multi30k_dir, disks[0] / "only-rank-0")
    (disks[0] / "cache").mkdir()
    # Rank 1's disk: no run, its own Multi30k (another folder, plain text) found through $DTRAIN_DATA_DIR, another
    # version under "own", nothing under "only-rank-0", and a file where the cache folder should be.
    _copy_corpus(multi30k_dir, tmp_path / "node1-data" / "multi30k")
    _copy_corpus(multi30k_dir, disks[1] / "own", change_line="Zwei junge Männer.")
    (disks[1] / "cache").write_text("")
    script = tmp_path / "decide.py"
    script.write_text(SCRIPT)

    envs = [{"XDG_CACHE_HOME": str(caches[0]), "DTRAIN_DATA_DIR": "data"},
            {"XDG_CACHE_HOME": str(caches[1]), "DTRAIN_DATA_DIR": str(tmp_path / "node1-data")}]
    r0, r1 = _ranks_on_own_disks(script, disks, envs)

    # The corpus: each rank its own copy, checked to hold the same sentences.
    assert r0["corpus"] == {"ok": "data/multi30k"}
    assert r1["corpus"] == {"ok": str(tmp_path / "node1-data" / "multi30k")}
    for name, problem in (("other version", "rank 1: Multi30k at own differs from rank 0's at own; "),
                          ("missing on rank 1", "rank 1: data.dir only-rank-0: no Multi30k there (train.en, ")):
        assert r0[name] == r1[name], name
        assert r0[name]["error"] == "UserError" and r0[name]["message"].startswith(problem), r0[name]
        assert "\n" not in r0[name]["message"]

    # The BPE model: trained on rank 0, its bytes written into rank 1's own cache.
    t0, t1 = r0["tokenizer"]["ok"], r1["tokenizer"]["ok"]
    assert t0["file"].startswith(str(caches[0])) and t1["file"].startswith(str(caches[1]))
    assert os.path.basename(t0["file"]) == os.path.basename(t1["file"])
    assert t0["sha256"] == t1["sha256"] == hashlib.sha256(Path(t1["file"]).read_bytes()).hexdigest()
    assert t0["ids"] == t1["ids"] and len(t0["ids"][0]) > 1
    assert r1["tokenizer again"] == r1["tokenizer"]  # the copy already there is used as is
    assert r0["rank 1 cache blocked"] == r1["rank 1 cache blocked"]
    blocked = r1["rank 1 cache blocked"]
    assert blocked["error"] == "UserError" and blocked["message"].startswith("rank 1: cache/bpe/bpe-")
    assert "cannot write the BPE model into this node's cache" in blocked["message"]

    # The resume state: read on rank 0's disk only, where rank 1 cannot see it.
    s0, s1 = r0["resume"]["ok"], r1["resume"]["ok"]
    assert s0["path"] == s1["path"] == "run/checkpoints/step-0000020.pt"
    assert s0["visible here"] and not s1["visible here"]
    assert s0["step"] == s1["step"] == 20 and s0["w"] == s1["w"] == [2.0] * 3
    # Of the per-rank lists, rank 1 receives rank 0's entry and its own only.
    assert s0["rng"] == ["rank 0 at 20", "rank 1 at 20", "rank 2 at 20"]
    assert s1["rng"] == ["rank 0 at 20", "rank 1 at 20", None]
    assert s0["sync"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]] and s1["sync"] == [[0.0, 0.0], [1.0, 1.0], None]
    assert r0["nothing to resume"] == r1["nothing to resume"] == {"ok": [None, None]}

    # The averaged model: written on rank 0's disk only, its parameters sent to rank 1.
    a0, a1 = r0["averaged"]["ok"], r1["averaged"]["ok"]
    assert a0["w"] == a1["w"] == [1.5] * 3 and a0["dtype"] == a1["dtype"] == "torch.float32"
    assert a0["file here"] and not a1["file here"]
    assert checkpoint.load(disks[0] / "run" / "averaged.pt")["averaged"] == ["step-0000010.pt", "step-0000020.pt"]
    assert not (disks[1] / "run").exists()
    assert r0["nothing to average"] == r1["nothing to average"]
    assert r0["nothing to average"]["error"] == "JobFailure"
    assert r0["nothing to average"]["message"] == "no-run/checkpoints: no complete checkpoint to average"
