"""A profile stored in a trace by an older profiler lacks what later versions tell apart (the loss's
saved bytes, the column-wise linears' inputs): it is measured again where the user lets autopar
run the record's model code, and otherwise used as stored with one warning line, never silently."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import VTRAIN

import autopar.traces.models as trace_models
from autopar.calibrate.dataset import build_dataset, load_traces
from autopar.cli import main
from autopar.profile import profile_model
from autopar.profile.cache import PROFILER_VERSION
from autopar.traces.models import ModelSources
from autopar.traces.vtrain import CLUSTER, import_vtrain, write_records


@pytest.fixture(scope="module")
def fresh():
    return profile_model("gpt", {"size": "tiny"}, dtype="bf16")


def _old(profile) -> dict:
    """`profile` as profiler 8 wrote it: no version, no column-wise inputs."""
    blocks = [dataclasses.replace(b, entry_saved_bytes=0.0) for b in profile.blocks]
    d = dataclasses.replace(profile, blocks=tuple(blocks)).to_dict()
    del d["profiler"]
    for b in d["blocks"]:
        del b["entry_saved_bytes"]
    return d


def test_a_fresh_profile_is_used_as_stored(fresh, monkeypatch):
    monkeypatch.setattr(trace_models, "profile_model", lambda *a, **k: pytest.fail("re-profiled a fresh profile"))
    model = {"name": "gpt", "args": {"size": "tiny"}, "profile": fresh.to_dict()}
    assert fresh.profiler == PROFILER_VERSION
    assert ModelSources().profile(model, "bf16", "t.jsonl:1") == fresh


def test_an_old_profile_is_measured_again_from_the_bundled_code(fresh):
    model = {"name": "gpt", "args": {"size": "tiny"}, "profile": _old(fresh)}
    again = ModelSources().profile(model, "bf16", "t.jsonl:1")
    assert again.profiler == PROFILER_VERSION
    assert again.layers[0].entry_saved_bytes == fresh.layers[0].entry_saved_bytes > 0
    assert trace_models.stale_note(again, "t.jsonl:1") is None


def test_an_old_profile_without_its_code_is_used_and_named_in_one_warning(fresh, tmp_path, capsys):
    records = list(import_vtrain(VTRAIN / "ground_truth_single.csv", predict=False))
    records = [r for r in records if r.model == records[0].model][:12]  # twelve plans of one model
    megatron = profile_model(trace_models.resolve_model_path(records[0].model["path"]), records[0].model["args"],
                             dtype="fp16")
    # a user's file autopar may not run: the records carry only its stored (old) profile
    model = {**records[0].model, "path": str(tmp_path / "their_model.py"), "profile": _old(megatron)}
    traces = tmp_path / "old.jsonl"
    write_records(traces, [dataclasses.replace(r, model=model) for r in records])
    records, sources, _ = load_traces([traces])
    ds = build_dataset(records, CLUSTER, sources)
    assert ds.groups[0].workload.profile.profiler == ""
    assert len(ds.notes) == 1 and "old.jsonl:1: " in ds.notes[0] and "--model-file" in ds.notes[0]
    # the same file fitted and evaluated: still one line per stale record
    code = main(["calibrate", str(traces), "--cluster", CLUSTER, "--params", "gemm_efficiency", "--json",
                 "--evaluate", str(traces)])
    err = capsys.readouterr()
    assert code == 0
    assert [line for line in err.err.splitlines() if "stored profile" in line] == [f"autopar: warning: {ds.notes[0]}"]
    assert json.loads(err.out)["stale_profiles"] == ds.notes


def test_an_old_profile_whose_code_no_longer_takes_its_arguments_is_used_as_stored(fresh):
    """The bundled code may have dropped an argument the record was profiled with: the stored profile
    is priced as it is, with the warning, rather than the calibration stopping."""
    model = {"name": "gpt", "args": {"size": "tiny", "retired_arg": 1}, "profile": _old(fresh)}
    stored = ModelSources().profile(model, "bf16", "t.jsonl:1")
    assert stored.profiler == "" and stored.layers[0].entry_saved_bytes == 0.0
    assert "no longer takes those arguments" in trace_models.stale_note(stored, "t.jsonl:1")
