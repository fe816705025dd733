"""Where GLM-5's own parameters are allocated: megatron-core's rule (CPU when use_cpu_initialization, else the
current CUDA device); ``None`` defers to an active ``torch.device(...)`` context (e.g. meta)."""
import torch


def param_device(config):
    return None if config.use_cpu_initialization else torch.cuda.current_device()
