"""The public face: exports, documentation and the error tree."""

import inspect
import pickle

import pytest

import ferro
import ferro.errors

BUILTIN_OF = {
    ferro.DistributedTimeoutError: TimeoutError,
    ferro.PeerLostError: ConnectionError,
    ferro.ConnectionBrokenError: ConnectionError,
    ferro.TransportError: ConnectionError,
    ferro.ProtocolError: ConnectionError,
    ferro.AuthenticationError: ConnectionError,
    ferro.CollectiveMismatchError: RuntimeError,
    ferro.SizeMismatchError: ValueError,
    ferro.InvalidRankError: ValueError,
    ferro.InvalidWorldSizeError: ValueError,
    ferro.SelfSendError: ValueError,
    ferro.InvalidBufferError: ValueError,
    ferro.BackendUnavailableError: RuntimeError,
    ferro.BackendClosedError: RuntimeError,
    ferro.ConfigurationError: ValueError,
    ferro.StoreError: ValueError,
    ferro.StoreKeyTimeoutError: TimeoutError,
    ferro.RankFailedError: RuntimeError,
    ferro.CheckpointError: ValueError,
    ferro.CheckpointCorruptError: ValueError,
    ferro.NcclError: RuntimeError,
    ferro.CudaError: RuntimeError,
    ferro.MpiError: RuntimeError,
    ferro.RemoteError: RuntimeError,
    ferro.QuorumLostError: RuntimeError,
    ferro.MembershipError: RuntimeError,
}


# Public as namespaces, as the issues name them.
EXPORTED_MODULES = {"p2p", "nn", "pipeline", "checkpoint", "dtensor", "elastic", "rpc"}


def test_all_lists_exactly_the_public_names():
    public = {name for name in dir(ferro) if not name.startswith("_")}
    modules = {name for name in public if inspect.ismodule(getattr(ferro, name))} - EXPORTED_MODULES
    assert set(ferro.__all__) - {"__version__"} == public - modules


def test_every_public_name_is_documented():
    for name in ferro.__all__:
        obj = getattr(ferro, name)
        if name != "__version__":
            assert inspect.getdoc(obj), f"ferro.{name} has no docstring"


def test_every_error_is_a_distributed_error_and_its_builtin():
    assert set(BUILTIN_OF) == {getattr(ferro.errors, n) for n in ferro.errors.__all__} - {ferro.DistributedError}
    for error, builtin in BUILTIN_OF.items():
        assert issubclass(error, ferro.DistributedError) and issubclass(error, builtin), error


@pytest.mark.parametrize("error", [ferro.PeerLostError("lost", peer=3), ferro.SizeMismatchError("m", 4, 8),
                                   ferro.RankFailedError("r", 2, "tb"), ferro.NcclError("n", 6),
                                   ferro.CudaError("c", 100), ferro.MpiError("m", 5),
                                   ferro.QuorumLostError("q", ("0.0", "3.0"), 3)])
def test_errors_keep_their_fields_across_pickling(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__


def test_split_is_refused_clearly_by_a_backend_without_it():
    class Minimal(ferro.Backend):
        rank, world_size, timeout, closed = 0, 2, 1.0, False

        def send(self, buf, dst, *, timeout=None): ...
        def recv(self, buf, src, *, timeout=None): ...
        def barrier(self, *, timeout=None): ...
        def close(self): ...

    with pytest.raises(ferro.BackendUnavailableError, match="Minimal cannot create sub-groups"):
        ferro.new_group([0, 1], group=Minimal())


@pytest.mark.parametrize("ranks, match", [([], "empty"), ([0, 0], "duplicate"), ([0, 5], "outside"),
                                          ([0, "1"], "integers")])
def test_new_group_validates_ranks(ranks, match):
    groups = ferro.SimulatedBackend.create_group(2)
    with pytest.raises(ferro.InvalidRankError, match=match):
        ferro.new_group(ranks, group=groups[0])


def test_new_group_needs_a_parent_until_a_default_group_exists():
    with pytest.raises(ferro.ConfigurationError, match="group="):
        ferro.new_group([0])


def test_reexported_names_read_as_ferro_x():
    # As httpx does: reprs and tracebacks name the public path, not the module a class lives in.
    assert repr(ferro.TcpBackend) == "<class 'ferro.TcpBackend'>"
    assert ferro.PeerLostError.__module__ == "ferro" and ferro.allreduce.__module__ == "ferro"
    assert pickle.loads(pickle.dumps(ferro.FSDP)) is ferro.FSDP
    assert pickle.loads(pickle.dumps(ferro.allreduce)) is ferro.allreduce


def test_module_paths_users_import_are_the_modules_themselves():
    import sys

    import ferro.p2p
    import ferro.process_group
    from ferro.process_group import init_process_group

    import ferro.collective.process_group
    import ferro.device_mesh
    import ferro.parallel.pipeline
    import ferro.pipeline
    from ferro.pipeline import Schedule1F1B

    # One module object each: a copy of process_group would hold a default group of its own.
    assert sys.modules["ferro.process_group"] is ferro.collective.process_group
    assert ferro.p2p is sys.modules["ferro.collective.p2p"]
    assert ferro.pipeline is ferro.parallel.pipeline and Schedule1F1B is ferro.parallel.pipeline.Schedule1F1B
    assert ferro.device_mesh.DeviceMesh is ferro.DeviceMesh
    assert init_process_group is ferro.init_process_group
