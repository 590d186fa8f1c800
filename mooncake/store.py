"""``mooncake.store``: the original's Mooncake Store client API on our store."""

from mooncake_plugins.compat.buffer_pool import BufferLease, BufferPool
from mooncake_plugins.compat.store import (BufferHandle, Descriptor, DiskDescriptor,
                                           MemoryDescriptor, MooncakeDistributedStore,
                                           MooncakeHostMemAllocator, ObjectDataType,
                                           ReplicaDescriptor, ReplicateConfig, SoftPinAction)
from mooncake_plugins.compat.store_tasks import QueryTaskResponse, TaskStatus, TaskType
from mooncake_plugins.compat.store_tensors import ParallelAxis, ReadTarget, TensorParallelism
# the original's private tensor-object helpers (used by mooncake.structured_object_store users)
from mooncake_plugins.compat.structured.tensor_codec import from_bytes as _deserialize_tensor
from mooncake_plugins.compat.structured.tensor_codec import metadata_size as _tensor_metadata_size
from mooncake_plugins.compat.structured.tensor_codec import serialize as _serialize_tensor

__all__ = ["BufferHandle", "BufferLease", "BufferPool", "Descriptor", "DiskDescriptor",
           "MemoryDescriptor", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
           "ObjectDataType", "ParallelAxis",
           "QueryTaskResponse", "ReadTarget", "ReplicaDescriptor", "ReplicateConfig",
           "SoftPinAction", "TaskStatus", "TaskType", "TensorParallelism"]
