"""The Ray launcher: each plan a Ray Train job (`TorchTrainer`) on a running Ray cluster.

The job has one Ray Train worker per node (`nodes` workers, each holding its node's
`gpus-per-node` GPUs, or as many CPUs on gloo); each worker runs autopar's own `autopar run` for
its node (`run_argv`), node 0's address and a free port shared through the process group Ray
Train sets up among the workers. Worker 0 reports the record; this process (the driver) names
the run (cluster.job) and appends it to the trace file. A job whose workers Ray lost (a node
taken back) is recorded here as `preempted`, any other failure of the job itself as `error`.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.traces.launchers import Launcher, RunSpec, node_record, run_argv, unran, with_job


def connect(address: str) -> None:
    """Join the running Ray cluster at `address` ("auto": the one this machine belongs to)."""
    try:
        import ray  # ray: heavy, imported on first use
        import ray.train  # noqa: F401  (Ray Train and Tune come with the extra; a bare `pip install ray` lacks them)
    except ImportError:
        raise AutoparError("--launcher ray needs Ray Train: pip install 'autopar[cluster]'") from None
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise AutoparError(f"cannot join a Ray cluster at {address!r} ({str(e).splitlines()[0] if str(e) else e!r}); "
                           f"start one with `ray start --head` or name it with --ray-address HOST:PORT") from None


def _node_loop(config: dict) -> dict:
    """One Ray Train worker: `autopar run` for its node; worker 0 reports the record."""
    import ray.train  # ray: heavy, imported on first use
    import torch.distributed as dist  # torch: heavy, imported on first use

    ctx = ray.train.get_context()
    rank, nodes = ctx.get_world_rank(), ctx.get_world_size()
    spec: RunSpec = config["spec"]
    head = [ray.util.get_node_ip_address(), _free_port()] if rank == 0 else [None, None]
    if nodes > 1:  # node 0's address and rendezvous port, over Ray Train's own process group
        dist.broadcast_object_list(head, src=0)
    with tempfile.TemporaryDirectory(prefix="autopar-ray-") as tmp:
        plan_path, trace_tmp = Path(tmp) / "plan.json", Path(tmp) / "trace.jsonl"
        Plan.from_dict(config["plan"]).save(plan_path)
        record, why = node_record(run_argv(plan_path, spec, trace_tmp, rank, head[0], head[1]), trace_tmp,
                                  spec.options.timeout_s)
    return {"record": record, "refused": why}  # Ray Train returns worker 0's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, address: str = "auto", say=lambda msg: None):
        self.address = address
        self.say = say

    @functools.cached_property
    def storage(self) -> str:
        """Ray Train's and Tune's run state (no checkpoints), made when the first job starts and removed when
        this process exits: each job's result has come back through Ray by then."""
        path = tempfile.mkdtemp(prefix="autopar-ray-train-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        return path

    def trainer(self, plan: Plan, spec: RunSpec, name: str):
        from ray.train import RunConfig, ScalingConfig  # ray: heavy, imported on first use
        from ray.train.torch import TorchTrainer  # ray: heavy, imported on first use

        o = spec.options
        gpu = o.backend == "nccl"
        scaling = ScalingConfig(num_workers=o.nnodes, use_gpu=gpu,
                                resources_per_worker={"GPU" if gpu else "CPU": o.nproc_per_node},
                                placement_strategy="STRICT_SPREAD" if o.nnodes > 1 else "PACK")
        return TorchTrainer(_node_loop, train_loop_config={"plan": plan.to_dict(), "spec": spec},
                            scaling_config=scaling, run_config=RunConfig(name=name, storage_path=self.storage))

    def measure(self, plan: Plan, spec: RunSpec) -> dict | None:
        import ray.train  # ray: heavy, imported on first use

        connect(self.address)
        name = f"autopar-run-{uuid.uuid4().hex[:12]}"
        self.say(f"Ray Train run {name}")
        job = {"launcher": "ray", "id": name}
        try:
            result = self.trainer(plan, spec, name).fit()
        except ray.train.TrainingFailedError as e:
            text = str(e)
            preempted = "PreemptionError" in text or "node" in text.lower() and "died" in text.lower()
            line = next((x.strip() for x in text.splitlines() if x.strip()), type(e).__name__)
            return unran(plan, spec, "preempted" if preempted else "error", f"Ray Train run {name} failed: {line}", job)
        out = result.return_value or {}
        if not out.get("record"):
            self.say(f"run {name}: the plan was refused: {out.get('refused')}")
            return None
        return with_job(out["record"], job, spec.trace)
