"""Trace records: schema round trip, clear errors, atomic appends, malformed lines reported."""

import json
import multiprocessing

import pytest

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.traces import TRACE_SCHEMA_VERSION, TraceRecord, append_record, read_records


def make_record(outcome="ok", **measured) -> TraceRecord:
    measured = measured or {"step_times_s": [0.1, 0.2], "median_step_s": 0.15, "tokens_per_s": 100.0,
                            "peak_memory_bytes": [1, 2], "losses": [5.0, 4.0]}
    return TraceRecord(
        cluster={"name": "local-cpu", "nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "backend": "gloo"},
        model={"name": "gpt", "path": "gpt.py", "digest": "ab", "args": {}, "dims": {"hidden": 64}, "params": 10},
        workload={"global_batch": 8, "seq_len": 32},
        plan=Plan(dp=2, tp=1, pp=1, micro_batch_size=4, num_micro_batches=1).to_dict(),
        outcome=outcome, measured=measured if outcome == "ok" else {},
        error=None if outcome == "ok" else "boom")


def test_round_trip_keeps_every_field():
    record = make_record()
    again = TraceRecord.from_dict(json.loads(record.to_json()))
    assert again == record
    assert again.schema_version == TRACE_SCHEMA_VERSION
    assert set(again.versions) == {"autopar", "torch", "python", "backend"}
    assert Plan.from_dict(again.plan).dp == 2


def test_unknown_schema_version_and_keys_are_refused():
    d = make_record().to_dict()
    with pytest.raises(AutoparError, match="schema_version is 99"):
        TraceRecord.from_dict({**d, "schema_version": 99})
    with pytest.raises(AutoparError, match=r"unknown trace key\(s\) \['bogus'\]"):
        TraceRecord.from_dict({**d, "bogus": 1})
    del d["plan"]
    with pytest.raises(AutoparError, match="missing key"):
        TraceRecord.from_dict(d)


def test_outcome_is_checked():
    with pytest.raises(AutoparError, match="outcome must be one of"):
        make_record(outcome="crashed")
    with pytest.raises(AutoparError, match="median_step_s"):
        make_record(losses=[1.0])
    for outcome in ("oom", "timeout", "error"):
        assert make_record(outcome=outcome).error == "boom"


def test_malformed_lines_are_reported_with_line_numbers_and_the_rest_is_kept(tmp_path):
    path = tmp_path / "t.jsonl"
    append_record(path, make_record())
    with open(path, "a") as f:
        f.write('{"half a line\n')
        f.write(json.dumps({**make_record().to_dict(), "schema_version": 7}) + "\n")
        f.write("\n")
    append_record(path, make_record(outcome="timeout"))
    records, problems = read_records(path)
    assert [r.outcome for r in records] == ["ok", "timeout"]
    assert [p.line for p in problems] == [2, 3]
    assert "not valid JSON" in problems[0].message and "schema_version is 7" in problems[1].message
    assert str(problems[0]).startswith(f"{path}:2: ")
    with pytest.raises(AutoparError, match=r"2 malformed trace line\(s\).*t\.jsonl:2"):
        read_records(path, strict=True)


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(make_record().to_json()[:40])  # a writer died mid-line, no newline
    append_record(path, make_record())
    records, problems = read_records(path)
    assert len(records) == 1 and [p.line for p in problems] == [1]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(AutoparError, match="cannot read trace file"):
        read_records(tmp_path / "none.jsonl")


def _append_many(path, n):
    for _ in range(n):
        append_record(path, make_record(losses=list(range(2000)), median_step_s=0.1, peak_memory_bytes=[1]))


@pytest.mark.slow
def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "t.jsonl"
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_append_many, args=(path, 25)) for _ in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    records, problems = read_records(path)
    assert problems == [] and len(records) == 100
