"""The idle announcement: writers wake relays only while one waits for work.

A relay holds the shared ``idle`` lock while it waits (:func:`outbox._pg.lanes.announce_idle`):
it takes it before the last claim ahead of a wait (a commit that probed before the lock was
taken is visible to that claim, one that probed after it sends a wake-up), keeps it while
batches stay small (each commit then wakes the relay at once), and gives it back while it drains
full batches, when wake-ups would only cost the writers. The lock goes with the session.

The whole behaviour is :data:`TABLE`: (state, event) -> (next state, action).
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class State(enum.Enum):
    QUIET = "quiet"  # not announced
    TO_ANNOUNCE = "to announce"  # nothing left to claim: take the lock, then claim once more
    ANNOUNCED = "announced"  # the lock is held: the relay may wait for a wake-up
    TO_WITHDRAW = "to withdraw"  # announced, but draining full batches: give the lock back


class Event(enum.Enum):
    CLAIM = "claim"  # a batch is about to be claimed
    FULL = "full"  # the batch was full: more rows are likely waiting
    IDLE = "idle"  # the batch left nothing to do: the relay would wait for work
    LOST = "lost"  # the session (and the lock with it) is gone


class Action(enum.Enum):
    NONE = "none"
    TAKE = "take"  # take the idle lock
    GIVE_BACK = "give back"  # give the idle lock back
    WAIT = "wait"  # wait for a wake-up or the poll timer


S, E, A = State, Event, Action
TABLE: dict[tuple[State, Event], tuple[State, Action]] = {
    (S.QUIET, E.CLAIM): (S.QUIET, A.NONE),
    (S.QUIET, E.FULL): (S.QUIET, A.NONE),
    (S.QUIET, E.IDLE): (S.TO_ANNOUNCE, A.NONE),  # one more claim before waiting
    (S.QUIET, E.LOST): (S.QUIET, A.NONE),
    (S.TO_ANNOUNCE, E.CLAIM): (S.ANNOUNCED, A.TAKE),
    (S.TO_ANNOUNCE, E.FULL): (S.TO_ANNOUNCE, A.NONE),
    (S.TO_ANNOUNCE, E.IDLE): (S.TO_ANNOUNCE, A.NONE),
    (S.TO_ANNOUNCE, E.LOST): (S.QUIET, A.NONE),
    (S.ANNOUNCED, E.CLAIM): (S.ANNOUNCED, A.NONE),
    (S.ANNOUNCED, E.FULL): (S.TO_WITHDRAW, A.NONE),
    (S.ANNOUNCED, E.IDLE): (S.ANNOUNCED, A.WAIT),
    (S.ANNOUNCED, E.LOST): (S.QUIET, A.NONE),
    (S.TO_WITHDRAW, E.CLAIM): (S.QUIET, A.GIVE_BACK),
    (S.TO_WITHDRAW, E.FULL): (S.TO_WITHDRAW, A.NONE),
    (S.TO_WITHDRAW, E.IDLE): (S.TO_WITHDRAW, A.WAIT),  # still held
    (S.TO_WITHDRAW, E.LOST): (S.QUIET, A.NONE),
}
del S, E, A


class IdleAnnouncement:
    """One relay's place in :data:`TABLE`; ``announce(True)`` takes the lock, ``(False)`` gives
    it back. A failed ``announce`` leaves the state as it was (the next claim tries again)."""

    def __init__(self, announce: Callable[[bool], None]) -> None:
        self.state = State.QUIET
        self._announce = announce

    def on(self, event: Event) -> Action:
        """Carry out ``event``'s action, then move on; returns the action."""
        state, action = TABLE[self.state, event]
        if action is Action.TAKE:
            self._announce(True)
        elif action is Action.GIVE_BACK:
            self._announce(False)
        self.state = state
        return action
