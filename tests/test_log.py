"""dtrain.log: what a run writes, and what a resume keeps of it."""

import json

from common.jsonl import read_jsonl
from dtrain.log import RunWriter, rank_file


def test_other_ranks_write_their_bucket_records_and_truncate_their_own_on_resume(tmp_path):
    (tmp_path / "run").mkdir()  # the trainer makes it before writing
    main, other = RunWriter(tmp_path / "run", True), RunWriter(tmp_path / "run", False, rank=1, rank_records=True)
    for step in (1, 2, 3):
        main.step({"step": step, "step_ms": 10.0})
        main.buckets(step, [{"bucket": 0, "ready_ms": 1.0}])
        other.buckets(step, [{"bucket": 0, "ready_ms": 2.0}])
    other.buckets(4, [])  # nothing to write: no empty lines either
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / rank_file(1))] == [1, 2, 3]
    assert read_jsonl(tmp_path / "run" / "buckets.jsonl")[0] == {"step": 1, "bucket": 0, "ready_ms": 1.0}
    # Resuming at step 2: rank 0 keeps its records up to 2 and counts the step to recompute; rank 1 its own.
    assert main.truncate_after(2) == 1
    assert other.truncate_after(2) == 0
    for name in ("steps.jsonl", "buckets.jsonl", rank_file(1)):
        assert [r["step"] for r in read_jsonl(tmp_path / "run" / name)] == [1, 2], name
    # A rank that never wrote records has nothing to truncate.
    assert RunWriter(tmp_path / "run", False, rank=2).truncate_after(1) == 0
    assert not (tmp_path / "run" / rank_file(2)).exists()
    assert json.loads((tmp_path / "run" / rank_file(1)).read_text().splitlines()[0])["ready_ms"] == 2.0


def test_a_line_torn_by_a_crash_is_dropped_and_any_other_bad_line_is_named(tmp_path):
    import pytest

    from common.errors import UserError

    p = tmp_path / "steps.jsonl"
    p.write_text('{"step": 1, "step_ms": 5.0}\n{"step": 2, "step_ms": 5.0}\n{"step": 3, "st')  # crash mid-write
    assert [r["step"] for r in read_jsonl(p)] == [1, 2]
    # A resume keeps the complete records and leaves a well-formed file.
    (tmp_path / "buckets.jsonl").write_text("")
    assert RunWriter(tmp_path, True).truncate_after(5) == 0
    assert p.read_text() == '{"step": 1, "step_ms": 5.0}\n{"step": 2, "step_ms": 5.0}\n'
    # A bad line with records after it is not a torn tail: an error naming the file and line, the file untouched.
    p.write_text('{"step": 1}\n{"step": 2,,}\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"steps.jsonl:2: not a JSON record"):
        read_jsonl(p)
    with pytest.raises(UserError, match=r"steps.jsonl:2: not a JSON record"):
        RunWriter(tmp_path, True).truncate_after(1)
    assert p.read_text() == '{"step": 1}\n{"step": 2,,}\n{"step": 3}\n'
    p.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"steps.jsonl:2: not a JSON object"):
        read_jsonl(p)
