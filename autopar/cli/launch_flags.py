"""The launcher flags of the commands that run plans (`traces collect`, `traces search`, `train
measured`): `--launcher local|slurm|ray` and each scheduler's settings (docs/cluster.md)."""

from __future__ import annotations

from dataclasses import fields

from autopar.errors import AutoparError
from autopar.traces.launchers import LAUNCHERS, Launcher, LocalLauncher
from autopar.traces.launchers.ray_cluster import RayLauncher
from autopar.traces.launchers.slurm import SlurmLauncher, SlurmSettings, read_settings


def add_launcher_flags(parser, dry_run: bool = True, nodes: bool = True) -> None:
    g = parser.add_argument_group("launcher", "where the plans run (docs/cluster.md)")
    g.add_argument("--launcher", choices=LAUNCHERS, default="local",
                   help="local: this machine (default); slurm: a job per plan through submitit; ray: a Ray Train "
                        "job per plan on a running Ray cluster")
    if nodes:
        g.add_argument("--nodes", type=int, default=1, metavar="N",
                       help="nodes per run, each with the run's ranks per node (slurm and ray; default 1)")
    g.add_argument("--slurm-config", metavar="FILE.json",
                   help="Slurm settings (partition, account, qos, time_min, cpus_per_task, folder, max_requeues, "
                        "setup); the --slurm-* flags win")
    g.add_argument("--slurm-partition", metavar="NAME", help="Slurm partition")
    g.add_argument("--slurm-account", metavar="NAME", help="Slurm account")
    g.add_argument("--slurm-qos", metavar="NAME", help="Slurm quality of service")
    g.add_argument("--slurm-time", dest="slurm_time_min", type=int, metavar="MINUTES",
                   help="each job's time limit (default: the run's --timeout plus 10 minutes)")
    g.add_argument("--slurm-cpus-per-task", type=int, metavar="N", help="cores per node (default: one per rank)")
    g.add_argument("--slurm-folder", metavar="DIR",
                   help="submitit's job folder, on a filesystem every node shares (default ./autopar-slurm)")
    g.add_argument("--slurm-max-requeues", type=int, metavar="N",
                   help="times a preempted job is requeued (default 3); then its record's outcome is 'preempted'")
    g.add_argument("--slurm-local", action="store_true",
                   help="run the Slurm submissions through submitit's local executor, on this machine")
    if dry_run:
        g.add_argument("--dry-run", action="store_true",
                       help="print the sbatch script of each plan's job and submit nothing (slurm)")
    g.add_argument("--ray-address", default="auto", metavar="HOST:PORT",
                   help="the running Ray cluster to join (default auto: the one this machine belongs to)")


def launcher_from_args(args, say=lambda msg: None) -> Launcher:
    """The launcher the flags name; scheduler flags without their launcher are refused."""
    nodes = getattr(args, "nodes", 1)
    if nodes < 1:
        raise AutoparError(f"--nodes must be at least 1, got {nodes}")
    if args.launcher != "slurm" and (args.slurm_local or getattr(args, "dry_run", False)):
        raise AutoparError("--slurm-local and --dry-run go with --launcher slurm")
    if args.launcher == "slurm":
        launcher = SlurmLauncher(settings_from(args), say)
        if not getattr(args, "dry_run", False):
            launcher.check_scheduler()
        return launcher
    if args.launcher == "ray":
        return RayLauncher(args.ray_address, say)
    if nodes != 1:
        raise AutoparError(f"the local launcher runs on this machine alone, got --nodes {nodes}; use "
                           f"--launcher slurm or ray")
    return LocalLauncher()


def settings_from(args) -> SlurmSettings:
    """--slurm-config's file, then the --slurm-* flags given over it."""
    values = read_settings(args.slurm_config) if args.slurm_config else {}
    for f in fields(SlurmSettings):
        given = getattr(args, f"slurm_{f.name}", None)
        if given is not None and given is not False:
            values[f.name] = given
    return SlurmSettings(**values)
