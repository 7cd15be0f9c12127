"""The two small value types a cluster is described with: a link rate and a node layout.

All bandwidths are ONE-WAY bytes/s (what one direction of a full-duplex link carries), the
convention of datasheets ("NVLink3: 300 GB/s per GPU each way") and of nccl-tests' busbw.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import ClusterError

# nvlink: GPU <-> NVSwitch; pcie: GPU/NIC <-> PCIe switch <-> CPU root complex; upi: between CPU
# sockets (QPI/UPI/xGMI); ib / ethernet: NIC <-> network fabric; shm: a gloo worker process <->
# host memory (local CPU runs).
LINK_KINDS = ("nvlink", "pcie", "upi", "ib", "ethernet", "shm")
INTRA_KINDS = ("nvswitch", "pcie", "shm")
NIC_ATTACH = ("switch", "cpu")
NIC_KINDS = ("ib", "ethernet")


@dataclass(frozen=True)
class Link:
    """A link rate: of one physical edge, or what a collective over a group of ranks gets.

    bandwidth: one-way bytes/s per GPU, the raw datasheet rate (the cost model applies a
    per-kind efficiency); latency: seconds per hop; kind: one of LINK_KINDS, or "none" for a
    group of one rank.
    """

    bandwidth: float
    latency: float
    kind: str


@dataclass(frozen=True)
class NodeLayout:
    """How one node is wired; all nodes of a cluster are alike.

    intra: "nvswitch" (every GPU has its own NVLink port on a switch, and PCIe for NIC and host
    traffic), "pcie" (GPUs talk over the PCIe tree), or "shm" (gloo worker processes on one host).
    GPUs hang `gpus_per_pcie_switch` to a PCIe switch (0: straight on a CPU root complex), the
    switches are spread over `sockets` CPUs, and `nics` network adapters sit either beside the
    GPUs on the PCIe switches ("switch", as on DGX) or on the root complexes ("cpu").
    """

    intra: str
    sockets: int
    gpus_per_pcie_switch: int
    nics: int
    nic_attach: str
    nic_kind: str

    def __post_init__(self):
        for name, value, valid in (("intra", self.intra, INTRA_KINDS), ("nic_attach", self.nic_attach, NIC_ATTACH),
                                   ("nic_kind", self.nic_kind, NIC_KINDS)):
            if value not in valid:
                raise ClusterError(f"node.{name} is {value!r}; use one of {', '.join(valid)}")
        if self.sockets < 1:
            raise ClusterError(f"node.sockets is {self.sockets}; a node has at least 1 CPU socket")
        if self.gpus_per_pcie_switch < 0 or self.nics < 0:
            raise ClusterError("node.gpus_per_pcie_switch and node.nics must be >= 0")
        if self.intra == "shm" and self.gpus_per_pcie_switch:
            raise ClusterError("node.gpus_per_pcie_switch must be 0 when node.intra is 'shm' "
                               "(worker processes are not on PCIe)")
        if self.nic_attach == "switch" and not self.gpus_per_pcie_switch:
            raise ClusterError("node.nic_attach is 'switch' but node.gpus_per_pcie_switch is 0 (no PCIe switches); "
                               "use nic_attach 'cpu'")

    def kinds(self) -> set[str]:
        """The link kinds this layout's graph has edges of (each needs a rate in `links`)."""
        kinds = {"nvswitch": {"nvlink", "pcie"}, "pcie": {"pcie"}, "shm": {"shm"}}[self.intra]
        if self.sockets > 1:
            kinds.add("upi")
        if self.nics:
            kinds |= {"pcie", self.nic_kind}
        return kinds
