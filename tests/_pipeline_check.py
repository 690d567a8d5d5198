"""An independent checker of pipeline action lists: every dependency met, every transfer matched, no deadlock."""

from collections import defaultdict

from ferro.pipeline import ActionKind

F, B, I, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B


def check_actions(lists, num_stages, n_microbatches):
    """Play every rank's list; raise AssertionError on any broken rule. Returns the peak activations per stage.

    Model: compute runs in list order; a send completes at once (buffered);
    a receive waits for its matching send; each channel (kind, src, dst) is FIFO.
    """
    world = len(lists)
    rank_of = {s: s % world for s in range(num_stages)}
    # Each stage's compute happens exactly once per microbatch, on its rank.
    for rank, actions in enumerate(lists):
        for a in actions:
            assert rank_of[a.stage] == rank, f"rank {rank} runs {a} of a stage it does not own"
    for s in range(num_stages):
        acts = [a for a in lists[rank_of[s]] if a.stage == s]
        for mb in range(n_microbatches):
            kinds = sorted(a.kind.value for a in acts if a.microbatch == mb and a.kind.is_compute)
            assert kinds in (["B", "F"], ["F", "I", "W"]), f"stage {s} microbatch {mb}: {kinds}"
    sent = defaultdict(list)  # channel -> messages in send order
    received = defaultdict(int)
    done = [set() for _ in range(world)]  # (kind, stage, mb) done per rank
    have_input = set()  # (stage, mb) whose input is here
    have_grad = set()  # (stage, mb) whose output gradient is here
    position = [0] * world
    held = defaultdict(int)
    peak = defaultdict(int)
    while any(position[r] < len(lists[r]) for r in range(world)):
        moved = False
        for r in range(world):
            while position[r] < len(lists[r]):
                a = lists[r][position[r]]
                key = (a.stage, a.microbatch)
                if a.kind in (SEND_F, SEND_B):
                    if a.kind is SEND_F:
                        assert (F, a.stage, a.microbatch) in done[r], f"rank {r}: {a} before its forward"
                        assert a.peer == rank_of[a.stage + 1]
                    else:
                        assert any((k, a.stage, a.microbatch) in done[r] for k in (B, I)), f"rank {r}: {a} early"
                        assert a.peer == rank_of[a.stage - 1]
                    sent[(a.kind, r, a.peer)].append(key)
                elif a.kind in (RECV_F, RECV_B):
                    kind = SEND_F if a.kind is RECV_F else SEND_B
                    channel = (kind, a.peer, r)
                    index = received[channel]
                    if index >= len(sent[channel]):
                        break  # blocked: the sender has not got there yet
                    src_stage, mb = sent[channel][index]
                    expected_src = a.stage - 1 if a.kind is RECV_F else a.stage + 1
                    assert (src_stage, mb) == (expected_src, a.microbatch), (
                        f"rank {r}: {a} would receive stage {src_stage} microbatch {mb} (channel out of order)")
                    received[channel] += 1
                    (have_input if a.kind is RECV_F else have_grad).add(key)
                elif a.kind is F:
                    ready = a.stage == 0 or key in have_input or (
                        rank_of[a.stage - 1] == r and (F, a.stage - 1, a.microbatch) in done[r])
                    if not ready:
                        raise AssertionError(f"rank {r}: {a} without its input")
                    held[a.stage] += 1
                    peak[a.stage] = max(peak[a.stage], held[a.stage])
                elif a.kind in (B, I):
                    assert (F, a.stage, a.microbatch) in done[r], f"rank {r}: {a} before its forward"
                    ready = a.stage == num_stages - 1 or key in have_grad or (
                        rank_of[a.stage + 1] == r and any((k, a.stage + 1, a.microbatch) in done[r] for k in (B, I)))
                    if not ready:
                        raise AssertionError(f"rank {r}: {a} without its output gradient")
                    if a.kind is B:
                        held[a.stage] -= 1
                elif a.kind is W:
                    assert (I, a.stage, a.microbatch) in done[r], f"rank {r}: {a} before its input gradient"
                    held[a.stage] -= 1
                done[r].add((a.kind, a.stage, a.microbatch))
                position[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(lists[r][position[r]]) for r in range(world) if position[r] < len(lists[r])}
            raise AssertionError(f"deadlock: ranks wait at {stuck}")
    for channel, messages in sent.items():
        assert received[channel] == len(messages), f"{channel}: {len(messages) - received[channel]} never received"
    return dict(peak)
