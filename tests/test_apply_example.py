"""Issue 39, point 5: the README's "Apply a plan" example trains on text whose loss falls
(`autopar.zoo.counting_corpus`), and `make_loader` keeps the dataset's order by default, so the
first step's loss equals a single process's on the dataset's first global batch."""

import os
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test_readme import IN_GROUP, ROOT, readme_example
from torch.utils.data import TensorDataset

from autopar.executor.data import local_share, make_loader
from autopar.executor.parity import reference_losses
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.zoo import counting_corpus

FP32 = dict(tp=1, pp=1, precision="fp32")


def _dp_rank(rank: int):
    return SimpleNamespace(rank=lambda axis: {"dp": rank}[axis])  # what make_loader reads of a Topology


def test_the_loader_reads_the_dataset_in_order_each_rank_its_share():
    plan = Plan(dp=2, micro_batch_size=2, num_micro_batches=2, **FP32)  # global batch 8
    data = torch.arange(3 * plan.global_batch)
    loaders = [make_loader(TensorDataset(data), plan, _dp_rank(r)) for r in range(2)]
    for step, batches in enumerate(zip(*loaders)):
        global_batch = data[step * plan.global_batch:(step + 1) * plan.global_batch]
        for rank, (local,) in enumerate(batches):
            assert torch.equal(local, local_share(global_batch, plan, rank))
    shuffled = make_loader(TensorDataset(data), plan, _dp_rank(0), shuffle=True, seed=0)
    assert not torch.equal(next(iter(shuffled))[0], local_share(data[:plan.global_batch], plan, 0))


def test_the_counting_corpus_counts_and_is_the_same_on_every_call():
    tokens, targets = counting_corpus(5, vocab=7, seq_len=12, seed=3)
    assert tokens.shape == targets.shape == (5, 12)
    assert torch.equal(targets, (tokens + 1) % 7) and torch.equal(tokens[:, 1:], targets[:, :-1])
    assert torch.equal(counting_corpus(5, vocab=7, seq_len=12, seed=3)[0], tokens)


def _printed_losses(out: str) -> list[float]:
    return [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]


def _first_step_reference(plan: Plan) -> float:
    """The plain one-process loop's first loss on the dataset's first global batch (the README's data)."""
    gpt = load_model_file("gpt")
    tokens, targets = counting_corpus(4 * plan.global_batch, vocab=256, seq_len=32)
    batch = ((tokens[:plan.global_batch],), targets[:plan.global_batch])
    (loss,) = reference_losses(lambda: gpt.build(size="tiny", dropout=0.0), lambda p: torch.optim.AdamW(p, lr=3e-3),
                               gpt.loss_fn, [batch], seed=0)
    return loss


def test_the_readme_example_on_one_rank_learns_and_its_first_step_is_one_process(tmp_path, monkeypatch, capsys):
    plan = Plan(dp=1, micro_batch_size=4, num_micro_batches=4, **FP32)  # a one-rank plan runs as plain python
    plan.save(tmp_path / "plan.json")
    (tmp_path / "train.py").write_text(readme_example())
    monkeypatch.chdir(tmp_path)  # the example writes ckpt/ beside it
    monkeypatch.setattr(sys, "argv", ["train.py", "plan.json"])
    runpy.run_path("train.py", run_name="__main__")
    losses = _printed_losses(capsys.readouterr().out)
    assert len(losses) == 4  # four global batches of 16 in the 64-sample corpus
    assert losses[-1] < losses[0] - 0.2  # learnable: random tokens stay near ln(256) = 5.55
    assert losses[0] == pytest.approx(_first_step_reference(plan), abs=1e-4)  # printed to 4 decimals


@pytest.mark.slow
def test_the_readme_example_on_two_dp_ranks_starts_where_one_process_does(tmp_path):
    plan = Plan(dp=2, micro_batch_size=8, num_micro_batches=1, **FP32)
    plan.save(tmp_path / "dp2.json")
    (tmp_path / "train.py").write_text(readme_example())
    (tmp_path / "in_group.py").write_text(IN_GROUP)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "in_group.py", "gloo", "train.py", "dp2.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _printed_losses(done.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2
    assert losses[0] == pytest.approx(_first_step_reference(plan), abs=1e-4)
