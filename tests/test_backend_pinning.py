"""Every test that starts several ranks pins gloo, so `pytest` passes on a machine with one GPU
(or a few): NCCL refuses two ranks on one GPU, and 'auto' would take NCCL wherever the GPUs
suffice. Read from the tests' source (no GPU needed to check it), launch by launch:

* a command line or argument list with `--nproc-per-node N` (N > 1): `gloo` among its arguments
  (`--backend gloo`, or the README example run inside a gloo group the test makes);
* `mp.spawn(worker, ..., nprocs=N)`: every `apply` / `init_process_group` the worker reaches
  (through the module's own functions and methods) passes gloo, and it reaches one;
* `MeasuredReward(..., nproc=N)` (N > 1): `backend="gloo"`.
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GROUP_STARTS = {"apply", "init_process_group"}


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _one(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in (1, "1")


def _strings(node: ast.AST) -> list:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def _pins_gloo(call: ast.Call) -> bool:
    """An `apply` / `init_process_group` call that passes gloo (keyword or first argument)."""
    values = [k.value for k in call.keywords if k.arg == "backend"]
    if _name(call.func) == "init_process_group":
        values += call.args[:1]
    return any(isinstance(v, ast.Constant) and v.value == "gloo" for v in values)


def _reached(tree: ast.Module, start: str) -> list[ast.Call]:
    """The calls to group starters that function `start` reaches through the module's own
    functions (called by name) and methods (called as attributes)."""
    functions = {n.name: [n] for n in tree.body if isinstance(n, ast.FunctionDef)}
    methods = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            methods.setdefault(fn.name, []).append(fn)
    seen, todo, starts = set(), list(functions.get(start, [])), []
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            own = functions if isinstance(call.func, ast.Name) else methods
            if _name(call.func) in own:
                todo += own[_name(call.func)]
            elif _name(call.func) in GROUP_STARTS:
                starts.append(call)
    return starts


def unpinned(source: str, filename: str = "<test>") -> list[str]:
    """`file:line what` of every multi-rank launch in `source` that does not pin gloo."""
    tree, problems = ast.parse(source), []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.List, ast.Tuple, ast.Call)):
            items = node.elts if not isinstance(node, ast.Call) else node.args
            flat = [i.value if isinstance(i, ast.Starred) else i for i in items]
            for i, item in enumerate(flat[:-1]):
                if isinstance(item, ast.Constant) and item.value == "--nproc-per-node" and not _one(flat[i + 1]) \
                        and "gloo" not in _strings(node):
                    problems.append(f"{where} --nproc-per-node without gloo")
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if _name(node.func) == "spawn" and not _one(keywords.get("nprocs")):
            worker = _name(node.args[0]) if node.args else None
            starts = _reached(tree, worker) if worker else []
            if not starts or not all(_pins_gloo(c) for c in starts):
                problems.append(f"{where} mp.spawn worker {worker} does not start its group on gloo")
        if _name(node.func) == "MeasuredReward" and "nproc" in keywords and not _one(keywords["nproc"]) \
                and "gloo" not in _strings(keywords.get("backend", ast.Constant(None))):
            problems.append(f"{where} MeasuredReward with several ranks and no backend='gloo'")
    return problems


def test_every_multi_rank_test_pins_gloo():
    problems = [p for path in sorted(TESTS.glob("*.py")) for p in unpinned(path.read_text(), path.name)]
    assert not problems, problems


@pytest.mark.parametrize("source", [
    'autopar("run", "p.json", "gpt", "--nproc-per-node", 2, cwd=tmp_path)',
    'cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"]',
    'def work(rank):\n    apply(plan, build, opt, loss)\n\ndef test():\n    mp.spawn(work, nprocs=4)',
    'def go(r):\n    dist.init_process_group("nccl")\n\ndef test():\n    mp.spawn(go, args=(1,), nprocs=2)',
    ('class Z:\n    def apply(self):\n        return apply(p, b, o, l, backend="auto")\n'
     'def work(rank):\n    Z().apply()\n\ndef test():\n    mp.spawn(work, nprocs=2)'),
    'reward = MeasuredReward("gpt", {}, nproc=2)',
])
def test_an_unpinned_launch_is_caught(source):
    assert unpinned(source), source


@pytest.mark.parametrize("source", [
    'autopar("run", "p.json", "gpt", "--nproc-per-node", 2, "--backend", "gloo", cwd=tmp_path)',
    'autopar("run", "p.json", "gpt", "--nproc-per-node", "1", cwd=tmp_path)',
    ('class Z:\n    def apply(self):\n        return apply(p, b, o, l, backend="gloo")\n'
     'def work(rank):\n    Z().apply()\n\ndef test():\n    mp.spawn(work, nprocs=2)'),
    'reward = MeasuredReward("gpt", {}, nproc=1)',
])
def test_a_pinned_or_single_rank_launch_passes(source):
    assert not unpinned(source), source
