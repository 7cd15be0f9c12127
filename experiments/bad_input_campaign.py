"""Bad inputs, run as a user would: every case through the `autopar` command line in a fresh
folder, each with a 20 s bound. A case is clean when autopar exits with status 2 and its error is
one line, the only one on stderr ("autopar: error: ..."; nothing printed before it but the
profiler's notice that a model file keeps it waiting, `autopar.profile.isolated.PROGRESS`),
with no Python traceback, and leaves the output it was asked to write (a sentinel file, or the
odd path itself) untouched.

    python experiments/bad_input_campaign.py [--only SUBSTRING] [--jobs 2] [--list]

Prints one line per case that is not clean, then the totals:
tried / clean / tracebacks / hangs / accepted (exit 0) / wrong exit (another status, or more than
one line). The same case list is the concrete half of tests/test_bad_input.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autopar.profile.isolated import PROGRESS  # noqa: E402 - the checkout's autopar, as the cases run it
TIMEOUT_S = 20
TINY = ["--model-arg", "size=tiny"]
SEARCH = ["search", "gpt", *TINY, "--cluster", "cpu", "--global-batch", "8"]
SENTINEL = "sentinel: autopar must not touch this file\n"

# special file contents
FIFO, DIRECTORY, LOOP, UNDER_FILE = "<fifo>", "<dir>", "<symlink loop>", "<under a regular file>"


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple  # "{d}" stands for the case's folder
    files: dict = field(default_factory=dict)  # name -> text, JSON-able object, or a special kind above
    output: str | None = "out.json"  # a sentinel written here first must survive (None: nothing to check)
    slow: bool = False  # needs a child process to run into a time bound

    def command(self, d: Path) -> list[str]:
        return [a.replace("{d}", str(d)) for a in self.argv]


def _cluster(**over) -> dict:
    return {"preset": "cpu", **over}


def _coef(**over) -> dict:
    return _cluster(coefficients=over)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _plan(**over) -> dict:
    base = {"schema_version": 1, "dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_micro_batches": 2,
            "precision": "fp32"}
    return {**base, **over}


RAW = object()  # marks a file text written verbatim


def cluster_cases() -> list[Case]:
    docs = {
        "coeff_string": _coef(gemm_efficiency="0.8"), "coeff_null": _coef(gemm_efficiency=None),
        "coeff_list": _coef(gemm_efficiency=[0.8]), "coeff_mapping_number": _coef(link_efficiency=1),
        "collective_string": _coef(collective_efficiency="x"), "host_overlap_zero": _coef(host_overlap=0),
        "coeff_negative": _coef(gemm_efficiency=-0.5), "coeff_zero": _coef(hbm_efficiency=0),
        "coeff_over_one": _coef(gemm_efficiency=7), "link_eff_negative": _coef(link_efficiency={"shm": -1}),
        "link_eff_unknown": _coef(link_efficiency={"warp": 0.5}), "coeff_unknown": _coef(colour=1),
        "coeff_bool": _coef(latency_scale=True), "preset_list": {"preset": ["cpu"]},
        "preset_number": {"preset": 3}, "nodes_huge": _cluster(nodes=10**9), "nodes_string": _cluster(nodes="many"),
        "nodes_float": _cluster(nodes=2.5), "gpn_huge": _cluster(gpus_per_node=10**8),
        "bandwidth_negative": _cluster(links={"shm": {"bandwidth": -1, "latency": 1e-5}}),
        "bandwidth_string": _cluster(links={"shm": {"bandwidth": "fast", "latency": 1e-5}}),
        "document_list": [], "document_string": "cpu", "gpu_memory_zero": {**_cluster(),
                                                                             "gpu": {"name": "x", "peak_flops": {
                                                                                 "bf16": 1e12, "fp16": 1e12,
                                                                                 "fp32": 1e12},
                                                                                 "memory_bytes": 0,
                                                                                 "hbm_bytes_per_s": 1e12}},
    }
    cases = [Case(f"cluster/{k}", (*SEARCH[:-4], "--global-batch", "8", "--cluster", "{d}/c.json", "-o",
                                   "{d}/out.json"), {"c.json": v}) for k, v in docs.items()]
    raw = {"coeff_nan": '{"preset": "cpu", "coefficients": {"gemm_efficiency": NaN}}',
           "coeff_inf": '{"preset": "cpu", "coefficients": {"host_overlap": Infinity}}',
           "coeff_1e400": '{"preset": "cpu", "coefficients": {"gemm_half_flops": 1e400}}',
           "int_10e400": '{"preset": "cpu", "links": {"shm": {"bandwidth": 1' + "0" * 400 + ', "latency": 0}}}',
           "nested_deep": '{"preset": "cpu", "coefficients": {"x": ' + _nested(100_000) + '}}',
           "nested_33": '{"preset": "cpu", "coefficients": {"x": ' + _nested(40) + '}}',
           "invalid_json": '{"preset": "cpu",', "empty": "", "not_utf8": "\udcff"}
    cases += [Case(f"cluster/{k}", ("search", "gpt", *TINY, "--global-batch", "8", "--cluster", "{d}/c.json", "-o",
                                    "{d}/out.json"), {"c.json": (RAW, v)}) for k, v in raw.items()]
    for kind, special in (("fifo", FIFO), ("directory", DIRECTORY), ("symlink_loop", LOOP)):
        cases.append(Case(f"cluster/{kind}", ("search", "gpt", *TINY, "--global-batch", "8", "--cluster",
                                              "{d}/c.json", "-o", "{d}/out.json"), {"c.json": special}))
    return cases


def plan_cases() -> list[Case]:
    docs = {"recompute_blocks_string": _plan(recompute_blocks="2"), "recompute_blocks_float": _plan(
        recompute="full", recompute_blocks=2.5), "layer_split_string": _plan(layer_split="a"),
        "layer_split_int": _plan(layer_split=4), "layer_split_null": _plan(layer_split=[None]),
        "layer_split_floats": _plan(layer_split=[1.0]), "dp_huge": _plan(dp=10**30), "dp_negative": _plan(dp=-2),
        "dp_string": _plan(dp="2"), "dp_bool": _plan(dp=True), "bucket_tiny": _plan(bucket_mb=1e-9),
        "bucket_string": _plan(bucket_mb="25"), "mesh_order_number": _plan(mesh_order=5),
        "mesh_order_dupes": _plan(mesh_order=["dp", "dp", "tp"]), "precision_number": _plan(precision=7),
        "zero_five": _plan(zero=5), "schedule_list": _plan(schedule=["1f1b"]), "unknown_key": _plan(colour="red"),
        "no_version": {k: v for k, v in _plan().items() if k != "schema_version"}, "version_3": _plan(schema_version=3),
        "missing_dp": {k: v for k, v in _plan().items() if k != "dp"}, "document_list": [1, 2],
        "sequence_parallel_string": _plan(sequence_parallel="yes")}
    base = ("estimate", "gpt", *TINY, "--cluster", "cpu", "--plan", "{d}/p.json")
    cases = [Case(f"plan/{k}", base, {"p.json": v}, output=None) for k, v in docs.items()]
    raw = {"bucket_inf": json.dumps(_plan()).replace('"precision"', '"bucket_mb": Infinity, "precision"'),
           "bucket_nan": json.dumps(_plan()).replace('"precision"', '"bucket_mb": NaN, "precision"'),
           "nested_deep": '{"schema_version": 1, "layer_split": ' + _nested(100_000) + '}',
           "invalid_json": "{", "empty": ""}
    cases += [Case(f"plan/{k}", base, {"p.json": (RAW, v)}, output=None) for k, v in raw.items()]
    cases += [Case("plan/fifo", base, {"p.json": FIFO}, output=None),
              Case("plan/directory", base, {"p.json": DIRECTORY}, output=None)]
    # `autopar run` reads the plan before anything starts
    cases += [Case("run/plan_dp_huge", ("run", "{d}/p.json", "gpt", *TINY), {"p.json": _plan(dp=10**30)}, output=None)]
    return cases


def flag_cases() -> list[Case]:
    o = ("-o", "{d}/out.json")
    flags = {
        "nodes_huge": ("--nodes", "1000000000"), "gpn_huge": ("--gpus-per-node", "100000000"),
        "batch_huge": ("--global-batch", str(10**18)), "batch_zero": ("--global-batch", "0"),
        "batch_negative": ("--global-batch", "-5"), "nodes_zero": ("--nodes", "0"), "seq_len_zero": ("--seq-len", "0"),
        "top_k_zero": ("--top-k", "0"), "method_unknown": ("--method", "nope"),
        "random_seed_negative": ("--method", "random", "--seed", "-1"), "random_trials_zero": ("--method", "random",
                                                                                              "--trials", "0"),
        "optuna_trials_zero": ("--method", "optuna", "--trials", "0"), "model_arg_no_equals": ("--model-arg", "size"),
        "profile_timeout_zero": ("--profile-timeout", "0"), "profile_timeout_nan": ("--profile-timeout", "nan"),
        "policy_missing": ("--method", "rl", "--policy", "{d}/nope.zip"),
        "optuna_storage_bad": ("--method", "optuna", "--storage", "sqlite:////nonexistent/dir/s.db"),
    }
    search = ("search", "gpt", *TINY, "--cluster", "cpu")
    cases = [Case(f"search/{k}", (*search, *(v if "--global-batch" in v else (*v, "--global-batch", "8")), *o))
             for k, v in flags.items()]
    est = ("estimate", "gpt", *TINY, "--cluster", "cpu")
    cases += [Case("estimate/dp_zero", (*est, "--dp", "0", "--micro-batch", "1"), output=None),
              Case("estimate/tp_zero", (*est, "--dp", "1", "--tp", "0", "--micro-batch", "1"), output=None),
              Case("estimate/pp_huge", (*est, "--dp", "1", "--pp", str(10**12), "--micro-batch", "1"), output=None),
              Case("estimate/bucket_inf", (*est, "--dp", "1", "--micro-batch", "1", "--bucket-mb", "inf"), output=None),
              Case("estimate/bucket_nan", (*est, "--dp", "1", "--micro-batch", "1", "--bucket-mb", "nan"), output=None),
              Case("memory/batch_huge", ("memory", "gpt", *TINY, "--cluster", "cpu", "--dp", "1", "--micro-batch",
                                         "1", "--global-batch", str(10**18)), output=None)]
    run = ("run", "{d}/p.json", "gpt", *TINY)
    plan = {"p.json": _plan(dp=1, micro_batch_size=2, num_micro_batches=1)}
    cases += [Case(f"run/{k}", (*run, *v), {**plan, **extra}, output=None) for k, (v, extra) in {
        "timeout_nan": (("--timeout", "nan"), {}), "timeout_inf": (("--timeout", "inf"), {}),
        "timeout_zero": (("--timeout", "0"), {}), "master_port_huge": (("--master-port", "99999"), {}),
        "lr_nan": (("--lr", "nan"), {}), "lr_negative": (("--lr", "-1"), {}), "steps_zero": (("--steps", "0"), {}),
        "world_mismatch": (("--nproc-per-node", "3"), {}),
        "trace_directory": (("--trace", "{d}/tdir"), {"tdir": DIRECTORY}),
        "trace_fifo": (("--trace", "{d}/t.fifo"), {"t.fifo": FIFO}),
    }.items()]
    return cases


def output_cases() -> list[Case]:
    """-o that autopar must refuse before working: a directory, a path under a regular file,
    /proc, a symlink, a FIFO, and (as root) a device."""
    targets = {"directory": ("{d}/odir", {"odir": DIRECTORY}), "under_file": ("{d}/f/out.json", {"f": "x"}),
               "proc": ("/proc/autopar-out.json", {}), "symlink": ("{d}/link.json", {"link.json": "<symlink>"}),
               "fifo": ("{d}/o.fifo", {"o.fifo": FIFO})}
    if os.geteuid() == 0:
        targets["dev_null"] = ("/dev/null", {})
    commands = {
        "search": ("search", "gpt", *TINY, "--cluster", "cpu", "--global-batch", "8", "-o"),
        "calibrate": ("calibrate", "{d}/t.jsonl", "--cluster", "cpu", "-o"),
        "traces_import": ("traces", "import", "vtrain", "{d}/v.csv", "-o"),
        "traces_collect": ("traces", "collect", "gpt", *TINY, "--cluster", "cpu", "--plans", "2", "-o"),
        "profile_cluster": ("profile-cluster", "-o"),
        "train": ("train", "cost", "--timesteps", "64", "-o"),
    }
    cases = []
    for cname, argv in commands.items():
        for tname, (target, files) in targets.items():
            cases.append(Case(f"output/{cname}/{tname}", (*argv, target), {**files, "t.jsonl": "", "v.csv": "a,b\n"},
                              output=None))
    cases.append(Case("output/train/policy_json", ("train", "cost", "--timesteps", "64", "-o", "{d}/pol.json"), {},
                      None))
    cases.append(Case("output/train/resume_nothing", ("train", "cost", "--timesteps", "64", "--resume", "-o",
                                                      "{d}/pol.zip"), {}, None))
    return cases


MODELS = {
    "import_loop": "while True:\n    pass\n",
    "build_loop": "import torch\ndef build_model():\n    while True:\n        pass\n"
                  "def example_batch(b):\n    return torch.zeros(b, 2), torch.zeros(b)\n",
    "import_sleep": "import time\ntime.sleep(3600)\n",
    "sys_exit_0": "import sys\nsys.exit(0)\n", "sys_exit_3": "import sys\nsys.exit(3)\n",
    "os_exit": "import os\nos._exit(3)\n", "keyboard_interrupt": "raise KeyboardInterrupt\n",
    "base_exception": "class Stop(BaseException):\n    pass\nraise Stop('stop')\n",
    "sigkill_self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "build_exit": "import sys, torch\ndef build_model():\n    sys.exit(4)\n"
                  "def example_batch(b):\n    return torch.zeros(b, 2), torch.zeros(b)\n",
    "syntax_error": "def build_model(:\n", "no_build": "x = 1\n", "raises": "raise ValueError('boom')\n",
    "build_returns_int": "import torch\ndef build_model():\n    return 3\n"
                         "def example_batch(b):\n    return torch.zeros(b, 2), torch.zeros(b)\n",
}


def model_cases() -> list[Case]:
    base = ("search", "{d}/model.py", "--cluster", "cpu", "--global-batch", "8", "--profile-timeout", "10", "-o",
            "{d}/out.json")
    cases = [Case(f"model/{k}", base, {"model.py": v}, slow=k.endswith(("loop", "sleep"))) for k, v in MODELS.items()]
    cases += [Case(f"model/{k}", base, {"model.py": v}) for k, v in
              (("fifo", FIFO), ("symlink_loop", LOOP), ("directory", DIRECTORY))]
    cases.append(Case("model/missing", ("search", "{d}/nope.py", "--cluster", "cpu", "-o", "{d}/out.json")))
    return cases


def trace_cases() -> list[Case]:
    """Traces are data: a record naming a Python file must not run it."""
    evil = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n" \
           "import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n" \
           "def example_batch(b):\n    return torch.zeros(b, 2), torch.zeros(b, dtype=torch.long)\n"
    record = {"schema_version": 1, "time": "2026-01-01T00:00:00+00:00",
              "cluster": {"name": "cpu", "nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "backend": "gloo"},
              "model": {"name": "evil", "path": "{d}/evil.py", "digest": "0" * 64, "args": {}, "dims": {},
                        "params": 6},
              "workload": {"global_batch": 4, "seq_len": 1}, "plan": _plan(micro_batch_size=1),
              "measured": {"step_times_s": [0.1], "median_step_s": 0.1, "tokens_per_s": 40.0,
                           "peak_memory_bytes": [1.0, 1.0], "losses": [1.0]},
              "predicted": None, "outcome": "ok", "error": None, "versions": {}}
    files = {"evil.py": evil, "t.jsonl": ("<records>", [record] * 4)}
    relative = {**record, "model": {**record["model"], "path": "../" * 12 + "{d}/evil.py"}}
    return [
        Case("trust/calibrate", ("calibrate", "{d}/t.jsonl", "--cluster", "cpu", "-o", "{d}/out.json"), files),
        Case("trust/calibrate_relative", ("calibrate", "{d}/t.jsonl", "--cluster", "cpu", "-o", "{d}/out.json"),
             {**files, "t.jsonl": ("<records>", [relative] * 4)}),
        Case("trust/train", ("train", "traces", "{d}/t.jsonl", "--cluster", "cpu", "-o", "{d}/pol.zip"), files,
             output=None),
    ]


def policy_cases() -> list[Case]:
    import io
    import zipfile

    import numpy as np
    from autopar.policies.load import ACTOR_ENTRY, META_ENTRY, default_policy_path

    with zipfile.ZipFile(default_policy_path()) as z:
        meta = z.read(META_ENTRY)
        with np.load(io.BytesIO(z.read(ACTOR_ENTRY))) as a:
            weights = {k: a[k] for k in a.files}

    def policy(ws: dict, meta_bytes: bytes = meta, pickle: bool = False) -> bytes:
        buf = io.BytesIO()
        arrays = io.BytesIO()
        if pickle:
            np.savez(arrays, **{**ws, "action_net.weight": np.array([object()], dtype=object)})
        else:
            np.savez(arrays, **ws)
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr(META_ENTRY, meta_bytes)
            z.writestr(ACTOR_ENTRY, arrays.getvalue())
        return buf.getvalue()

    missing = {k: v for k, v in weights.items() if k != "action_net.bias"}
    reshaped = {**weights, "action_net.weight": weights["action_net.weight"][:, :5]}
    nan = {**weights, "action_net.bias": weights["action_net.bias"] * np.nan}
    bad = {"missing_weight": policy(missing), "wrong_shape": policy(reshaped), "nan_weight": policy(nan),
           "pickled_array": policy(weights, pickle=True), "meta_nested": policy(weights, _nested(100_000).encode()),
           "meta_list": policy(weights, b"[]"), "not_zip": b"not a zip"}
    base = ("search", "gpt", *TINY, "--cluster", "cpu", "--global-batch", "8", "--method", "rl", "--policy",
            "{d}/pol.zip", "-o", "{d}/out.json")
    return [Case(f"policy/{k}", base, {"pol.zip": ("<bytes>", v)}) for k, v in bad.items()]


def table_cases() -> list[Case]:
    """CSV inputs named on the command line: a FIFO or a directory must not block or crash."""
    cases = []
    for kind, special in (("fifo", FIFO), ("directory", DIRECTORY)):
        cases.append(Case(f"csv/vtrain_{kind}", ("traces", "import", "vtrain", "{d}/v.csv", "-o", "{d}/out.json"),
                          {"v.csv": special}))
        cases.append(Case(f"csv/allreduce_{kind}", ("calibrate", "--allreduce", "{d}/a_2gpu.csv", "--cluster", "cpu",
                                                    "-o", "{d}/out.json"), {"a_2gpu.csv": special}))
    cases.append(Case("csv/allreduce_garbage", ("calibrate", "--allreduce", "{d}/a_2gpu.csv", "--cluster", "cpu",
                                                "-o", "{d}/out.json"), {"a_2gpu.csv": "x,y\n1,nan\n"}))
    cases.append(Case("trace/show_fifo", ("traces", "show", "{d}/t.jsonl"), {"t.jsonl": FIFO}, output=None))
    return cases


def workload_spec_cases() -> list[Case]:
    """`autopar train cost --workloads FILE.json`: a list of workload specs."""
    spec = {"model": "gpt", "model_args": {"size": "tiny"}, "cluster": "cpu", "global_batch": 8}
    docs = {"not_a_list": spec, "nodes_string": [{**spec, "nodes": "many"}], "batch_huge": [{**spec,
            "global_batch": 10**18}], "gpn_zero": [{**spec, "gpus_per_node": 0}], "precision_bad": [{**spec,
            "precision": "fp8"}], "unknown_key": [{**spec, "colour": 1}], "no_model": [{"cluster": "cpu"}],
            "nested_deep": (RAW, "[" + _nested(100_000) + "]"), "count_huge": None}
    train = ("train", "cost", "--workloads")
    cases = [Case(f"workloads/{k}", (*train, "{d}/w.json", "--timesteps", "64", "-o", "{d}/pol.zip"),
                  {"w.json": v}, output=None) for k, v in docs.items() if v is not None]
    cases.append(Case("workloads/count_huge", (*train, "10000000000", "-o", "{d}/pol.zip"), {}, None))
    return cases


def first_hour_cases() -> list[Case]:
    """Issue 39 point 8: what a new user hit in the first hour (each was accepted, a traceback, or
    work done before the error)."""
    est = ("estimate", "gpt", *TINY, "--cluster", "cpu")
    cases = [Case(f"plan/mesh_order_{k}", (*est, "--plan", "{d}/p.json"), {"p.json": _plan(mesh_order=v)}, output=None)
             for k, v in (("partial", ["pp", "dp"]), ("null", None))]
    cases.append(Case("estimate/mesh_order_partial", (*est, "--dp", "1", "--micro-batch", "1", "--global-batch", "8",
                                                      "--mesh-order", "pp,dp"), output=None))
    cases.append(Case("run/trace_under_file", ("run", "{d}/p.json", "gpt", *TINY, "--trace", "{d}/f/t.jsonl"),
                      {"p.json": _plan(dp=1, micro_batch_size=2, num_micro_batches=1), "f": "x"}, output=None))
    cases.append(Case("workloads/empty_list", ("train", "cost", "--workloads", "{d}/w.json", "--timesteps", "64", "-o",
                                               "{d}/pol.zip"), {"w.json": []}, output="pol.zip"))
    measured = ("train", "measured", "gpt", *TINY, "--cache", "{d}/c.json", "-o", "{d}/pol.zip")
    cases += [Case(f"measured/cache_{k}", measured, {"c.json": v}, output=None) for k, v in
              (("corrupt", (RAW, "{bad")), ("directory", DIRECTORY), ("list", [1, 2]), ("fifo", FIFO),
               ("bad_entry", {"k": {"reward": "x", "record": None}}))]
    cases += [Case(f"profile_cluster/timeout_{k}", ("profile-cluster", "--timeout", v, "-o", "{d}/out.json"))
              for k, v in (("zero", "0"), ("negative", "-3"), ("tiny", "0.01"), ("nan", "nan"))]
    record = trace_cases()[0].files["t.jsonl"][1][0]
    bundled = {**record, "model": {**record["model"], "name": "gpt", "path": "gpt", "args": {"size": "tiny"}}}
    cases.append(Case("calibrate/one_run", ("calibrate", "{d}/t.jsonl", "--cluster", "cpu", "-o", "{d}/out.json"),
                      {"t.jsonl": ("<records>", [bundled] * 3)}))
    cases.append(Case("calibrate/no_model_args", ("calibrate", "{d}/t.jsonl", "--cluster", "cpu", "-o",
                                                  "{d}/out.json"),
                      {"t.jsonl": ("<records>", [{**bundled, "model": {**bundled["model"], "args": None}}] * 3)}))
    return cases


def all_cases() -> list[Case]:
    return cluster_cases() + plan_cases() + flag_cases() + output_cases() + model_cases() + trace_cases() \
        + policy_cases() + workload_spec_cases() + table_cases() + first_hour_cases()


# -- running ------------------------------------------------------------------------------------------------
def materialise(case: Case, d: Path) -> None:
    for name, content in case.files.items():
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == FIFO:
            os.mkfifo(path)
        elif content == DIRECTORY:
            path.mkdir()
        elif content == LOOP:
            os.symlink(path.with_suffix(".b"), path)
            os.symlink(path, path.with_suffix(".b"))
        elif content == "<symlink>":
            (d / "target.txt").write_text(SENTINEL)
            os.symlink(d / "target.txt", path)
        elif isinstance(content, tuple) and content[0] is RAW:
            path.write_bytes(content[1].encode("utf-8", errors="surrogateescape"))
        elif isinstance(content, tuple) and content[0] == "<bytes>":
            path.write_bytes(content[1])
        elif isinstance(content, tuple) and content[0] == "<records>":
            path.write_text("".join(json.dumps(r).replace("{d}", str(d)) + "\n" for r in content[1]))
        elif isinstance(content, str):
            path.write_text(content)
        else:
            path.write_text(json.dumps(content))
    if case.output:
        (d / case.output).write_text(SENTINEL)


def snapshot(d: Path) -> dict:
    """What lies in the case folder (kind and bytes), to tell that nothing was touched."""
    out = {}
    for p in sorted(d.rglob("*")):
        kind = "link" if p.is_symlink() else "fifo" if p.is_fifo() else "dir" if p.is_dir() else "file"
        out[str(p.relative_to(d))] = (kind, p.read_bytes() if kind == "file" else None)
    return out


@dataclass
class Outcome:
    case: Case
    verdict: str  # clean | traceback | hang | accepted | wrong exit | touched
    detail: str


def run_case(case: Case, env: dict) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="autopar-bad-") as tmp:
        d = Path(tmp)
        materialise(case, d)
        before = snapshot(d)
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "autopar", *case.command(d)], cwd=d, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  errors="replace", start_new_session=True, check=False)
        except subprocess.TimeoutExpired:
            return Outcome(case, "hang", f"no answer within {TIMEOUT_S} s")
        wall = time.monotonic() - started
        err = [line for line in done.stderr.splitlines() if line.strip()]
        touched = sorted(k for k in before if before[k] != snapshot(d).get(k))
        if "Traceback (most recent call last)" in done.stderr:
            return Outcome(case, "traceback", err[-1] if err else "")
        if done.returncode == 0:
            return Outcome(case, "accepted", (done.stdout.strip().splitlines() or [""])[-1][:160])
        errors = [line for line in err if line.startswith("autopar: error: ")]
        before = [line for line in err[:-1] if not line.startswith(PROGRESS)]
        if done.returncode != 2 or len(errors) != 1 or err[-1] != errors[0] or before:
            return Outcome(case, "wrong exit", f"exit {done.returncode}, {len(err)} stderr line(s): "
                                               f"{(err or [''])[-1][:160]}" + (f" after {before[0][:80]}" if before
                                                                               else ""))
        if touched or (d / "RAN").exists():
            return Outcome(case, "touched", f"changed {touched}" + (" and ran the trace's model" if
                                                                     (d / "RAN").exists() else ""))
        return Outcome(case, "clean", f"{wall:.1f} s: {err[-1][:200]}")


def campaign_env(cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "AUTOPAR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--list", action="store_true", help="list the cases and stop")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case, clean ones too")
    args = ap.parse_args()
    cases = [c for c in all_cases() if args.only in c.name]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    cache = Path(tempfile.mkdtemp(prefix="autopar-campaign-cache-"))
    try:
        env = campaign_env(cache)
        # a warm profile cache, as a user's would be after the first search
        subprocess.run([sys.executable, "-m", "autopar", *SEARCH], env=env, capture_output=True, check=False)
        with ThreadPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(lambda c: run_case(c, env), cases))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    counts = {v: 0 for v in ("clean", "traceback", "hang", "accepted", "wrong exit", "touched")}
    for o in outcomes:
        counts[o.verdict] += 1
        if o.verdict != "clean" or args.verbose:
            print(f"{o.verdict:10s} {o.case.name}: {o.detail}")
    print(f"tried {len(outcomes)} / clean {counts['clean']} / tracebacks {counts['traceback']} / hangs "
          f"{counts['hang']} / accepted {counts['accepted']} / wrong exit {counts['wrong exit']} / output touched "
          f"{counts['touched']}")
    return 0 if counts["clean"] == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
