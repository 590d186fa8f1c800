"""Test-only, for vLLM's in-tree ``MooncakeConnector`` on CPU torch.

Its worker constructor asks ``torch.accelerator.current_device_index()``, which CPU torch
refuses ("Cannot access accelerator device when none is available"); the next line's
``set_device`` is a no-op on vLLM's CPU platform. With no accelerator, device 0 is the
answer. This is vLLM's CPU gap, not the connector's or ours: nothing else is changed.
"""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
