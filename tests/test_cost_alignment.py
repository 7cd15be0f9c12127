"""The output layer's alignment note: said exactly when a rank's slice of the vocabulary is off
cuBLAS's 16-byte grid on a GPU, with a padding that puts it back on; and tp's refusal of a
vocabulary it does not divide names that padding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.axes import padded_vocab
from autopar.cost.alignment import alignment_note
from autopar.cost.regime import notes
from autopar.errors import AutoparError
from autopar.plan import Plan
from conftest import workload


def _plan(tp=1, precision="bf16"):
    return Plan(dp=8 // tp, tp=tp, pp=1, micro_batch_size=1, num_micro_batches=2 * tp, precision=precision,
                fp8_recipe="tensorwise" if precision == "fp8" else "none")


@pytest.mark.parametrize("vocab, tp, precision, padded", [
    (250, 1, "bf16", 256),   # 250 % 8 = 2
    (256, 1, "bf16", None),
    (264, 2, "bf16", 272),   # 132 per rank: a multiple of 4, not of 8
    (272, 2, "bf16", None),  # 136 per rank
    (252, 1, "fp32", None),  # tf32 GEMMs want 4-element multiples
    (252, 1, "bf16", 256),
    (250, 1, "fp32", 252),
    (250, 1, "fp8", 256),    # fp8 plans keep the head in bf16
])
def test_note_exactly_when_a_ranks_vocabulary_is_off_the_16_byte_grid(vocab, tp, precision, padded):
    w = workload("gpt", "dgx-h100", global_batch=16, size="tiny", vocab=vocab)
    note = alignment_note(w, _plan(tp, precision))
    if padded is None:
        assert note == ""
    else:
        assert note.startswith(f"note: the output layer's vocabulary per tensor-parallel rank ({vocab // tp:,})")
        assert note.endswith(f"pad the vocabulary to {padded:,}" + (f" (8 per rank x tp {tp})" if tp > 1 else ""))
        assert "\n" not in note and note in notes(w, _plan(tp, precision))


def test_no_note_where_no_tensor_core_tiles_run_the_gemms():
    assert alignment_note(workload("gpt", "cpu", global_batch=16, size="tiny", vocab=250), _plan(1)) == ""
    assert alignment_note(workload("resnet", "dgx-h100", global_batch=16, size="tiny"), _plan(1)) == ""


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
    assert [n for n in listed if "output layer" in n] == [alignment_note(workload(
        "gpt", "dgx-h100", global_batch=16, size="tiny", vocab=250), _plan(1))]
    assert main(args) == 0
    assert "pad the vocabulary to 256" in " ".join(capsys.readouterr().out.split())


def test_explain_prints_the_notes_search_and_estimate_print(tmp_path, capsys):
    import json

    from autopar.cli import main

    path = tmp_path / "plan.json"
    _plan(1).save(path)
    args = ["explain", str(path), "gpt", "--model-arg", "size=tiny", "--model-arg", "vocab=250", "--cluster",
            "dgx-h100", "--nodes", "1", "--global-batch", "16"]
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert any("pad the vocabulary to 256" in n for n in d["notes"]) and "runtime torch" in d["calibration_note"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "pad the vocabulary to 256" in out and "outside the calibrated regime" in out
