"""Planning policies: MaskablePPO on `autopar/ParallelPlan-v0`, and the policy shipped with autopar.

The shipped `default_policy.zip` (with its metadata sidecar `default_policy.json`: space
signature, versions, the exact training command and its evaluation figures) is reproduced from
the repository root, in about 20 minutes on two shared x86 CPU cores (no GPU), by

    autopar train cost --workloads 1024 --timesteps 100000 -o policies/default_policy.zip

It samples 1,024 training workloads, computes each one's exhaustive oracle once (cached under
the autopar cache directory), imitates the oracle's decisions (behaviour cloning, then DAgger
rounds on the policy's own decisions) and fine-tunes with MaskablePPO on the cost-model reward.
`autopar.policies.load.load_policy` reads a policy for planning (NumPy only, no torch).

`autopar train traces TRACES --cluster ...` (`traces.py`) fine-tunes it for one cluster and the job
mix of its traces, on the calibrated cost model (docs/traces-and-calibration.md); `autopar train
measured MODEL` (`measured.py`) on real runs of this machine.

By role: the network (`extractor.py`), policy files (`files.py` writes, `load.py` reads without
torch, `fingerprint.py` what a policy depends on), decoding (`decode.py`: greedy, beam,
sampled), search-time refinement with the cost model (`refine.py`: coordinate descent;
`trade.py`: trades between the axis degrees), the planner (`planner.py`), behaviour cloning (`imitation.py`), and the trainers (`train.py` on the cost model, `traces.py`,
`measured.py`). The restricted plan space of `measured.py` lives beside the space, in
`autopar/envs/restricted.py`; the command line in `autopar/cli/train.py`.
"""
