"""ferro under other libraries' APIs.

* :mod:`ferro.interop.torch`: ferro as a ``torch.distributed`` backend
  (``init_process_group("ferro")``), so torch's own DDP and FSDP run on ferro's
  transports. Importing this package imports nothing optional; the torch module
  needs torch.
* :mod:`ferro.interop.torch_elastic`: torch's own ``DistributedDataParallel``
  under :class:`ferro.elastic.Manager` (``elastic_ddp``), through lost and returning ranks.
* :mod:`ferro.interop.torch_comm_hooks`: ferro's compressing DDP hooks (int8,
  PowerSGD, 16-bit) for torch's own DDP over "ferro" (``comm_hook``, also in
  :mod:`ferro.interop.torch`).
"""
