"""Tensor parallelism on torch.distributed: the process group (parallel_state) and the collectives the model
calls (communication), as opaque custom ops so torch.compile keeps them and CUDA graphs capture them (NCCL)."""
from engine.distributed.communication import (broadcast_object, tensor_model_parallel_all_gather,
                                              tensor_model_parallel_all_reduce, tensor_model_parallel_gather)
from engine.distributed.parallel_state import (destroy_distributed_environment, get_tp_group, get_tp_rank,
                                               get_tp_world_size, init_distributed_environment,
                                               is_distributed_initialized)

__all__ = ["broadcast_object", "destroy_distributed_environment", "get_tp_group", "get_tp_rank",
           "get_tp_world_size", "init_distributed_environment", "is_distributed_initialized",
           "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce", "tensor_model_parallel_gather"]
