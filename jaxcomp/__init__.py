"""jaxcomp: gradient compression for data-parallel JAX.

Compressors are optax ``GradientTransformation``\\ s that exchange packed payloads
through ``jax.shard_map``/``jax.pmap`` collectives, with explicit error-feedback state.
"""

from jaxcomp import codecs
from jaxcomp import elias
from jaxcomp import kernels
from jaxcomp import network
from jaxcomp._src.exchanges.collectives import pmean_tree
from jaxcomp._src.exchanges.collectives import vary
from jaxcomp._src.exchanges.fsdp import fsdp_gather
from jaxcomp._src.exchanges.fsdp import init_fsdp_feedback
from jaxcomp._src.exchanges.qweights import gather_weights
from jaxcomp._src.methods.demo import DeMoState
from jaxcomp._src.methods.demo import decoupled_momentum
from jaxcomp._src.methods.demo import scale_by_decoupled_momentum
from jaxcomp._src.methods.dgc import DGCState
from jaxcomp._src.methods.dgc import dgc
from jaxcomp._src.methods.dgc import dgc_density_schedule
from jaxcomp._src.methods.diloco import DiLoCoState
from jaxcomp._src.methods.diloco import diloco
from jaxcomp._src.methods.hsdp import hsdp
from jaxcomp._src.methods.mipd import MIPDState
from jaxcomp._src.methods.mipd import mipd
from jaxcomp._src.methods.onebit_adam import OneBitAdamState
from jaxcomp._src.methods.onebit_adam import onebit_adam
from jaxcomp._src.methods.onebit_adam import scale_by_onebit_adam
from jaxcomp._src.methods.powersgd import PowerSGDState
from jaxcomp._src.methods.powersgd import powersgd
from jaxcomp._src.methods.qsvrg import QSVRG
from jaxcomp._src.methods.qsvrg import QSVRGState
from jaxcomp._src.methods.qsvrg import QSVRGWireReport
from jaxcomp._src.methods.qsvrg import qsvrg
from jaxcomp._src.methods.qsvrg import qsvrg_wire_report
from jaxcomp._src.methods.sparseloco import sparseloco
from jaxcomp._src.methods.transforms import CompressState
from jaxcomp._src.methods.transforms import PerDeviceState
from jaxcomp._src.methods.transforms import compress
from jaxcomp._src.methods.transforms import default_filter
from jaxcomp._src.methods.transforms import dense_mean
from jaxcomp._src.methods.transforms import ef_signsgd
from jaxcomp._src.methods.transforms import onebit_sgd
from jaxcomp._src.methods.transforms import per_device_state
from jaxcomp._src.methods.transforms import qsgd
from jaxcomp._src.methods.transforms import sparsify
from jaxcomp._src.methods.two_level import NodeShardState
from jaxcomp._src.methods.two_level import TwoLevelState
from jaxcomp._src.methods.two_level import two_level
from jaxcomp._src.methods.wrappers import SkipNonfiniteState
from jaxcomp._src.methods.wrappers import multi_steps
from jaxcomp._src.methods.wrappers import skip_nonfinite
from jaxcomp._src.plumbing.checkpoint import restore_target
from jaxcomp._src.plumbing.checkpoint import unwrap_keys
from jaxcomp._src.plumbing.checkpoint import wrap_keys
from jaxcomp._src.plumbing.collective_trace import CollectiveOp
from jaxcomp._src.plumbing.phases import PhaseProfile
from jaxcomp._src.plumbing.phases import profile_phases
from jaxcomp._src.tools.specs import state_specs
from jaxcomp._src.tools.wire import WireReport
from jaxcomp._src.tools.wire import step_wire_report
from jaxcomp._src.tools.wire import wire_report

__version__ = "0.1.0"

__all__ = [
  "CollectiveOp",
  "CompressState",
  "DGCState",
  "DeMoState",
  "DiLoCoState",
  "MIPDState",
  "NodeShardState",
  "OneBitAdamState",
  "PerDeviceState",
  "PhaseProfile",
  "PowerSGDState",
  "QSVRG",
  "QSVRGState",
  "QSVRGWireReport",
  "SkipNonfiniteState",
  "TwoLevelState",
  "WireReport",
  "codecs",
  "compress",
  "decoupled_momentum",
  "default_filter",
  "dense_mean",
  "ef_signsgd",
  "elias",
  "kernels",
  "dgc",
  "dgc_density_schedule",
  "diloco",
  "fsdp_gather",
  "gather_weights",
  "hsdp",
  "init_fsdp_feedback",
  "mipd",
  "multi_steps",
  "network",
  "onebit_adam",
  "onebit_sgd",
  "per_device_state",
  "pmean_tree",
  "powersgd",
  "profile_phases",
  "qsgd",
  "qsvrg",
  "qsvrg_wire_report",
  "restore_target",
  "scale_by_decoupled_momentum",
  "scale_by_onebit_adam",
  "skip_nonfinite",
  "sparseloco",
  "sparsify",
  "state_specs",
  "step_wire_report",
  "two_level",
  "unwrap_keys",
  "vary",
  "wire_report",
  "wrap_keys",
]
