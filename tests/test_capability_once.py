"""What runs is declared once (autopar/capability/): the plan space, `Plan.validate` (estimate,
explain, search, `autopar run`'s check) and the executor ask the same rules, per runtime.

What counts as a capability refusal, checked on the source with `ast`: a `raise PlanError/AutoparError`
whose guarding conditions (the enclosing `if`s of its function) read a field some capability rule
governs (`capability.rules()` and the fields they read: tp, sequence_parallel, precision, ...) as an
attribute of an object AND read something besides that object, builtins and constants: a model, a
backend, a device, a profile, a runtime, a tp_plan. A condition on the plan alone (sequence parallelism
needs tp >= 2) is the plan's own consistency and may live anywhere; one that weighs the plan against
what runs it lives in autopar/capability/ only. The command line's own flags (`args`) say what the user
asked, not what runs it. Nothing outside autopar/capability/ reads the layout facts (`.limits`).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import profile

from autopar import capability
from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.errors import PlanError
from autopar.explain import _excluded
from autopar.executor.train_step import apply
from autopar.export import export_plan
from autopar.knobs import depends_of, knob
from autopar.modelfile import load_model_file
from autopar.plan import Plan
from autopar.search.space import plan_of, walk
from autopar.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("autopar", "envs", "policies")
CAPABILITY = ROOT / "autopar" / "capability"
ERRORS = {"PlanError", "AutoparError"}
ASKED = {"args"}  # the command line's flags: what the user asked
SP_ON_MOE = ["moe", "--model-arg", "size=tiny", "--cluster", "cpu", "--gpus-per-node", "4", "--global-batch", "8",
             "--dp", "2", "--tp", "2", "--micro-batch-size", "2", "--sequence-parallel", "--precision", "fp32"]


def governed_fields() -> set[str]:
    return {name for rule in capability.rules().values() for name in (rule.knob, *rule.reads)} | {"precision"}


def _reads(test: ast.expr, fields: set[str]) -> tuple[set[str], set[str]]:
    """(objects whose governed fields the condition reads, every other name it reads)."""
    owners = {ast.unparse(n.value) for n in ast.walk(test) if isinstance(n, ast.Attribute) and n.attr in fields}
    inside = {id(m) for n in ast.walk(test) if isinstance(n, ast.Attribute) and n.attr in fields for m in ast.walk(n)}
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name) and id(n) not in inside}
    return owners, names


def capability_refusals(path: Path, rel: str, fields: set[str]) -> list[str]:
    """The raises of one source file that weigh a plan's governed field against what runs it."""
    found = []

    def visit(stmts, guards):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body, [])
            elif isinstance(node, ast.If):
                visit(node.body, guards + [node.test])
                visit(node.orelse, guards + [node.test])
            elif isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if (exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", "")) in ERRORS and guards:
                    owners, names = set(), set()
                    for test in guards:
                        o, n = _reads(test, fields)
                        owners |= o
                        names |= n
                    facts = names - owners - ASKED - set(dir(builtins))
                    if owners and facts:
                        found.append(f"{rel}:{node.lineno} weighs {sorted(owners)} against {sorted(facts)}")
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit(inner, guards)

    visit(ast.parse(path.read_text(), str(path)).body, [])
    return found


def reads_layout_facts(path: Path, rel: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{rel}:{n.lineno} reads {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "limits" and isinstance(n.ctx, ast.Load)
            or isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr" and len(n.args) > 1
            and isinstance(n.args[1], ast.Constant) and n.args[1].value == "limits"]


def outside_capability(root: Path):
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            if CAPABILITY not in path.parents:
                yield path, str(path.relative_to(root))


def test_no_capability_refusal_is_raised_outside_the_capability_module():
    fields = governed_fields()
    assert {"tp", "pp", "cp", "ep", "sequence_parallel", "zero", "compile", "fp8_recipe"} <= fields
    found = [line for path, rel in outside_capability(ROOT) for line in capability_refusals(path, rel, fields)]
    assert found == []


def test_nothing_outside_the_capability_module_reads_the_layout_facts():
    assert [line for path, rel in outside_capability(ROOT) for line in reads_layout_facts(path, rel)] == []


def test_the_checker_finds_a_planted_refusal_and_leaves_the_plans_own_checks(tmp_path):
    planted = tmp_path / "train_step.py"
    planted.write_text(
        "def apply(plan, model, args):\n"
        "    if plan.sequence_parallel and plan.tp < 2:\n"  # the plan alone: its own consistency
        "        raise PlanError('sequence_parallel needs tp >= 2')\n"
        "    if args.precision not in (None, plan.precision):\n"  # what the user asked
        "        raise PlanError('--precision differs from the plan')\n"
        "    if plan.tp > 1:\n"
        "        if moe_experts(model):\n"  # the plan against the model: a capability refusal
        "            raise PlanError('no tp for an MoE model')\n"
        "    limits = model.limits\n"
        "    return getattr(model, 'limits', {})\n")
    fields = governed_fields()
    assert capability_refusals(planted, "train_step.py", fields) == [
        "train_step.py:8 weighs ['plan'] against ['model', 'moe_experts']"]
    assert reads_layout_facts(planted, "train_step.py") == [
        "train_step.py:9 reads model.limits", "train_step.py:10 reads getattr(model, 'limits', {})"]


def test_every_rule_reads_only_what_its_knob_depends_on():
    """The plan space asks a rule knob by knob with the knob's dependencies only."""
    for name, rule in capability.rules().items():
        assert set(rule.reads) <= set(depends_of(knob(name))), name


def _moe_workload(runtime="torch") -> Workload:
    return Workload(profile("moe", dtype="fp32", size="tiny"), load_cluster("cpu", nodes=1, gpus_per_node=4), 8,
                    runtime=runtime)


SP_PLAN = Plan(dp=2, tp=2, micro_batch_size=2, num_micro_batches=2, precision="fp32", sequence_parallel=True)


def test_sequence_parallelism_on_moe_is_refused_by_the_torch_runtime_and_run_by_megatron():
    with pytest.raises(PlanError, match="sequence parallelism with an MoE model"):
        SP_PLAN.validate(_moe_workload())
    SP_PLAN.validate(_moe_workload("megatron"))  # Megatron-Core runs it (it needs it with tp and ep)


@pytest.mark.parametrize("runtime", ["torch", "megatron"])
def test_the_space_holds_only_what_the_runtime_runs(runtime):
    """The masks and `validate` ask the same rules: every plan of the space passes them."""
    workload = _moe_workload(runtime)
    target = capability.Target.of(workload)
    w = walk(workload)
    plans = [plan_of(workload, {k: w.value(k, row) for k in w.values}) for row in range(w.size)]
    assert plans and [capability.refusals(p, target) for p in plans if capability.refusals(p, target)] == []
    on = {p.sequence_parallel for p in plans if p.tp > 1}
    assert on == ({False} if runtime == "torch" else {False, True})


def test_the_executor_asks_the_same_rule_before_any_process_group():
    """`apply` lays the model out on the meta device and asks capability before init_process_group."""
    moe = load_model_file("moe")
    with pytest.raises(PlanError, match="sequence parallelism with an MoE model"):
        apply(SP_PLAN, lambda: moe.build(size="tiny"), lambda params: torch.optim.SGD(params, lr=0.1), moe.loss_fn,
              tp_plan=moe.tp_plan, blocks=moe.blocks, backend="gloo")
    assert not dist.is_initialized()


def test_the_why_rows_come_from_the_runtimes_rules():
    torch_rows = [r.text for r in _excluded(_moe_workload())]
    assert any(text.startswith("sequence parallel on not considered: sequence parallelism with an MoE") for text in
               torch_rows)
    assert _excluded(_moe_workload("megatron")) == []


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_estimate_and_run_agree_on_sequence_parallelism_with_moe(capsys, tmp_path):
    """Issue 38's command: estimate refused it where run's ranks died; both refuse now, in one line,
    before anything launches; under runtime megatron estimate prices it."""
    assert main(["estimate", *SP_ON_MOE]) == 2
    assert "sequence parallelism with an MoE model" in _one_line(capsys)
    path = tmp_path / "plan.json"
    SP_PLAN.save(path)
    assert main(["run", str(path), "moe", "--model-arg", "size=tiny", "--nproc-per-node", "4",
                 "--backend", "gloo", "--cluster", "cpu"]) == 2
    assert "sequence parallelism with an MoE model" in _one_line(capsys)
    assert list(tmp_path.iterdir()) == [path]  # nothing launched, nothing written
    assert main(["estimate", *SP_ON_MOE, "--runtime", "megatron", "--json"]) == 0
    assert "--sequence-parallel" in export_plan(SP_PLAN, "megatron").text  # export targets Megatron-Core: accepted
