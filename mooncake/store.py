"""``mooncake.store``: the original's Mooncake Store client API on our store."""

from mooncake.buffer_pool import BufferLease, BufferPool
from mooncake_plugins.compat.store import (BufferHandle, Descriptor, DiskDescriptor,
                                           MemoryDescriptor, MooncakeDistributedStore,
                                           ObjectDataType, ReplicaDescriptor, ReplicateConfig,
                                           SoftPinAction)
from mooncake_plugins.compat.store_tasks import QueryTaskResponse, TaskStatus, TaskType
from mooncake_plugins.compat.store_tensors import ParallelAxis, ReadTarget, TensorParallelism

__all__ = ["BufferHandle", "BufferLease", "BufferPool", "Descriptor", "DiskDescriptor",
           "MemoryDescriptor", "MooncakeDistributedStore", "ObjectDataType", "ParallelAxis",
           "QueryTaskResponse", "ReadTarget", "ReplicaDescriptor", "ReplicateConfig",
           "SoftPinAction", "TaskStatus", "TaskType", "TensorParallelism"]
