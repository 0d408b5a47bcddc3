"""lgreco for PyTorch training scripts.

    from lgreco.torch import register_ddp
    ddp = torch.nn.parallel.DistributedDataParallel(model, ...)
    register_ddp(ddp, "model.json")   # rank 0 writes the file once DDP's buckets are final

register_ddp and the rest of lgreco.register (docs/REGISTER_TOOL.md) import torch only
when called, so importing this module does not need it.
"""

from .register import Registration, RegisterError, bucket_layout, register_ddp, registration, write_registration

__all__ = ["register_ddp", "Registration", "RegisterError", "bucket_layout", "registration", "write_registration"]
