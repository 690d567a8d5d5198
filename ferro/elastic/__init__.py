"""Fault-tolerant data-parallel training: survive a lost rank in place, and grow back when it returns.

* :class:`Manager` (``manager.py``): the training loop's side; shrinks and grows the group.
* :mod:`~ferro.elastic.membership`: the membership protocol over the launcher's store.
* :mod:`~ferro.elastic.transfer`: the state a replacement receives, peer to peer.
* :class:`ElasticSampler` (``sampler.py``): each step's samples, split among whoever trains it.
* :mod:`~ferro.elastic.keys`: the store keys, shared with ``ferro run``'s agent.

Start the job with ``ferro run --restart-policy rank`` (see the fault tolerance guide, docs/guides/fault-tolerance.md).
"""

from ferro.elastic.manager import Change, Manager, Step, membership_failure
from ferro.elastic.sampler import ElasticSampler, Shard

__all__ = ["Change", "ElasticSampler", "Manager", "Shard", "Step", "membership_failure"]
