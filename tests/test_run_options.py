"""Run options are declared once (autopar/executor/options.py): every command's flags, their
`--help` defaults, the worker's argv and the measured reward come from `RunOptions`."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.cli import build_parser
from autopar.errors import AutoparError
from autopar.executor.launch import torchrun_argv
from autopar.executor.options import WORKER, RunOptions, flag, worker_argv
from autopar.executor.worker import parse_args as worker_args

DEFAULTS = RunOptions()
COMMANDS = {  # argv that parses with every other argument at its default
    ("run",): ["run", "plan.json", "gpt"],
    ("traces", "collect"): ["traces", "collect", "gpt", "--plans", "1", "-o", "t.jsonl"],
    ("train", "measured"): ["train", "measured", "gpt"],
}


def _subparser(parser, path):
    for name in path:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return parser


def _help_defaults(help_text: str) -> dict[str, str]:
    """`--flag ... (default X)` pairs as `--help` prints them (wrapped lines joined)."""
    text = " ".join(help_text.split())
    return dict(re.findall(r"(--[a-z-]+) [A-Z_]+ [^-]*?\(default ([^)]+)\)", text))


@pytest.mark.parametrize("path", list(COMMANDS))
def test_command_defaults_and_help_come_from_run_options(path):
    parser = build_parser()
    args = parser.parse_args(COMMANDS[path])
    given_here = [f for f in fields(RunOptions) if f.metadata.get("cli", True) and hasattr(args, f.name)]
    assert {"steps", "warmup", "timeout_s"} <= {f.name for f in given_here}
    assert {f.name: getattr(args, f.name) for f in given_here} == {f.name: getattr(DEFAULTS, f.name)
                                                                   for f in given_here}
    shown = _help_defaults(_subparser(parser, path).format_help())
    assert shown["--steps"] == str(DEFAULTS.steps) and shown["--warmup"] == str(DEFAULTS.warmup)
    assert float(shown["--timeout"]) == DEFAULTS.timeout_s


def test_the_worker_reads_the_same_defaults_and_what_the_launcher_passes():
    bare = worker_args(["--plan", "p.json", "--model", "gpt", "--result", "r.json"])
    assert bare.options == DEFAULTS
    chosen = RunOptions(nproc_per_node=2, steps=7, warmup=0, seed=3, optimizer="sgd", lr=0.5, backend="gloo",
                        timeout_s=12.5, check_parity=True, no_dropout=True)
    argv = torchrun_argv("p.json", "gpt", {}, chosen, "r.json")
    worker = argv[argv.index("--module") + 2:]
    read = worker_args(worker).options
    assert all(getattr(read, name) == getattr(chosen, name) for name in WORKER)


@given(steps=st.integers(1, 10**6), warmup=st.integers(0, 10**6), seed=st.integers(0, 2**31),
       lr=st.floats(1e-12, 1e6), timeout=st.floats(1e-3, 1e9), parity=st.booleans(), dropout=st.booleans(),
       optimizer=st.sampled_from(["adamw", "adam", "sgd"]), backend=st.sampled_from(["auto", "gloo", "nccl"]))
def test_worker_argv_round_trips(steps, warmup, seed, lr, timeout, parity, dropout, optimizer, backend):
    options = RunOptions(steps=steps, warmup=warmup, seed=seed, lr=lr, timeout_s=timeout, check_parity=parity,
                         no_dropout=dropout, optimizer=optimizer, backend=backend)
    read = worker_args(["--plan", "p", "--model", "m", "--result", "r", *worker_argv(options)]).options
    assert read == options  # every worker field, and the node fields at their defaults


@pytest.mark.parametrize("bad, message", [({"steps": 0}, "--steps must be at least 1, got 0"),
                                          ({"warmup": -1}, "--warmup >= 0"),
                                          ({"timeout_s": float("inf")}, "--timeout must be a positive finite"),
                                          ({"lr": 0.0}, "--lr must be a positive finite number"),
                                          ({"nnodes": 2, "node_rank": 2}, "--node-rank < --nnodes"),
                                          ({"master_port": 70000}, "--master-port must be a TCP port"),
                                          ({"backend": "mpi"}, "--backend must be one of auto, nccl, gloo")])
def test_bad_options_name_their_flag(bad, message):
    with pytest.raises(AutoparError, match=re.escape(message)):
        RunOptions(**bad)
    assert flag("timeout_s") == "--timeout" and flag("nproc_per_node") == "--nproc-per-node"


def test_the_measured_reward_runs_with_the_options_it_is_given():
    from autopar.traces.reward import MeasuredReward

    reward = MeasuredReward("gpt", {"size": "tiny"}, RunOptions(nproc_per_node=2, steps=4))
    assert reward.nproc == 2 and reward.options.steps == 4 and MeasuredReward("gpt").options == DEFAULTS
    with pytest.raises(AutoparError, match="one node"):
        MeasuredReward("gpt", options=RunOptions(nnodes=2))
