"""`autopar export`: each framework's own config classes accept what autopar writes.

megatron-core is in the dev extra (it needs only torch, numpy and packaging); torchtitan's config
manager installs beside the pinned CPU torch with `pip install --no-deps torchtitan tyro
docstring-parser typeguard spmd-types`; without a package its checks are skipped. DeepSpeed installs from source, so its JSON is checked against the documented keys
(https://www.deepspeed.ai/docs/config-json/) and its batch identity; DeepSpeed's own config
class runs where DeepSpeed is installed (`pip install wheel hjson msgpack einops psutil && DS_BUILD_OPS=0
pip install --no-deps --no-build-isolation deepspeed`)."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import assert_exports_degree
from hypothesis import given
from hypothesis import strategies as st

from autopar.cli import main
from autopar.errors import PlanError
from autopar.export import FRAMEWORKS, export_plan
from autopar.export.megatron import MODEL_PARALLEL, core_fields
from autopar.plan import Plan

PLANS = [  # five plans spanning the knobs: DDP, ZeRO-1, FSDP2 + offload, tp x pp interleaved, gpipe
    Plan(dp=8, tp=1, pp=1, micro_batch_size=16, num_micro_batches=4),
    Plan(dp=8, tp=1, pp=1, micro_batch_size=8, num_micro_batches=8, zero=1, bucket_mb=100.0),
    Plan(dp=16, tp=1, pp=1, micro_batch_size=2, num_micro_batches=16, zero=3, offload_optimizer=True,
         recompute="selective", grad_comm_dtype="bf16"),
    Plan(dp=4, tp=8, pp=4, micro_batch_size=1, num_micro_batches=32, zero=1, recompute="full", recompute_blocks=4,
         schedule="interleaved", virtual_stages=2, sequence_parallel=True),
    Plan(dp=2, tp=2, pp=2, micro_batch_size=4, num_micro_batches=8, schedule="gpipe", precision="fp16",
         mesh_order=("pp", "tp", "dp")),
]

# the documented DeepSpeed keys autopar writes (deepspeed.ai/docs/config-json), and their types
DEEPSPEED_KEYS = {
    "train_batch_size": int, "train_micro_batch_size_per_gpu": int, "gradient_accumulation_steps": int,
    "zero_optimization": dict, "communication_data_type": str, "bf16": dict, "fp16": dict, "tensor_parallel": dict,
}
DEEPSPEED_ZERO_KEYS = {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                       "offload_optimizer"}


def plans():
    """Any valid plan (hypothesis)."""
    def build(dp, tp, pp, mbs, extra, zero, precision, comm):
        nmb = max(pp, 1) * extra
        return Plan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_micro_batches=nmb, zero=zero if dp > 1 else 0,
                    precision=precision, grad_comm_dtype=comm)
    return st.builds(build, st.integers(1, 64), st.sampled_from([1, 2, 4, 8]), st.integers(1, 8), st.integers(1, 16),
                     st.integers(1, 8), st.sampled_from([0, 1, 2, 3]), st.sampled_from(["bf16", "fp16", "fp32"]),
                     st.sampled_from(["fp32", "bf16"]))


@given(plans())
def test_deepspeed_batch_identity_and_documented_keys(plan):
    cfg = json.loads(export_plan(plan, "deepspeed").text)
    assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                       * plan.dp) == plan.global_batch
    for key, value in cfg.items():
        assert isinstance(value, DEEPSPEED_KEYS[key]), key
    assert set(cfg["zero_optimization"]) <= DEEPSPEED_ZERO_KEYS
    assert cfg["zero_optimization"]["stage"] == plan.zero
    assert cfg["communication_data_type"] == plan.grad_comm_dtype


class DataParallelGroup:
    """What DeepSpeed asks a model-parallel unit (`mpu`) for: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.mark.parametrize("plan", PLANS)
def test_deepspeed_own_config_class(plan, monkeypatch):
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)  # rank 0 of a job, no process group needed
    # DeepSpeed's own sanity check asserts train = micro x accumulation x data-parallel world size
    cfg = ds_config.DeepSpeedConfig(json.loads(export_plan(plan, "deepspeed").text), mpu=DataParallelGroup(plan.dp))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        plan.global_batch, plan.micro_batch_size, plan.num_micro_batches)
    assert cfg.zero_optimization_stage == plan.zero and cfg.zero_enabled == (plan.zero > 0)


@pytest.mark.parametrize("plan", PLANS)
def test_megatron_core_configs_accept_the_arguments(plan):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from autopar.export.megatron import DDP, FLAGS

    args = shlex.split(export_plan(plan, "megatron").text)
    fields = {k: v for k, v in core_fields(plan).items() if v is not None}
    for name, value in fields.items():  # every field is in the arguments, with its value
        if value is True:
            assert FLAGS[name] in args
        elif value is not False:
            assert args[args.index(FLAGS[name]) + 1] == str(value)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.precision]
    mp = ModelParallelConfig(**{k: v for k, v in fields.items() if k in MODEL_PARALLEL},
                             pipeline_dtype=dtype if plan.pp > 1 else None)
    assert (mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size) == (plan.tp, plan.pp)
    assert (mp.virtual_pipeline_model_parallel_size or 1) == plan.virtual_stages
    ddp = DistributedDataParallelConfig(**{k: v for k, v in fields.items() if k in DDP})
    assert ddp.use_distributed_optimizer == (plan.zero in (1, 2))
    opt = OptimizerConfig(optimizer_cpu_offload=fields["optimizer_cpu_offload"],
                          use_distributed_optimizer=ddp.use_distributed_optimizer)
    assert opt.optimizer_cpu_offload == plan.offload_optimizer
    batch = args[args.index("--global-batch-size") + 1], args[args.index("--micro-batch-size") + 1]
    assert batch == (str(plan.global_batch), str(plan.micro_batch_size))


TORCHTITAN_CONFIG = '''
from dataclasses import dataclass, field
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig


@dataclass(kw_only=True, slots=True)
class Config:  # the sections of torchtitan's Trainer.Config a plan sets (the trainer needs datasets etc.)
    hf_assets_path: str = "."
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = None


def plan_sections():
    return Config()
'''


@pytest.mark.parametrize("plan", PLANS)
def test_torchtitan_config_manager_reads_the_overrides(plan, tmp_path, monkeypatch):
    pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    from torchtitan.config.manager import ConfigManager

    (tmp_path / "autopar_titan_sections.py").write_text(TORCHTITAN_CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = shlex.split(export_plan(plan, "torchtitan").text)
    cfg = ConfigManager().parse_args(["--module", "autopar_titan_sections", "--config", "plan_sections", *overrides])
    par, train = cfg.parallelism, cfg.training
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == plan.dp
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (plan.tp, plan.pp)
    assert (par.data_parallel_shard_degree > 1 or plan.dp == 1 or plan.zero == 0)
    assert train.global_batch_size == plan.global_batch
    # torchtitan accumulates global / (local x dp) steps; with pipelining the local batch is split into micro-batches
    micro = par.pipeline_parallel_microbatch_size if plan.pp > 1 else train.local_batch_size
    assert micro == plan.micro_batch_size
    assert train.global_batch_size // (train.local_batch_size * plan.dp) * (train.local_batch_size // micro) \
        == plan.num_micro_batches
    assert (cfg.activation_checkpoint is None) == (plan.recompute == "none")
    if plan.tp > 1:
        assert par.enable_sequence_parallel == plan.sequence_parallel
    assert train.enable_cpu_offload == plan.offload_optimizer


@pytest.mark.parametrize("plan", PLANS)
def test_accelerate_yaml(plan, tmp_path):
    yaml = pytest.importorskip("yaml")
    text = export_plan(plan, "accelerate").text
    cfg = yaml.safe_load(text)
    assert cfg["num_processes"] == plan.world_size
    if plan.tp > 1 or plan.pp > 1:
        mc = cfg["megatron_lm_config"]
        assert (mc["megatron_lm_tp_degree"], mc["megatron_lm_pp_degree"]) == (plan.tp, plan.pp)
        assert mc["megatron_lm_num_micro_batches"] == plan.num_micro_batches
    else:
        assert cfg["distributed_type"] == ("FSDP" if plan.zero else "MULTI_GPU")
    try:
        from accelerate.commands.config.config_args import ClusterConfig
    except ImportError:
        return
    (tmp_path / "acc.yaml").write_text(text)
    assert ClusterConfig.from_yaml_file(tmp_path / "acc.yaml").num_processes == plan.world_size


def test_each_export_names_what_it_cannot_express():
    gpipe = PLANS[4]
    assert "schedule=gpipe" in export_plan(gpipe, "megatron").unexpressed_line()
    assert "mesh_order=pp,tp,cp,dp" in export_plan(gpipe, "torchtitan").unexpressed_line()  # cp at its default place
    assert "precision=fp16" in export_plan(gpipe, "torchtitan").unexpressed_line()
    assert "pp=2" in export_plan(gpipe, "deepspeed").unexpressed_line()
    assert export_plan(PLANS[0], "megatron").unexpressed == ()
    assert export_plan(PLANS[0], "megatron").unexpressed_line() == "megatron expresses every knob of this plan"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_cli_export_writes_the_file_and_the_caveat_line(framework, tmp_path, capsys):
    PLANS[3].save(tmp_path / "plan.json")
    out = tmp_path / f"out.{framework}"
    assert main(["export", str(tmp_path / "plan.json"), "--to", framework, "-o", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert out.read_text() == export_plan(PLANS[3], framework).text
    assert printed[-1] == export_plan(PLANS[3], framework).unexpressed_line()
    assert main(["export", str(tmp_path / "plan.json"), "--to", framework]) == 0
    captured = capsys.readouterr()
    assert captured.out == out.read_text() and framework in captured.err


def test_cli_export_bad_plan_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"schema_version": 1, "dp": 0}')
    assert main(["export", str(tmp_path / "bad.json"), "--to", "megatron", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "autopar: error:" in err
    assert not (tmp_path / "x").exists()
    with pytest.raises(PlanError):
        Plan.load(tmp_path / "bad.json")


def test_exports_map_ep_or_say_they_cannot():
    plan = Plan(dp=8, ep=4, zero=2, micro_batch_size=1)
    assert_exports_degree(plan, "ep=4", "--expert-model-parallel-size", "--parallelism.expert_parallel_degree", 4)
    dense = Plan(dp=8, zero=2, micro_batch_size=1)
    assert "expert" not in export_plan(dense, "megatron").text + export_plan(dense, "torchtitan").text


@pytest.mark.parametrize("document, message", [
    ({"mixed_plan_version": 1, "groups": []}, "this is a mixed-cluster plan"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 2}}, "not an autopar plan: it has no schema_version "
                                                                 "(its keys: train_batch_size, zero_optimization)"),
])
def test_cli_export_of_another_document_names_it(tmp_path, capsys, document, message):
    """A mixed plan or a framework's own config given as the plan: one line that says what it is, not a schema
    version to re-create."""
    (tmp_path / "other.json").write_text(json.dumps(document))
    assert main(["export", str(tmp_path / "other.json"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_cli_export_never_writes_over_the_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(PLANS[3].to_json())
    assert main(["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "." / "plan.json")]) == 2
    assert "is the plan being exported" in capsys.readouterr().err and Plan.load(path) == PLANS[3]
