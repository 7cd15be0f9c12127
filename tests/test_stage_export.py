"""Per-stage plans on the way out (issue 41): Megatron writes `--pipeline-model-parallel-layout` for an
explicit split (end-only stages included), which megatron-core's own TransformerConfig validates,
and says per-stage recompute exactly where its one recompute_num_layers per virtual stage can; the
other frameworks name it as unexpressed and export the setting that saves at least as much memory."""

from __future__ import annotations

import json
import shlex

import pytest

from autopar.export import export_plan
from autopar.export.megatron import core_fields, layout
from autopar.plan import Plan


def plan(pp=4, **kw) -> Plan:
    return Plan(dp=2, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=8, **kw)


def flag(framework_text: str, name: str) -> str | None:
    args = shlex.split(framework_text)
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("kw, expected", [
    (dict(layer_split=(0, 3, 3, 2)), "E|t*3|t*3|t*2,L"),
    (dict(layer_split=(1, 3, 3, 1)), "Et|t*3|t*3|t,L"),
    (dict(layer_split=(3, 3, 2, 0)), "Et*3|t*3|t*2|L"),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, layer_split=(0, 4, 3, 1)), "E|t*4|t*3|t,L"),
])
def test_megatron_writes_the_layout_megatron_core_validates(kw, expected):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import LayerType

    p = plan(**kw)
    text = export_plan(p, "megatron").text
    assert flag(text, "--pipeline-model-parallel-layout") == layout(p) == expected
    # the layout excludes the first/last-stage layer counts, and Megatron-LM takes it or the virtual stages
    flags = ("--decoder-first", "--decoder-last", "--num-virtual-stages")
    assert not any(a.startswith(flags) for a in shlex.split(text))
    fields = core_fields(p)
    config = TransformerConfig(num_layers=sum(p.layer_split), hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=p.pp, pipeline_dtype=torch.bfloat16,
                               pipeline_model_parallel_layout=fields["pipeline_model_parallel_layout"])
    built = config.pipeline_model_parallel_layout
    per_stage = [built.layout[s % p.pp][s // p.pp].count(LayerType.decoder) for s in range(p.stages)]
    assert per_stage == list(p.layer_split)
    assert (config.virtual_pipeline_model_parallel_size or 1) == p.virtual_stages
    assert "layer_split" not in " ".join(export_plan(p, "megatron").unexpressed)
    with pytest.raises(AssertionError, match="must match num_layers"):  # megatron-core checks the count
        TransformerConfig(num_layers=sum(p.layer_split) + 1, hidden_size=64, num_attention_heads=4,
                          pipeline_model_parallel_size=p.pp, pipeline_dtype=torch.bfloat16,
                          pipeline_model_parallel_layout=fields["pipeline_model_parallel_layout"])


def test_a_balanced_split_writes_no_layout():
    assert "--pipeline-model-parallel-layout" not in export_plan(plan(), "megatron").text
    assert layout(plan(pp=1, layer_split=(8,))) is None


@pytest.mark.parametrize("stages, blocks", [
    (("none", "full:2", "full:2", "full:2"), "2"),  # the embedding-only stage recomputes nothing anyway
    (("none", "full:3", "full:3", "full:2"), "3"),  # 3 per stage: all of the last stage's 2
])
def test_megatron_says_per_stage_recompute_exactly_where_one_count_per_stage_means_it(stages, blocks):
    p = plan(layer_split=(0, 3, 3, 2), stage_recompute=stages)
    out = export_plan(p, "megatron")
    assert (flag(out.text, "--recompute-method"), flag(out.text, "--recompute-num-layers")) == ("block", blocks)
    assert out.unexpressed == ()


def test_megatron_names_per_stage_recompute_it_cannot_say_and_exports_the_covering_setting():
    p = plan(layer_split=(1, 3, 3, 1), stage_recompute=("none", "full:3", "selective", "full:1"))
    out = export_plan(p, "megatron")
    assert (flag(out.text, "--recompute-granularity"), flag(out.text, "--recompute-num-layers")) == ("full", "3")
    assert out.unexpressed == ("stage_recompute=none,full:3,selective,full:1: Megatron gives every stage the same "
                               "recompute (recompute_num_layers per virtual stage); exported as full recompute of 3 "
                               "blocks per stage",)
    selective = export_plan(plan(layer_split=(0, 3, 3, 2), stage_recompute=("none", "selective", "none", "selective")),
                            "megatron")
    assert flag(selective.text, "--recompute-granularity") == "selective"
    assert "exported as selective recompute in every stage" in selective.unexpressed_line()


def test_the_other_frameworks_name_per_stage_recompute_and_export_what_saves_at_least_as_much():
    p = plan(layer_split=(0, 3, 3, 2), stage_recompute=("none", "full:1", "selective", "none"))
    titan = export_plan(p, "torchtitan")
    assert "activation_checkpoint:full" in titan.text.split()
    assert any(line.startswith("stage_recompute=none,full:1,selective,none: torchtitan") for line in titan.unexpressed)
    deepspeed = export_plan(p, "deepspeed")
    assert any("deepspeed.checkpointing.checkpoint" in line and line.startswith("stage_recompute=")
               for line in deepspeed.unexpressed)
    accelerate = export_plan(p, "accelerate")
    assert "megatron_lm_recompute_activations: true" in accelerate.text
    assert any(line.startswith("stage_recompute=") for line in accelerate.unexpressed)
    none = plan(layer_split=(0, 3, 3, 2), stage_recompute=("none",) * 4)
    for framework in ("megatron", "torchtitan", "deepspeed", "accelerate"):
        assert not any(line.startswith("stage_recompute") for line in export_plan(none, framework).unexpressed)
    assert json.loads(export_plan(p, "deepspeed").text)["train_batch_size"] == p.global_batch
