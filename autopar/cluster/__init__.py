"""The hardware a plan runs on: GPU specs, node wiring, and the link any process group gets.

All bandwidths are one-way bytes/s (one direction of a full-duplex link), latencies seconds.
"""

from autopar.cluster.detect import detect
from autopar.cluster.gpus import GPUS, GPUSpec
from autopar.cluster.hardware import LINK_KINDS, Link, NodeLayout
from autopar.cluster.io import cluster_from_dict, load_cluster
from autopar.cluster.presets import PRESETS, preset_names
from autopar.cluster.topology import Cluster

__all__ = ["GPUS", "LINK_KINDS", "PRESETS", "Cluster", "GPUSpec", "Link", "NodeLayout", "cluster_from_dict",
           "detect", "load_cluster", "preset_names"]
