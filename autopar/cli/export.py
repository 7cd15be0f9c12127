"""`autopar export PLAN --to FRAMEWORK`: the plan in the form Megatron-LM, DeepSpeed, torchtitan
or accelerate reads, and one line naming the knobs that framework cannot express."""

from __future__ import annotations

import sys
from pathlib import Path

from autopar.atomic import write_text_atomic
from autopar.errors import AutoparError
from autopar.export import FRAMEWORKS, export_plan
from autopar.plan import Plan


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a plan as Megatron-LM / DeepSpeed / torchtitan / accelerate settings",
                       description="megatron: Megatron-LM arguments; deepspeed: the DeepSpeed config JSON; "
                                   "torchtitan: its --section.key overrides; accelerate: its config YAML. "
                                   "The knobs the framework cannot express are listed on one line.")
    p.add_argument("plan", metavar="PLAN", help="a plan.json written by `autopar search -o`")
    p.add_argument("--to", required=True, choices=FRAMEWORKS, help="target framework")
    p.add_argument("-o", "--output", metavar="FILE", help="write the export here (default: standard output)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.output and Path(args.output).resolve() == Path(args.plan).resolve():
        raise AutoparError(f"-o {args.output} is the plan being exported; write the {args.to} settings to "
                           f"another file")
    exported = export_plan(Plan.load(args.plan), args.to)
    if args.output:
        write_text_atomic(args.output, exported.text)
        print(f"{args.to} settings written to {args.output}")
        print(exported.unexpressed_line())
    else:  # the export alone on stdout, so it can be piped; the caveat on stderr
        sys.stdout.write(exported.text)
        print(exported.unexpressed_line(), file=sys.stderr)
    return 0
