"""The output layer's vocabulary note: said exactly when the vocabulary keeps tp below what the rest
of the model allows, or a rank's slice of it is off cuBLAS's 16-byte grid on a GPU, with a padding
that fixes both; and tp's refusal of a vocabulary it does not divide names that padding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.axes import padded_vocab
from autopar.cost.regime import notes
from autopar.cost.vocabulary import tp_limit, vocabulary_note
from autopar.errors import AutoparError
from autopar.plan import Plan
from conftest import workload


def _plan(tp=1, precision="bf16", gpus=8):
    return Plan(dp=gpus // tp, tp=tp, pp=1, micro_batch_size=1, num_micro_batches=16 // (gpus // tp),
                precision=precision, fp8_recipe="tensorwise" if precision == "fp8" else "none")


# the tiny GPT's 4 heads allow tp up to 4 on one 8-GPU node; the vocabulary may allow less
@pytest.mark.parametrize("vocab, tp, precision, cluster, limit, columns, padded", [
    (256, 1, "bf16", "dgx-h100", None, None, None),
    (256, 4, "bf16", "dgx-h100", None, None, None),       # 64 per rank
    (250, 1, "bf16", "dgx-h100", 2, 250, (256, 4)),       # 250 = 2 x 125: tp <= 2, and 250 % 8 = 2
    (250, 2, "bf16", "dgx-h100", 2, 125, (256, 4)),
    (264, 1, "bf16", "dgx-h100", None, None, None),       # 8 x 33
    (264, 2, "bf16", "dgx-h100", None, 132, (272, 2)),    # 132 per rank: a multiple of 4, not of 8
    (272, 2, "bf16", "dgx-h100", None, None, None),       # 136 per rank
    (272, 4, "bf16", "dgx-h100", None, 68, (288, 4)),
    (252, 1, "fp32", "dgx-h100", None, None, None),       # tf32 GEMMs want 4-element multiples
    (252, 1, "bf16", "dgx-h100", None, 252, (256, 1)),
    (250, 1, "fp32", "dgx-h100", 2, 250, (256, 4)),       # 4 per rank x tp 4
    (250, 1, "fp8", "dgx-h100", 2, 250, (256, 4)),        # fp8 plans keep the head in bf16
    (250, 1, "bf16", "cpu", 2, None, (256, 4)),           # no tensor-core tiles on CPU: only the limit
])
def test_note_exactly_when_the_vocabulary_limits_tp_or_is_off_the_16_byte_grid(vocab, tp, precision, cluster, limit,
                                                                                columns, padded):
    gpus = 8 if cluster == "dgx-h100" else 4
    w = workload("gpt", cluster, global_batch=16, size="tiny", vocab=vocab)
    plan = _plan(tp, precision, gpus)
    note = vocabulary_note(w, plan)
    assert tp_limit(w) == ((limit, 4) if limit else (4, 4))
    if padded is None:
        assert note == ""
        return
    elements = 4 if precision == "fp32" else 8
    assert note.startswith(f"note: the output layer's vocabulary ({vocab:,}) ") and "\n" not in note
    assert (f"keeps tensor parallelism at tp <= {limit}, where the rest of the model allows 4" in note) == bool(limit)
    assert ("per tensor-parallel rank, not a multiple of" in note) == bool(columns)
    assert not columns or f"is {columns:,} per tensor-parallel rank, not a multiple of {elements}:" in note
    size, over = padded
    assert note.endswith(f"pad it to {size:,}" + (f" ({elements} per rank x tp {over})" if over > 1 else ""))
    assert note in notes(w, plan)


def test_megatron_pads_the_vocabulary_itself_so_any_tp_runs_and_nothing_is_said():
    """Megatron-LM rounds the vocabulary up to a multiple of 128 x tp: under runtime megatron tp need
    not divide the file's vocabulary, and there is nothing to note; under torch the same plan is refused."""
    import dataclasses

    torch_w = workload("gpt", "dgx-h100", global_batch=16, size="tiny", vocab=250)
    megatron_w = dataclasses.replace(torch_w, runtime="megatron")
    with pytest.raises(AutoparError, match="does not divide"):
        _plan(tp=4).validate(torch_w)
    _plan(tp=4).validate(megatron_w)
    assert vocabulary_note(megatron_w, _plan(tp=4)) == "" and vocabulary_note(megatron_w, _plan(tp=1)) == ""
    assert vocabulary_note(torch_w, _plan(tp=1)) != ""


def test_no_note_for_a_model_without_a_vocabulary():
    assert vocabulary_note(workload("resnet", "dgx-h100", global_batch=16, size="tiny"), _plan(1)) == ""


@given(st.integers(1, 300_000), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([4, 8, 16]))
def test_padding_is_the_smallest_that_aligns_every_rank(vocab, tp, elements):
    p = padded_vocab(vocab, tp, elements)
    assert p >= vocab and p % (elements * tp) == 0 and (p // tp) % elements == 0
    assert p - elements * tp < vocab


def test_a_tp_that_does_not_divide_the_vocabulary_names_the_padding():
    w = workload("gpt", "dgx-h100", global_batch=16, size="tiny", vocab=250)
    with pytest.raises(AutoparError, match=r"does not divide \[250\].*or pad the vocabulary to 256$"):
        _plan(tp=4).validate(w)


def test_estimate_prints_the_note_and_lists_it_in_json(capsys):
    import json

    from autopar.cli import main

    args = ["estimate", "gpt", "--model-arg", "size=tiny", "--model-arg", "vocab=250", "--cluster", "dgx-h100",
            "--nodes", "1", "--global-batch", "16", "--dp", "8", "--micro-batch", "1"]
    assert main([*args, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["notes"]
    assert [n for n in listed if "output layer" in n] == [vocabulary_note(workload(
        "gpt", "dgx-h100", global_batch=16, size="tiny", vocab=250), _plan(1))]
    assert main(args) == 0
    assert "pad it to 256 (8 per rank x tp 4)" in " ".join(capsys.readouterr().out.split())


def test_explain_prints_the_notes_search_and_estimate_print(tmp_path, capsys):
    import json

    from autopar.cli import main

    path = tmp_path / "plan.json"
    _plan(1).save(path)
    args = ["explain", str(path), "gpt", "--model-arg", "size=tiny", "--model-arg", "vocab=250", "--cluster",
            "dgx-h100", "--nodes", "1", "--global-batch", "16"]
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert any("pad it to 256" in n for n in d["notes"]) and "runtime torch" in d["calibration_note"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "pad it to 256" in out and "outside the calibrated regime" in out


def test_megatron_prices_its_padded_vocabulary_as_weights_and_gemm_work(monkeypatch):
    """Under runtime megatron the vocabulary runs padded to 128 x tp: GPT-2's 50,257 at tp 4 holds
    and multiplies the weights of 50,688 columns, so its embedding and head weigh exactly what a
    50,688 vocabulary's do, and its GEMM time lies between the unpadded price and the padded model's."""
    import dataclasses

    import autopar.cost.vocabulary as vocabulary
    from autopar.cost import estimate

    def est(vocab):
        w = workload("gpt", "dgx-a100-80g", global_batch=64, size="gpt2-small", vocab=vocab)
        plan = Plan(dp=2, tp=4, pp=1, micro_batch_size=4, num_micro_batches=8, precision="bf16")
        return estimate(dataclasses.replace(w, runtime="megatron"), plan)

    padded, aligned = est(50257), est(50688)
    split = vocabulary.tp_split(dataclasses.replace(workload("gpt", "dgx-a100-80g", global_batch=64, size="tiny",
                                                             vocab=250), runtime="megatron"), [1, 2, 4], 6)
    assert split[:, 1:-1].tolist() == [[1.0] * 4, [2.0] * 4, [4.0] * 4]  # layers: tp
    assert split[:, 0].tolist() == split[:, -1].tolist() == [250 / 256, 500 / 256, 1000 / 512]  # the ends padded
    assert padded.memory["weights"] == aligned.memory["weights"]
    monkeypatch.setattr(vocabulary, "vocab_padding", lambda w: 0)  # the file's vocabulary as it is
    unpadded = est(50257)
    assert unpadded.memory["weights"] < padded.memory["weights"]
    # the loss's passes over the logits and their gather stay at the file's vocabulary (docs/hardware.md)
    assert unpadded.breakdown["compute"] < padded.breakdown["compute"] < aligned.breakdown["compute"]


def test_only_the_ends_vocabulary_leaves_what_tp_must_divide():
    """The tiny GPT's MLP is 256 wide: with a 256 vocabulary that width still binds tp when the
    vocabulary does not (runtime megatron pads it, or the note asks what the rest allows)."""
    import dataclasses

    from autopar.axes import tp_units

    same = workload("gpt", "dgx-h100", global_batch=16, size="tiny", vocab=256)
    assert same.profile.dims["ffn"] == 256 and 256 in tp_units(same, vocab=False)
    assert 256 in tp_units(dataclasses.replace(same, runtime="megatron"))
    other = workload("gpt", "dgx-h100", global_batch=16, size="tiny", vocab=250)
    assert 250 in tp_units(other) and 250 not in tp_units(other, vocab=False)
    assert tp_units(dataclasses.replace(other, runtime="megatron")) == tp_units(other, vocab=False)
