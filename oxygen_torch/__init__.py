"""oxygen_torch: a VMM-backed memory pool, a paged KV cache and Triton attention for PyTorch LLM
inference. ``oxygen_torch.enable()`` before the first CUDA allocation; ``generate()`` unchanged.
"""

from .api import active_config, disable, enable, is_enabled
from .config import KernelConfig, KVConfig, OxygenConfig, PoolConfig, SchedulerConfig, load_config
from .triton_kernels.precision import PrecisionMode

__version__ = "0.1.0"

__all__ = [
    "enable",
    "disable",
    "is_enabled",
    "active_config",
    "load_config",
    "OxygenConfig",
    "PoolConfig",
    "KVConfig",
    "KernelConfig",
    "SchedulerConfig",
    "PrecisionMode",
    "__version__",
]
