"""Start-up decisions taken on rank 0 (corpus, tokenizer, checkpoint to resume from) on 2 gloo ranks: the same answer
on every rank, and when rank 0 fails, the same one-line error and exit status on every rank."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _two_ranks(args: list[str], timeout=300) -> list[subprocess.CompletedProcess]:
    """`python <args>` as ranks 0 and 1 of one job, each with torchrun's environment, so each rank's own exit status
    and output can be read apart (torchrun stops the other workers once it sees one exit)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outputs)]
    finally:
        for p in procs:  # a rank left waiting for its peer (the failure these tests look for) is not left behind
            if p.poll() is None:
                p.kill()
                p.wait()


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def _train_args(tmp_path, *extra):
    return ["-m", "dtrain.engine.train", "--profile", "dtrain/profiles/smoke.yaml", "--run-dir", str(tmp_path / "run"), *extra]


@pytest.mark.slow
def test_named_data_dir_without_corpus_fails_alike_on_both_ranks(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    ranks = _two_ranks(_train_args(tmp_path, "--set", f"data.dir={empty}"))
    lines = [_error_lines(r.stderr) for r in ranks]
    for r, found in zip(ranks, lines):
        assert r.returncode == 2, r.stderr[-3000:]
        assert "Traceback" not in r.stderr and "Connection closed" not in r.stderr, r.stderr[-3000:]
        assert len(found) == 1, r.stderr[-3000:]
    assert lines[0] == lines[1]
    assert re.fullmatch(rf"dtrain\.engine\.train: error: data\.dir {re.escape(str(empty))}: no Multi30k there "
                        r"\(train\.en, train\.de, .*\); fix data\.dir or leave it unset", lines[0][0]), lines[0][0]


@pytest.mark.slow
def test_under_torchrun_both_ranks_report_the_same_line_and_exit_2(tmp_path):
    # torchrun stops the remaining workers (SIGTERM) when its monitor, polling every 5 s here, finds one exited. A
    # rank's own handler only records a SIGTERM, but once the interpreter is finalizing (the error line printed, the
    # exit under way) the default action is back: a poll that falls between the two ranks' exits on a loaded machine
    # ends the later one with -15. So the first rank torchrun saw fail must have exited 2, any other 2 or -15; the
    # line itself comes from each rank's log.
    empty, logs = tmp_path / "empty", tmp_path / "logs"
    empty.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=5",
           "--log-dir", str(logs), "--redirects", "3", *_train_args(tmp_path, "--set", f"data.dir={empty}")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert r.returncode != 0
    status = r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (-?\d+)"
    statuses = dict(re.findall(status, r.stderr))
    root = re.findall(status, r.stderr.split("Root Cause", 1)[-1])
    assert set(statuses) == {"0", "1"} and len(root) == 1 and root[0][1] == "2", r.stderr[-3000:]
    assert all(code == "2" or (code == "-15" and rank != root[0][0]) for rank, code in statuses.items()), \
        r.stderr[-3000:]
    per_rank = [sorted(logs.glob(f"*/attempt_0/{rank}/stderr.log")) for rank in (0, 1)]
    assert all(len(p) == 1 for p in per_rank), list(logs.rglob("*"))
    texts = [p[0].read_text() for p in per_rank]
    assert all("Traceback" not in t and "Connection closed" not in t for t in texts), texts
    lines = [_error_lines(t) for t in texts]
    assert len(lines[0]) == 1 and lines[0] == lines[1], texts
    assert f"data.dir {empty}: no Multi30k there" in lines[0][0]


# Run as both ranks: each start-up decision, printed as one JSON line per decision (its answer or its error).
DECISIONS = textwrap.dedent('''
    import dataclasses, json, sys
    from pathlib import Path
    from dtrain.collectives import dist as ddist
    from dtrain.engine import config, startup
    cfg = config.load("dtrain/profiles/smoke.yaml")
    ddist.init(cfg.collectives)
    good_run, empty_run, broken_run, blocked_cache = sys.argv[1:5]
    def outcome(fn):
        try:
            return {"ok": str(fn())}
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
    print(json.dumps({
        "corpus": outcome(lambda: startup.locate_corpus(cfg)),
        "resume": outcome(lambda: startup.resume_checkpoint(Path(good_run))),
        "no checkpoint": outcome(lambda: startup.resume_checkpoint(Path(empty_run))),
        "unreadable checkpoint": outcome(lambda: startup.resume_checkpoint(Path(broken_run))),
        "tokenizer": outcome(lambda: startup.shared_tokenizer(
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=blocked_cache)),
            ["a b c"], ["d e f"])),
    }))
    ddist.cleanup()
''')


@pytest.mark.slow
def test_each_decision_is_rank_0s_on_both_ranks(tmp_path, multi30k_dir):
    import torch

    from dtrain.engine import checkpoint

    good = checkpoint.save(tmp_path / "good", 10, {"step": 10, "model": {"w": torch.zeros(1)}}, keep=1)
    broken = tmp_path / "broken" / "checkpoints" / "step-0000010.pt"
    broken.mkdir(parents=True)  # a folder where the file should be: reading it fails on rank 0
    broken.with_name(broken.name + ".sha256").write_text("0  step-0000010.pt\n")
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("")
    script = tmp_path / "decisions.py"
    script.write_text(DECISIONS)
    ranks = _two_ranks([str(script), str(tmp_path / "good"), str(tmp_path / "empty"), str(tmp_path / "broken"),
                        str(blocked)])
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
    answers = [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]
    assert answers[0] == answers[1]
    got = answers[0]
    assert got["corpus"] == {"ok": str(multi30k_dir)}
    assert got["resume"] == {"ok": str(good)}
    assert got["no checkpoint"] == {"ok": "None"}
    assert got["unreadable checkpoint"]["error"] == "UserError"
    assert str(broken) in got["unreadable checkpoint"]["message"]
    assert got["tokenizer"]["error"] == "UserError" and str(blocked) in got["tokenizer"]["message"]
