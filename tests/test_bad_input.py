"""Bad input at the boundary: Hypothesis over the data-file schemas (plan, cluster coefficients,
trace records, nesting depth), and the concrete cases of experiments/bad_input_campaign.py that
need no child process to time out, run in-process through the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cli import main
from autopar.cluster.io import cluster_from_dict
from autopar.cost.coefficients import Coefficients
from autopar.errors import AutoparError, PlanError
from autopar.plan import Plan
from autopar.schema import MAX_DEPTH, Anything, SchemaError, check
from autopar.traces.record import read_records

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bad_input_campaign", ROOT / "experiments" / "bad_input_campaign.py")
campaign = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = campaign  # dataclasses look their module up while the file runs
spec.loader.exec_module(campaign)

# any JSON value, odd numbers included (huge integers, nan, inf, tiny floats, bools)
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**40), max_value=10**40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                    st.sampled_from([0, 1, -1, 2**63, 1e-9, 1e308, "2", "1f1b", "bf16"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                           max_leaves=8)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_line(e: BaseException) -> bool:
    return "\n" not in str(e) and len(str(e)) < 600


# -- schemas: accepted values are well-typed, everything else is one AutoparError line ---------------------
VALID_PLAN = Plan(dp=2, tp=1, pp=2, micro_batch_size=1, num_micro_batches=4).to_dict()


@FUZZ
@given(key=st.sampled_from(sorted(VALID_PLAN)), value=json_values)
def test_a_plan_field_of_any_value_is_accepted_typed_or_refused_in_one_line(key, value):
    try:
        plan = Plan.from_dict({**VALID_PLAN, key: value})
    except PlanError as e:
        assert one_line(e)
        return
    for name in ("dp", "tp", "pp", "micro_batch_size", "num_micro_batches", "recompute_blocks", "virtual_stages"):
        assert type(getattr(plan, name)) is int
    assert isinstance(plan.bucket_mb, float) and math.isfinite(plan.bucket_mb) and plan.bucket_mb >= 0.1
    assert all(type(n) is int and n >= 1 for n in plan.layer_split)


COEFFICIENTS = ("gemm_efficiency", "gemm_half_flops", "host_overlap", "dp_overlap", "link_efficiency",
                "collective_efficiency", "step_overhead_s", "latency_scale", "workspace_bytes")


@FUZZ
@given(key=st.sampled_from(COEFFICIENTS), value=json_values)
def test_a_coefficient_of_any_value_is_accepted_finite_or_refused_in_one_line(key, value):
    try:
        cluster = cluster_from_dict({"preset": "cpu", "coefficients": {key: value}})
        c = Coefficients.from_dict(cluster.coefficients)  # the cost model checks what the cluster carries
    except AutoparError as e:
        assert one_line(e) and key in str(e)
        return
    numbers = [v for v in c.to_dict().values() if isinstance(v, float)]
    numbers += [v for d in (c.link_efficiency, c.collective_efficiency) for v in d.values()]
    assert all(math.isfinite(x) and x >= 0 for x in numbers)
    assert c.host_overlap >= 1 and 0 < c.gemm_efficiency <= 1


RECORD = campaign.trace_cases()[0].files["t.jsonl"][1][0]
RECORD = {**RECORD, "model": {**RECORD["model"], "path": None, "name": "gpt"}}


@FUZZ
@given(section=st.sampled_from(["cluster", "model", "workload", "measured", "predicted", "outcome", "plan"]),
       key=st.sampled_from(["nodes", "gpus_per_node", "name", "global_batch", "seq_len", "median_step_s", "losses",
                            "dp", "bucket_mb", "args", "step_times_s"]), value=json_values)
def test_a_mistyped_trace_line_is_skipped_with_its_reason_and_the_rest_kept(section, key, value, tmp_path_factory):
    bad = json.loads(json.dumps(RECORD))
    if isinstance(bad[section], dict):
        bad[section][key] = value
    else:
        bad[section] = value
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    lines = [json.dumps(RECORD), json.dumps(bad, allow_nan=True), json.dumps(RECORD)[:40]]  # a torn last line
    path.write_text("\n".join(lines) + "\n")
    records, problems = read_records(path)
    assert len(records) + len(problems) == 3 and records[0].to_dict() == read_records(path)[0][0].to_dict()
    assert [p.line for p in problems][-1] == 3 and all(one_line(Exception(p.message)) for p in problems)
    if len(records) == 2:  # accepted: the values the readers use have their types
        r = records[1]
        assert type(r.workload["global_batch"]) is int and r.workload["global_batch"] >= 1
        assert r.outcome != "ok" or (isinstance(r.measured["median_step_s"], float)
                                     and r.measured["median_step_s"] > 0)


@given(depth=st.integers(min_value=1, max_value=3 * MAX_DEPTH))
def test_nesting_is_refused_exactly_beyond_the_limit(depth):
    value = []
    for _ in range(depth - 1):
        value = [value]
    if depth > MAX_DEPTH:
        with pytest.raises(SchemaError, match=f"nested more than {MAX_DEPTH} levels"):
            check(value, Anything(), "doc")
    else:
        check(value, Anything(), "doc")


# -- the campaign's concrete cases, in-process -----------------------------------------------------------
FAST = [c for c in campaign.all_cases() if not c.slow and c.name.split("/")[0] in
        {"cluster", "plan", "search", "estimate", "memory", "output", "policy", "trust", "workloads"}
        and not c.name.startswith(("output/train/", "output/traces_collect/", "output/profile_cluster/",
                                   "trust/train", "output/calibrate"))]


@pytest.mark.parametrize("case", FAST, ids=[c.name for c in FAST])
def test_campaign_case_is_one_line_exit_2_and_touches_nothing(case, tmp_path, capsys):
    campaign.materialise(case, tmp_path)
    before = campaign.snapshot(tmp_path)
    code = main(case.command(tmp_path))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith("autopar: error: ")]
    assert code == 2 and len(errors) == 1 and err[-1] == errors[0], (code, err)
    assert campaign.snapshot(tmp_path) == before
    assert not (tmp_path / "RAN").exists()  # no trace made autopar run the model file it names


# -- resource bounds -----------------------------------------------------------------------------------------
@settings(deadline=2000)  # ms: to sqrt(10^12) is ~0.2 s, 1.1x the default deadline on both loaded cores; to n, hours
@given(n=st.integers(min_value=1, max_value=10**12))
def test_divisors_are_exact_without_looping_to_n(n):
    from autopar.axes import divisors

    ds = divisors(n)
    assert ds == sorted(set(ds)) and ds[0] == 1 and ds[-1] == n and all(n % d == 0 for d in ds)
    assert len(ds) == 2 * sum(1 for d in ds if d * d < n) + (math.isqrt(n) ** 2 == n)


def test_plan_space_enumeration_stops_at_its_limit(monkeypatch):
    from conftest import workload

    from autopar.search import space

    monkeypatch.setattr(space, "MAX_PLANS", 1000)
    with pytest.raises(AutoparError, match="more than 1,000 plans; autopar enumerates at most 1,000"):
        space.enumerate_plans(workload("gpt", size="gpt2-small", global_batch=64))
