"""The relay's idle announcement: its state table, walked as the loop walks it."""

from __future__ import annotations

import pytest

from outbox.relay._idle import TABLE, Action, Event, IdleAnnouncement, State


def test_the_table_answers_every_state_and_event() -> None:
    assert set(TABLE) == {(s, e) for s in State for e in Event}


def _walk(events: list[Event]) -> tuple[list[bool], list[Action], State]:
    announced: list[bool] = []
    idle = IdleAnnouncement(announced.append)
    actions = [idle.on(e) for e in events]
    return announced, actions, idle.state


def test_an_idle_relay_takes_the_lock_then_claims_once_more_before_it_waits() -> None:
    announced, actions, state = _walk(
        [Event.CLAIM, Event.IDLE, Event.CLAIM, Event.IDLE, Event.CLAIM, Event.IDLE]
    )
    assert announced == [True]
    assert actions == [Action.NONE, Action.NONE, Action.TAKE, Action.WAIT, Action.NONE, Action.WAIT]
    assert state is State.ANNOUNCED


def test_draining_full_batches_gives_the_lock_back_at_the_next_claim() -> None:
    events = [Event.IDLE, Event.CLAIM, Event.FULL, Event.CLAIM, Event.FULL, Event.CLAIM]
    announced, _, state = _walk(events)
    assert announced == [True, False]
    assert state is State.QUIET


def test_a_full_batch_before_the_lock_is_taken_still_takes_it() -> None:
    announced, _, state = _walk([Event.IDLE, Event.FULL, Event.CLAIM])
    assert announced == [True] and state is State.ANNOUNCED


@pytest.mark.parametrize("state", list(State))
def test_a_lost_session_forgets_the_lock_without_touching_it(state: State) -> None:
    announced: list[bool] = []
    idle = IdleAnnouncement(announced.append)
    idle.state = state
    assert idle.on(Event.LOST) is Action.NONE
    assert idle.state is State.QUIET and announced == []


def test_a_failed_announcement_leaves_the_state_for_the_next_claim() -> None:
    def refuse(idle: bool) -> None:
        raise OSError("session lost")

    idle = IdleAnnouncement(refuse)
    idle.on(Event.IDLE)
    with pytest.raises(OSError):
        idle.on(Event.CLAIM)
    assert idle.state is State.TO_ANNOUNCE
