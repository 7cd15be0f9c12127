"""Which GPUs to rent (issue 42, "choosing the cluster"): an inventory lists GPU presets with the nodes
available and a price per GPU-hour; every bounded choice of nodes per preset gets its best plan, and the
answer is the fastest choice within a budget per hour or the cheapest one that trains the tokens by a deadline,
with the time/cost frontier of the choices beside it.

The inventory is data, never code: `{"name": ..., "groups": [{"preset": "dgx-h100", "nodes": 4,
"price_per_gpu_hour": 2.99, "name": "h100", ...any cluster-document key...}, ...], "link": {...}}`; `link`
(optional) is the link between groups as the mixed cluster JSON takes it. Node counts offered per group are
0, the powers of two below the nodes available, and the nodes available: at most about log2(n) + 2 per group,
so a few groups make tens of choices, not the product of every count.

A choice of one group is planned by the exact homogeneous search (ExhaustivePlanner, the same plan
`autopar search --cluster PRESET --nodes N` gives, about a second); a choice of several groups by the mixed
search (autopar/mixed/search.py `search_mixed`) on the mixed cluster of those groups, tens of seconds each,
so those are searched only where an optimistic estimate of their speed says they could win (`plan_choices`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from autopar.cluster import PRESETS, Cluster, cluster_from_dict, preset_names
from autopar.cluster.mixed import MixedCluster, mixed_from_dict
from autopar.cost import estimate
from autopar.errors import AutoparError, NoValidPlanError
from autopar.knobs import fp8_problem
from autopar.mixed.workload import MixedWorkload
from autopar.schema import MAX_GPUS, Int, check, loads, read_file
from autopar.search.exhaustive import ExhaustivePlanner

OBJECTIVES = ("time", "cost")
PRICE_KEY = "price_per_gpu_hour"
_GROUP_KEYS = ("preset", "nodes", PRICE_KEY)  # required
# what a group may add: its label, and the cluster document's keys (autopar/cluster/io.py) that override its preset
_GROUP_OPTIONAL = ("name", "gpu", "gpus_per_node", "node", "links", "coefficients")
_KEYS = ("groups",)
_OPTIONAL = ("name", "link", "schema_version")
MAX_GROUPS = 8  # the choices grow as the product of each group's node counts
ROOMY = 1e18  # bytes of GPU memory in `relaxed_speed`: no plan is refused for memory
OPTIMISM = 1.1  # slack on the sum of the groups' relaxed speeds before a choice of several is passed over


class InventoryError(AutoparError):
    """A malformed inventory, or flags that cannot choose from it."""


@dataclass(frozen=True)
class Offer:
    """One group of the inventory: its hardware at the nodes available, and the price of one GPU-hour."""

    name: str
    preset: str
    cluster: Cluster  # at the nodes available
    price_per_gpu_hour: float
    document: dict  # the group as written (less name, nodes and price): the mixed cluster JSON's group

    @property
    def nodes(self) -> int:
        return self.cluster.nodes

    def at(self, nodes: int) -> Cluster:
        return self.cluster.with_nodes(nodes)


@dataclass(frozen=True)
class Inventory:
    name: str
    offers: tuple[Offer, ...]
    link: dict | None  # the link between groups as written (None: the mixed cluster's default)

    def price_per_hour(self, nodes: tuple[int, ...]) -> float:
        return sum(n * o.cluster.gpus_per_node * o.price_per_gpu_hour for n, o in zip(nodes, self.offers))

    def label(self, nodes: tuple[int, ...]) -> str:
        """'dgx-h100:2,dgx-a100-80g:1': the groups taken, as the --cluster spec writes them."""
        return ",".join(f"{o.name}:{n}" for n, o in zip(nodes, self.offers) if n)

    def cluster(self, nodes: tuple[int, ...]) -> Cluster | MixedCluster:
        """The cluster of a choice: the group's own at those nodes when one group is taken, else the mixed
        cluster of the groups taken (through the mixed cluster JSON's reader, with the inventory's link)."""
        used = [(n, o) for n, o in zip(nodes, self.offers) if n]
        if len(used) == 1:
            return used[0][1].at(used[0][0])
        document = {"name": self.label(nodes),
                    "groups": [{**o.document, "name": o.name, "nodes": n} for n, o in used],
                    **({"link": self.link} if self.link is not None else {})}
        return mixed_from_dict(document, self.name)

    def choices(self) -> list[tuple[int, ...]]:
        """Every choice of nodes per group (node_choices of each), all-zero left out."""
        return [c for c in itertools.product(*(node_choices(o.nodes) for o in self.offers)) if any(c)]


def node_choices(available: int) -> list[int]:
    """0, the powers of two below `available`, and `available`: the node counts a group offers."""
    return [0] + [2 ** i for i in range(available.bit_length()) if 2 ** i < available] + [available]


def load_inventory(path: str) -> Inventory:
    if not Path(path).exists():
        raise InventoryError(f"inventory file {path!r} not found; give the path of an inventory .json "
                             "(see examples/inventory.json)")
    return inventory_from_dict(loads(read_file(path, "inventory file", InventoryError), path, InventoryError), path)


def inventory_from_dict(d: object, source: str = "inventory") -> Inventory:
    """Validate an inventory document; every problem is one InventoryError line naming `source` and the key."""
    try:
        return _inventory(d)
    except AutoparError as e:
        raise InventoryError(f"{source}: {e}") from None


def _inventory(d: object) -> Inventory:
    d = _object(d, "the inventory")
    _keys(d, "", _KEYS, _OPTIONAL)
    if d.get("schema_version", 1) != 1:
        raise InventoryError(f"schema_version is {d['schema_version']!r}; this autopar reads version 1")
    groups = d["groups"]
    if not isinstance(groups, list) or not groups:
        raise InventoryError("groups must be a non-empty list of {\"preset\", \"nodes\", \"price_per_gpu_hour\"}")
    if len(groups) > MAX_GROUPS:
        raise InventoryError(f"groups lists {len(groups)} groups; at most {MAX_GROUPS} (the choices multiply)")
    offers = [_offer(g, f"groups[{i}]") for i, g in enumerate(groups)]
    names = [o.name for o in offers]
    for name in names:
        if names.count(name) > 1:
            raise InventoryError(f"two groups are named {name!r}; give each a unique \"name\"")
    link = d.get("link")
    if link is not None:
        _object(link, "link")
    name = d.get("name", "inventory")
    if not isinstance(name, str) or not name:
        raise InventoryError(f"name must be a non-empty string, got {name!r}")
    inventory = Inventory(name, tuple(offers), link)
    if len(offers) > 1:  # the group names and the link, as the mixed cluster JSON checks them
        inventory.cluster(tuple(o.nodes for o in offers))
    return inventory


def _offer(g: object, where: str) -> Offer:
    g = _object(g, where)
    _keys(g, where, _GROUP_KEYS, _GROUP_OPTIONAL)
    preset = g["preset"]
    if not isinstance(preset, str) or preset not in PRESETS:
        raise InventoryError(f"{where}.preset is {preset!r}; use one of {', '.join(preset_names())}")
    nodes = g["nodes"]
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InventoryError(f"{where}.nodes must be a positive integer (the nodes available), got {nodes!r}; "
                             "leave out a group with none")
    price = g[PRICE_KEY]
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not math.isfinite(price) or price < 0:
        raise InventoryError(f"{where}.{PRICE_KEY} must be a number >= 0 (dollars per GPU-hour), got {price!r}")
    name = g.get("name", preset)
    if not isinstance(name, str) or not name or any(c in name for c in ":,/"):
        raise InventoryError(f"{where}.name must be a non-empty string without ':', ',' or '/', got {name!r}")
    document = {k: v for k, v in g.items() if k not in ("name", "nodes", PRICE_KEY)}
    cluster = cluster_from_dict({**document, "nodes": nodes}, f"{where} ({name})")
    check(cluster.nodes * cluster.gpus_per_node, Int(1, MAX_GPUS), f"{where}: nodes x gpus_per_node", InventoryError)
    return Offer(name, preset, cluster, float(price), document)


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise InventoryError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _keys(d: dict, where: str, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    prefix = f"{where}." if where else ""
    for key in d:
        if key not in required and key not in optional:
            raise InventoryError(f"unknown key {prefix}{key}; valid keys here: {', '.join(required + optional)}")
    for key in required:
        if key not in d:
            hint = " (dollars per GPU-hour)" if key == PRICE_KEY else ""
            raise InventoryError(f"missing key {prefix}{key}{hint}")


def common_precision(offers, asked: str | None) -> str:
    """The one precision every choice trains in (one model profile): the asked one, which every group's GPU
    must run; else bf16 where every GPU runs it faster than fp32, then fp16, else fp32 (autopar.knobs'
    default_precision over all the groups)."""
    if asked is not None:
        for o in offers:
            problem = fp8_problem(asked, o.cluster.gpu) or (
                None if o.cluster.gpu.peak_flops.get(asked) else
                f"{o.cluster.gpu.name} has no {asked} rate; use another --precision")
            if problem:
                raise InventoryError(f"group {o.name}: {problem}")
        return asked
    rates = [o.cluster.gpu.peak_flops for o in offers]
    return next((p for p in ("bf16", "fp16") if all(r.get(p, 0.0) > r["fp32"] for r in rates)), "fp32")


# -- the choices and their best plans ----------------------------------------------------------------------

@dataclass(frozen=True)
class Option:
    """One choice of nodes per group with its best plan: the point (time, cost) it puts on the frontier."""

    nodes: tuple[int, ...]  # per group of the inventory, in its order
    label: str  # the groups taken, 'name:nodes,...'
    gpus: int
    price_per_hour: float  # dollars for the GPUs taken
    tokens_per_s: float  # the best plan's prediction
    plan: object  # a Plan (one group) or a MixedPlan (several)
    estimate: object  # its Estimate or MixedEstimate
    workload: object  # the Workload or MixedWorkload it was planned on

    @property
    def dollars_per_mtoken(self) -> float:
        return self.price_per_hour / 3600 / self.tokens_per_s * 1e6

    def hours(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 3600

    def dollars(self, tokens: float) -> float:
        return self.price_per_hour * self.hours(tokens)

    def dominates(self, other: Option) -> bool:
        """At least as fast and as cheap per token, and better in one (for any number of tokens: hours and
        dollars both scale with it)."""
        return (self.tokens_per_s >= other.tokens_per_s and self.dollars_per_mtoken <= other.dollars_per_mtoken
                and (self.tokens_per_s > other.tokens_per_s or self.dollars_per_mtoken < other.dollars_per_mtoken))


def best_homogeneous(workload):
    """(plan, estimate) of the exact homogeneous search: what `autopar search --cluster PRESET --nodes N` prints."""
    plan = ExhaustivePlanner().propose(workload, 1)[0]
    return plan, estimate(workload, plan)


def mixed_twin(base, cluster: MixedCluster) -> MixedWorkload:
    """`base` (a Workload) on a mixed cluster: the same model, batch, precision, runtime and headroom."""
    return MixedWorkload(base.profile, cluster, base.global_batch, optimizer=base.optimizer,
                         memory_headroom=base.memory_headroom, runtime=base.runtime, switches=base.switches,
                         expert_imbalance=base.expert_imbalance, fp8=base.fp8)


def relaxed_speed(workload) -> float:
    """Tokens/s of the best plan on `workload`'s hardware with its memory treated as unlimited: what its GPUs
    could add to a mixed plan where holding only part of the model (a pipeline across groups) spares them the
    recompute, sharding or offload they need alone. inf when no plan divides the batch (then no bound)."""
    roomy = dataclasses.replace(workload.cluster, gpu=dataclasses.replace(workload.cluster.gpu, memory_bytes=ROOMY))
    try:
        return best_homogeneous(dataclasses.replace(workload, cluster=roomy))[1].tokens_per_s
    except NoValidPlanError:
        return math.inf


def plan_choices(base, inventory: Inventory, mixed=None, goal: Goal | None = None,
                 progress=None) -> tuple[list[Option], dict[str, str]]:
    """The choices of `inventory` with their best plans, and {label: why it has none} for the others.

    `base`: the Workload (model profile, batch, precision, runtime) every choice trains; a choice of one group
    plans `base` on that group's hardware at those nodes (`best_homogeneous`), a choice of several plans its
    MixedWorkload with `mixed(mixed_workload)` -> (plan, estimate) (None: such choices are left out, said so).
    With a `goal`, a choice over its budget per hour is not planned, and a choice of several groups (whose
    search takes far longer) is searched only when its optimistic point -- OPTIMISM x the sum of its groups'
    `relaxed_speed` at those nodes, at its price -- could still meet the deadline and is not dominated by a
    choice already planned that meets the goal (most promising first); the rest are named with the reason.
    The optimistic speed is an estimate, not a proof: the cost model of a mixed plan composes each group's
    own, and lanes or a pipeline across groups add at most what each group does alone, less the link.
    `progress(done, total)` is called after each choice."""
    options, failed = [], {}
    choices = inventory.choices()
    single = [c for c in choices if sum(1 for n in c if n) == 1]
    several = [c for c in choices if sum(1 for n in c if n) > 1]
    done = 0

    def plan(nodes) -> None:
        nonlocal done
        label, price = inventory.label(nodes), inventory.price_per_hour(nodes)
        cluster = inventory.cluster(nodes)
        try:
            if not isinstance(cluster, MixedCluster):
                workload = dataclasses.replace(base, cluster=cluster)
                best, est = best_homogeneous(workload)
            else:
                workload = mixed_twin(base, cluster)
                best, est = mixed(workload)
            options.append(Option(nodes, label, cluster.num_gpus, price, est.tokens_per_s, best, est, workload))
        except NoValidPlanError as e:
            failed[label] = str(e)

    def skip(nodes) -> str | None:
        """Why a choice needs no planning for the goal (None: plan it)."""
        price = inventory.price_per_hour(nodes)
        if goal is None:
            return None
        if goal.budget_per_hour is not None and price > goal.budget_per_hour:
            return f"not planned: over the budget of ${goal.budget_per_hour:,.2f}/hour"
        if sum(1 for n in nodes if n) == 1:
            return None
        fastest = OPTIMISM * sum(speed(i, n) for i, n in enumerate(nodes) if n)
        if goal.deadline_hours is not None and goal.train_tokens / fastest / 3600 > goal.deadline_hours:
            return (f"not searched: even at an optimistic {fastest:,.0f} tokens/s it misses the deadline of "
                    f"{goal.deadline_hours:g} hours")
        cheapest = price / 3600 / fastest * 1e6
        better = [o for o in options if goal.meets(o) and o.tokens_per_s >= fastest and o.dollars_per_mtoken <= cheapest]
        if better:
            return (f"not searched: {better[0].label} is faster and cheaper than even an optimistic "
                    f"{fastest:,.0f} tokens/s here")
        return None

    speeds: dict[tuple[int, int], float] = {}

    def speed(i: int, n: int) -> float:
        if (i, n) not in speeds:
            speeds[i, n] = relaxed_speed(dataclasses.replace(base, cluster=inventory.offers[i].at(n)))
        return speeds[i, n]

    if mixed is None:
        for nodes in several:
            failed[inventory.label(nodes)] = "not planned: the mixed search is not available"
        several = []

    def promise(nodes):  # the optimistic point's place in the goal's order
        fastest = sum(speed(i, n) for i, n in enumerate(nodes) if n)
        price = inventory.price_per_hour(nodes)
        return (-fastest, price / fastest) if goal is None or goal.objective == "time" else (price / fastest, -fastest)

    for nodes in single + (sorted(several, key=promise) if goal is not None else several):
        why = skip(nodes)
        if why is None:
            plan(nodes)
        else:
            failed[inventory.label(nodes)] = why
        done += 1
        if progress is not None:
            progress(done, len(choices))
    return options, failed


# -- choosing ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Goal:
    """What the user asked: the objective and the limits a choice must meet."""

    objective: str = "time"  # time: the fastest; cost: the cheapest for train_tokens
    budget_per_hour: float | None = None  # dollars per hour at most
    deadline_hours: float | None = None  # train train_tokens within this
    train_tokens: float | None = None

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise InventoryError(f"--objective is {self.objective!r}; use time or cost")
        for flag, value in (("--budget-per-hour", self.budget_per_hour), ("--deadline-hours", self.deadline_hours),
                            ("--train-tokens", self.train_tokens)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InventoryError(f"{flag} must be a positive number, got {value:g}")
        if self.objective == "cost" and (self.deadline_hours is None or self.train_tokens is None):
            raise InventoryError("--objective cost needs --deadline-hours H and --train-tokens T (the cheapest "
                                 "choice that trains T tokens within H hours)")
        if self.deadline_hours is not None and self.train_tokens is None:
            raise InventoryError("--deadline-hours needs --train-tokens T (the tokens to train by the deadline)")

    def meets(self, o: Option) -> bool:
        return ((self.budget_per_hour is None or o.price_per_hour <= self.budget_per_hour)
                and (self.deadline_hours is None or o.hours(self.train_tokens) <= self.deadline_hours))

    def key(self, o: Option):
        """Sort key, best first: the objective, then the other axis, then fewer GPUs."""
        if self.objective == "time":
            return (-o.tokens_per_s, o.dollars_per_mtoken, o.gpus, o.label)
        return (o.dollars_per_mtoken, -o.tokens_per_s, o.gpus, o.label)


def check_budget(inventory: Inventory, goal: Goal) -> None:
    """A budget per hour no choice meets is one line naming the cheapest, before anything is planned."""
    if goal.budget_per_hour is None:
        return
    nodes = min(inventory.choices(), key=inventory.price_per_hour)
    if inventory.price_per_hour(nodes) > goal.budget_per_hour:
        raise InventoryError(f"no choice costs at most ${goal.budget_per_hour:,.2f}/hour: the cheapest, "
                             f"{inventory.label(nodes)}, costs ${inventory.price_per_hour(nodes):,.2f}/hour; raise "
                             "--budget-per-hour")


def frontier(options: list[Option]) -> list[Option]:
    """The options no other dominates, fastest first (of equal points, the one with fewer GPUs)."""
    out, cheapest = [], math.inf
    for o in sorted(options, key=lambda o: (-o.tokens_per_s, o.dollars_per_mtoken, o.gpus, o.label)):
        if o.dollars_per_mtoken < cheapest:
            out.append(o)
            cheapest = o.dollars_per_mtoken
    return out


def choose(options: list[Option], goal: Goal, failed: dict[str, str] | None = None) -> Option:
    """The best option meeting the goal's limits; none meeting them is one line naming the nearest (or, with
    no option at all, the first of `failed`'s reasons)."""
    if not options:
        first = next(iter((failed or {}).items()), None)
        why = "" if first is None else f" ({first[0]}: {first[1]}" + (
            f"; and {len(failed) - 1} more)" if len(failed) > 1 else ")")
        raise InventoryError(f"no choice of the inventory has a plan{why}; add nodes or GPUs with more memory")
    fits = [o for o in options if goal.meets(o)]
    if fits:
        return min(fits, key=goal.key)
    budget, deadline, tokens = goal.budget_per_hour, goal.deadline_hours, goal.train_tokens
    within = [o for o in options if budget is None or o.price_per_hour <= budget]
    if not within:
        nearest = min(options, key=lambda o: (o.price_per_hour, -o.tokens_per_s))
        raise InventoryError(f"no choice with a plan costs at most ${budget:,.2f}/hour: the cheapest, "
                             f"{nearest.label} ({nearest.gpus} GPUs), costs ${nearest.price_per_hour:,.2f}/hour; "
                             "raise --budget-per-hour")
    nearest = max(within, key=lambda o: (o.tokens_per_s, -o.dollars_per_mtoken))
    under = f" within ${budget:,.2f}/hour" if budget is not None else ""
    raise InventoryError(f"no choice{under} trains {tokens:,.4g} tokens in {deadline:g} hours: the fastest, "
                         f"{nearest.label} ({nearest.tokens_per_s:,.0f} tokens/s), takes "
                         f"{nearest.hours(tokens):,.1f} hours (${nearest.dollars(tokens):,.0f}); raise "
                         "--deadline-hours or lower --train-tokens" + (", raise --budget-per-hour" if under else "")
                         + " or add nodes to the inventory")
