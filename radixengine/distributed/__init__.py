"""Tensor parallelism over torch.distributed: the process groups of this rank and the
collectives the sharded layers and the scheduler use. With one rank (the default) nothing is
initialised and every collective returns its input."""

from radixengine.distributed.communication_op import (
    all_ranks_agree,
    broadcast_pyobj,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_all_reduce_min,
)
from radixengine.distributed.parallel_state import (
    TpGroup,
    destroy_distributed,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed,
    single_rank_group,
)

__all__ = [
    "TpGroup",
    "all_ranks_agree",
    "broadcast_pyobj",
    "destroy_distributed",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed",
    "single_rank_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_reduce_min",
]
