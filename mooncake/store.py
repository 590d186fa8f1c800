"""``mooncake.store``: the original's Mooncake Store client API on our store."""

from mooncake_plugins.compat.store import (BufferHandle, MooncakeDistributedStore,
                                           ReplicaDescriptor, ReplicateConfig)
from mooncake_plugins.compat.store_tensors import ParallelAxis, ReadTarget, TensorParallelism
from mooncake.buffer_pool import BufferLease, BufferPool

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicaDescriptor", "ReplicateConfig",
           "ParallelAxis", "TensorParallelism", "ReadTarget"]
__all__ += ["BufferLease", "BufferPool"]
from mooncake_plugins.compat.store import (Descriptor, DiskDescriptor, MemoryDescriptor,
                                           ObjectDataType, SoftPinAction)
from mooncake_plugins.compat.store_tasks import QueryTaskResponse, TaskStatus, TaskType

__all__ += ["Descriptor", "DiskDescriptor", "MemoryDescriptor", "ObjectDataType", "SoftPinAction",
            "QueryTaskResponse", "TaskStatus", "TaskType"]
