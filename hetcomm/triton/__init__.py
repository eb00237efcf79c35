"""Triton kernels for pack, unpack_ and unscale_: a second GPU back end, registered as
torch.ops.hetcomm_triton.* with the schemas of torch.ops.hetcomm.*.

Importing this package imports triton and registers the ops; hetcomm.ops imports it
only when the triton back end is asked for, so hetcomm works without triton.
"""

from hetcomm.triton import pack, unpack, unscale  # noqa: F401  (registers the ops)

OPS = ("pack", "pack.out", "unpack_", "unscale_")
