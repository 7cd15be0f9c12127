"""Pictures: the schedule simulation behind the timeline (no matplotlib needed) and the PNGs of
`autopar search --plot` and `autopar explain PLAN MODEL --plot`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.cli import main
from autopar.plan import Plan
from autopar.plots.schedule import simulate
from conftest import ZOO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def schedules():
    def build(pp, per_rank, v, schedule):
        v = v if schedule == "interleaved" and pp > 1 else 1
        schedule = schedule if pp > 1 and (schedule != "interleaved" or v > 1) else "1f1b"
        return Plan(dp=1, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=pp * per_rank, schedule=schedule,
                    virtual_stages=v)
    return st.builds(build, st.integers(1, 6), st.integers(1, 4), st.integers(2, 3),
                     st.sampled_from(["gpipe", "1f1b", "interleaved"]))


@given(schedules())
def test_every_pass_runs_once_without_overlap_and_the_bubble_is_megatrons(plan):
    f, b = 1.0, 2.0
    segments = simulate(plan, {"compute": f}, {"compute": b}, {})
    m, p, v = plan.num_micro_batches, plan.pp, plan.virtual_stages
    for r in range(p):
        mine = sorted((s.start, s.start + s.duration) for s in segments if s.rank == r)
        assert len(mine) == 2 * m * v  # a forward and a backward per micro-batch and chunk
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(mine, mine[1:]))
    end = max(s.start + s.duration for s in segments)
    # equal stages: (m + (p - 1) / v) micro-batch times, Narayanan et al.'s (p - 1) / (v m) bubble
    assert end == pytest.approx((m + (p - 1) / v) * (f + b)) or plan.schedule == "interleaved"
    busy = [sum(s.duration for s in segments if s.rank == r) for r in range(p)]
    assert busy == pytest.approx([m * (f + b)] * p)  # each rank's idle time is the bubble
    if plan.schedule == "interleaved":  # Megatron's order may idle a little more than the formula
        assert end <= (m + (p - 1)) * (f + b) + 1e-9


def test_data_parallel_and_optimizer_follow_the_pipeline():
    plan = Plan(dp=2, tp=1, pp=2, micro_batch_size=1, num_micro_batches=4)
    segments = simulate(plan, {"compute": 1.0, "tp_comm": 0.1}, {"recompute": 0.5, "compute": 2.0, "tp_comm": 0.1},
                        {"dp_comm": 3.0, "optimizer": 1.0})
    kinds = {s.kind for s in segments}
    assert kinds == {"compute", "recompute", "tp_comm", "dp_comm", "optimizer"}
    last_pass = max(s.start + s.duration for s in segments if s.kind in ("compute", "tp_comm"))
    assert min(s.start for s in segments if s.kind == "dp_comm") == pytest.approx(last_pass)


def test_search_and_explain_write_readable_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plan_png, explain_png = tmp_path / "search.png", tmp_path / "explain.png"
    args = [str(ZOO / "gpt.py"), "--model-arg", "size=tiny", "--cluster", "cpu", "--gpus-per-node", "4",
            "--global-batch", "16"]
    assert main(["search", *args, "--method", "exhaustive", "-o", str(tmp_path / "plan.json"),
                 "--plot", str(plan_png)]) == 0
    assert f"plot written to {plan_png}" in capsys.readouterr().out.replace("\n", "")
    plan = Plan.load(tmp_path / "plan.json")
    pp2 = plan.with_(dp=plan.dp * plan.pp // 2, pp=2, num_micro_batches=4, compile=False,  # not compiled under pp
                     micro_batch_size=16 // (4 * (plan.dp * plan.pp // 2)))
    pp2.save(tmp_path / "pp2.json")
    assert main(["explain", str(tmp_path / "pp2.json"), *args[:-2], "--plot", str(explain_png)]) == 0
    out = capsys.readouterr().out
    assert "Why" in out and "plot written" in out
    from matplotlib.image import imread

    for png in (plan_png, explain_png):
        assert png.read_bytes()[:8] == PNG_MAGIC
        height, width, _ = imread(png).shape
        assert width >= 1200 and height >= 300


def test_plot_without_matplotlib_is_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code = main(["search", str(ZOO / "gpt.py"), "--model-arg", "size=tiny", "--cluster", "cpu", "--gpus-per-node", "2",
                 "--global-batch", "8", "-o", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pip install 'autopar[plots]'" in err
    assert not (tmp_path / "plan.json").exists() and not (tmp_path / "p.png").exists()


def test_plot_to_a_directory_is_one_line_exit_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    Plan(dp=2, tp=1, pp=1, micro_batch_size=4, num_micro_batches=1).save(tmp_path / "plan.json")
    code = main(["explain", str(tmp_path / "plan.json"), str(ZOO / "gpt.py"), "--model-arg", "size=tiny",
                 "--cluster", "cpu", "--plot", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is a directory" in err
