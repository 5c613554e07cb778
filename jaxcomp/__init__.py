"""jaxcomp: gradient compression for data-parallel JAX.

Compressors are optax ``GradientTransformation``\\ s that exchange packed payloads
through ``jax.shard_map``/``jax.pmap`` collectives, with explicit error-feedback state.
"""

from jaxcomp import codecs
from jaxcomp import elias
from jaxcomp import kernels
from jaxcomp import network
from jaxcomp._src.checkpoint import restore_target
from jaxcomp._src.checkpoint import unwrap_keys
from jaxcomp._src.checkpoint import wrap_keys
from jaxcomp._src.collectives import pmean_tree
from jaxcomp._src.collectives import vary
from jaxcomp._src.dgc import DGCState
from jaxcomp._src.dgc import dgc
from jaxcomp._src.dgc import dgc_density_schedule
from jaxcomp._src.diloco import DiLoCoState
from jaxcomp._src.diloco import diloco
from jaxcomp._src.fsdp import fsdp_gather
from jaxcomp._src.fsdp import init_fsdp_feedback
from jaxcomp._src.mipd import MIPDState
from jaxcomp._src.mipd import mipd
from jaxcomp._src.onebit_adam import OneBitAdamState
from jaxcomp._src.onebit_adam import onebit_adam
from jaxcomp._src.onebit_adam import scale_by_onebit_adam
from jaxcomp._src.phases import PhaseProfile
from jaxcomp._src.phases import profile_phases
from jaxcomp._src.powersgd import PowerSGDState
from jaxcomp._src.powersgd import powersgd
from jaxcomp._src.qsvrg import QSVRG
from jaxcomp._src.qsvrg import QSVRGState
from jaxcomp._src.qsvrg import QSVRGWireReport
from jaxcomp._src.qsvrg import qsvrg
from jaxcomp._src.qsvrg import qsvrg_wire_report
from jaxcomp._src.qweights import gather_weights
from jaxcomp._src.specs import state_specs
from jaxcomp._src.transforms import CompressState
from jaxcomp._src.transforms import PerDeviceState
from jaxcomp._src.transforms import compress
from jaxcomp._src.transforms import default_filter
from jaxcomp._src.transforms import ef_signsgd
from jaxcomp._src.transforms import onebit_sgd
from jaxcomp._src.transforms import per_device_state
from jaxcomp._src.transforms import qsgd
from jaxcomp._src.transforms import sparsify
from jaxcomp._src.wire import CollectiveOp
from jaxcomp._src.wire import WireReport
from jaxcomp._src.wire import step_wire_report
from jaxcomp._src.wire import wire_report
from jaxcomp._src.wrappers import SkipNonfiniteState
from jaxcomp._src.wrappers import multi_steps
from jaxcomp._src.wrappers import skip_nonfinite

__version__ = "0.1.0"

__all__ = [
  "CollectiveOp",
  "CompressState",
  "DGCState",
  "DiLoCoState",
  "MIPDState",
  "OneBitAdamState",
  "PerDeviceState",
  "PhaseProfile",
  "PowerSGDState",
  "QSVRG",
  "QSVRGState",
  "QSVRGWireReport",
  "SkipNonfiniteState",
  "WireReport",
  "codecs",
  "compress",
  "default_filter",
  "ef_signsgd",
  "elias",
  "kernels",
  "dgc",
  "dgc_density_schedule",
  "diloco",
  "fsdp_gather",
  "gather_weights",
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
  "scale_by_onebit_adam",
  "skip_nonfinite",
  "sparsify",
  "state_specs",
  "step_wire_report",
  "unwrap_keys",
  "vary",
  "wire_report",
  "wrap_keys",
]
