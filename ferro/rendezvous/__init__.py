"""Rendezvous: how ranks learn their place in a job, find each other and prove they belong to it.

* :mod:`~ferro.rendezvous.settings`: the ``FERRO_*`` names and one parser per setting
  (timeouts, the job secret, ports, rank and world size, ``free_port``).
* :mod:`~ferro.rendezvous.env`: the launcher's variables (torchrun, ``ferro run``, mpirun, srun).
* :mod:`~ferro.rendezvous.store` and :mod:`~ferro.rendezvous.file_store`: the key-value stores.
* :mod:`~ferro.rendezvous.auth`: the HMAC handshake every connection passes.
* :mod:`~ferro.rendezvous.connect`: dialling with backoff and the TCP full mesh.
* :mod:`~ferro.rendezvous.hosts`: which ranks share a host or a machine.

This layer knows nothing of process groups or collectives.
"""

from ferro.rendezvous.file_store import FileStore
from ferro.rendezvous.settings import RendezvousConfig, default_timeout, free_port, job_secret
from ferro.rendezvous.store import Store, StoreServer

__all__ = ["FileStore", "RendezvousConfig", "Store", "StoreServer", "default_timeout", "free_port", "job_secret"]
