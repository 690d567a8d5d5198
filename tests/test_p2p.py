"""Typed point-to-point: dtype and shape travel with the data; tags keep streams apart."""

import numpy as np

import ferro


def rank_typed_messages(group):
    if group.rank == 0:
        ferro.send(np.arange(12, dtype=np.int16).reshape(3, 4), 1, group=group)
        ferro.p2p.send(np.float64(2.5) * np.ones(()), 1, group=group)
        ferro.send(np.empty((0, 5), np.float32), 1, group=group)
        return None
    a = ferro.recv(0, group=group)
    b = ferro.p2p.recv(0, group=group)
    c = ferro.recv(0, group=group)
    return (a.dtype.name, a.shape, a.tolist(), b.dtype.name, b.shape, float(b), c.dtype.name, c.shape)


def test_receiver_needs_no_prior_knowledge(run):
    a_dtype, a_shape, a_values, b_dtype, b_shape, b_value, c_dtype, c_shape = run(rank_typed_messages, 2)[1]
    assert (a_dtype, a_shape) == ("int16", (3, 4)) and a_values == np.arange(12).reshape(3, 4).tolist()
    assert (b_dtype, b_shape, b_value) == ("float64", (), 2.5)
    assert (c_dtype, c_shape) == ("float32", (0, 5))


def rank_tags_out_of_order(group):
    if group.rank == 0:
        for tag in (5, 3, 5, 9):
            ferro.send(np.array([tag * 10 + len(str(tag))]), 1, tag=tag, group=group)
        return None
    return [int(ferro.recv(0, tag=t, group=group)[0]) for t in (9, 3, 5, 5)]


def test_tags_keep_independent_streams_apart(run):
    assert run(rank_tags_out_of_order, 2)[1] == [91, 31, 51, 51]


def rank_recv_into_mismatch(group):
    if group.rank == 0:
        ferro.send(np.arange(4, dtype=np.float32), 1, group=group)
        return None
    out = np.zeros(3, np.float32)
    try:
        ferro.recv_into(out, 0, group=group)
        outcome = "accepted"
    except ferro.SizeMismatchError as exc:
        outcome = "kept" if "kept" in str(exc) else str(exc)
    return outcome, out.tolist(), ferro.recv(0, group=group).tolist()


def test_recv_into_with_the_wrong_size_keeps_the_message(run):
    assert run(rank_recv_into_mismatch, 2)[1] == ("kept", [0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0])


def rank_max_bytes(group):
    if group.rank == 0:
        ferro.send(np.zeros(1000, np.float64), 1, group=group)
        return None
    try:
        ferro.recv(0, group=group, max_bytes=100)
        outcome = "accepted"
    except ferro.SizeMismatchError:
        outcome = "refused"
    return outcome, ferro.recv(0, group=group).size


def test_max_bytes_refuses_without_losing_the_message(run):
    assert run(rank_max_bytes, 2)[1] == ("refused", 1000)


def rank_sendrecv(group):
    peer = 1 - group.rank
    mine = np.full(3 + group.rank, group.rank, np.int32)
    theirs = ferro.sendrecv(mine, peer, group=group)
    into = np.empty(4 - group.rank, np.int32)
    ferro.send(mine, peer, group=group)  # small: both ranks may send first
    return theirs.tolist(), ferro.recv_into(into, peer, group=group) is into, into.tolist()


def test_sendrecv_and_recv_into(run):
    results = run(rank_sendrecv, 2)
    assert results[0] == ([1, 1, 1, 1], True, [1, 1, 1, 1])
    assert results[1] == ([0, 0, 0], True, [0, 0, 0])


def rank_bad_tag(group):
    try:
        ferro.send(np.zeros(1), 1 - group.rank, tag=-1, group=group)
        return "accepted"
    except ValueError:
        return "refused"


def test_invalid_tag(run):
    assert run(rank_bad_tag, 2) == ["refused", "refused"]


def rank_async_exchange(group):
    # Both ranks post a send and a receive and return to compute before either has completed.
    peer = 1 - group.rank
    mine = np.full((257, 3), float(group.rank)) + np.arange(3)
    outgoing = ferro.isend(mine, peer, tag=4, group=group)
    incoming = ferro.irecv(peer, tag=4, group=group)
    assert float(np.sum(mine)) > 0  # stands for the compute they overlap
    got = incoming.wait(timeout=30)
    assert outgoing.wait(timeout=30) is None
    return got.shape, got[:, 0].tolist() == [float(peer)] * 257, got[0].tolist()


def test_isend_irecv_post_then_wait(run):
    for rank, (shape, filled, first_row) in enumerate(run(rank_async_exchange, 2)):
        assert shape == (257, 3) and filled
        assert first_row == [1 - rank + 0.0, 2 - rank + 0.0, 3 - rank + 0.0]


def rank_irecv_bad_rank(group):
    try:
        ferro.irecv(5, group=group)
    except ferro.InvalidRankError as exc:
        return str(exc)
    return None


def test_irecv_rejects_a_bad_rank_at_once(run):
    assert "5" in run(rank_irecv_bad_rank, 2)[0]


def rank_any_source(group):
    if group.rank != 0:
        if group.rank == 2:
            ferro.send(np.array([70.0]), 0, tag=7, group=group)  # another tag first: set aside, not returned
        ferro.send(np.full(3, float(group.rank)), 0, group=group)
        ferro.send(np.full(2, float(group.rank) * 10), 0, group=group)
        ferro.barrier(group=group)  # alive while rank 0 times out: a gone peer would be named instead
        return None
    got = [ferro.recv_any(group=group) for _ in range(2)]
    handle = ferro.p2p.irecv_any(group=group)
    got.append(handle.wait())
    got.append(ferro.recv_any(group=group))
    tagged = ferro.recv_any(tag=7, group=group)
    try:
        ferro.recv_any(group=group, timeout=0.3)
        late = None
    except ferro.DistributedTimeoutError as exc:
        late = str(exc)
    ferro.barrier(group=group)
    return [(src, x.tolist()) for src, x in got], (tagged[0], tagged[1].tolist()), late


def test_recv_any_takes_each_sender_s_messages_in_order_and_sets_other_tags_aside(run):
    got, tagged, late = run(rank_any_source, 3)[0]
    for sender in (1, 2):
        mine = [values for src, values in got if src == sender]
        assert mine == [[float(sender)] * 3, [sender * 10.0] * 2]  # per sender: in the order sent
    assert tagged == (2, [70.0])
    assert late is not None and "any source" in late and "tag 0" in late


def rank_any_source_in_a_sub_group(group):
    sub = ferro.new_group([0, 2], group=group)
    if group.rank == 2:
        ferro.send(np.array([2.0]), 0, group=sub)  # rank 1 of the sub-group
    elif group.rank == 0:
        src, x = ferro.recv_any(group=sub)
        return src, x.tolist()
    return None


def test_recv_any_on_the_hierarchical_backend():
    from ferro.testing import run_processes

    got, tagged, _ = run_processes(rank_any_source, 3, backend="hierarchical")[0]
    assert sorted(got) == [(1, [1.0] * 3), (1, [10.0] * 2), (2, [2.0] * 3), (2, [20.0] * 2)]
    assert tagged == (2, [70.0])


def test_recv_any_in_a_sub_group_names_the_sender_by_its_rank_there(run):
    assert run(rank_any_source_in_a_sub_group, 3)[0] == (1, [2.0])


def rank_any_source_peer_lost(group):
    if group.rank == 1:
        import os
        os._exit(3)
    try:
        ferro.recv_any(group=group, timeout=30)
    except ferro.PeerLostError as exc:
        return exc.peer, str(exc)
    return None


def test_recv_any_names_a_peer_that_is_gone(run):
    if run.__name__ == "harness_simulated":
        return  # a thread cannot exit alone; the process harnesses cover this
    peer, message = run(rank_any_source_peer_lost, 2, allow_exit=[1])[0]
    assert peer == 1 and "rank 1" in message
