"""The Django door: a unit of work on Django's connection, inside the transaction Django commits,
against the real PostgreSQL and Redis."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from tests.django.conftest import count

pytest.importorskip("django")

from django.db import connections, transaction

from outbox import migrate
from outbox.django import idempotent, unit_of_work
from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    PermanentError,
    PreviouslyFailed,
)
from tests.django.shop.models import Order


def _place(key: str, amount: int = 1) -> Any:
    with unit_of_work(key, scope="orders") as uow:
        if uow.replayed:
            return uow.result
        Order.objects.create(order_key=key, amount=amount)
        uow.publish("orders.created", {"key": key}, key=key)
        uow.result = {"order": key}
        return uow.result


def test_a_key_runs_once_and_the_duplicate_replays_from_redis(
    django_database: str, engine: sa.Engine
) -> None:
    assert _place("k1") == {"order": "k1"}
    with unit_of_work("k1", scope="orders") as uow:
        assert uow.replayed and uow.replayed_from == "redis" and uow.result == {"order": "k1"}
    assert count(engine, "shop_order") == 1 and count(engine, "outbox") == 1
    assert count(engine, "idempotency_keys") == 1


def test_inside_atomic_everything_commits_with_django_and_a_rollback_leaves_nothing(
    django_database: str, engine: sa.Engine
) -> None:
    class Abandon(Exception):
        pass

    with pytest.raises(Abandon), transaction.atomic():
        _place("k-rolled")
        Order.objects.create(order_key="caller's own", amount=2)
        raise Abandon
    assert count(engine, "shop_order") == 0 and count(engine, "outbox") == 0
    assert count(engine, "idempotency_keys") == 0
    # Nothing reached Redis either: the key runs again, answered by PostgreSQL.
    assert _place("k-rolled") == {"order": "k-rolled"}
    with transaction.atomic():
        _place("k-kept")
        assert count(engine, "idempotency_keys") == 1  # not before Django's commit
    assert count(engine, "shop_order") == 2 and count(engine, "idempotency_keys") == 2


def test_the_same_key_twice_in_one_transaction_is_in_progress(
    django_database: str, engine: sa.Engine
) -> None:
    with pytest.raises(KeyInProgress), transaction.atomic():
        with unit_of_work("twice", scope="orders") as uow:
            uow.result = 1
        with unit_of_work("twice", scope="orders"):
            pytest.fail("the body ran a second time")
    assert count(engine, "idempotency_keys") == 0


def test_a_body_error_rolls_back_to_the_savepoint_and_keeps_the_callers_rows(
    django_database: str, engine: sa.Engine
) -> None:
    with transaction.atomic():
        Order.objects.create(order_key="caller", amount=1)
        with pytest.raises(RuntimeError), unit_of_work("boom", scope="orders"):
            Order.objects.create(order_key="body", amount=1)
            raise RuntimeError("transient")
    assert list(Order.objects.values_list("order_key", flat=True)) == ["caller"]
    assert count(engine, "idempotency_keys") == 0
    assert _place("boom") == {"order": "boom"}  # the key stayed free


def test_a_permanent_error_is_recorded_and_replayed(
    django_database: str, engine: sa.Engine
) -> None:
    with pytest.raises(PermanentError), unit_of_work("bad", scope="orders"):
        Order.objects.create(order_key="bad", amount=1)
        raise PermanentError("refused")
    assert count(engine, "shop_order") == 0
    with pytest.raises(PreviouslyFailed):
        _place("bad")


def test_a_fingerprint_mismatch_is_key_reuse(django_database: str) -> None:
    with unit_of_work("fp", fingerprint="a") as uow:
        uow.result = 1
    with pytest.raises(KeyReuseError), unit_of_work("fp", fingerprint="b"):
        pytest.fail("the body ran")


def test_eight_threads_on_one_key_give_one_effect(django_database: str, engine: sa.Engine) -> None:
    barrier = threading.Barrier(8)
    answers: list[Any] = []

    def one() -> None:
        barrier.wait()
        try:
            answers.append(_place("race"))
        except KeyInProgress as exc:
            answers.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(answers) == 8
    assert all(a == {"order": "race"} or isinstance(a, KeyInProgress) for a in answers)
    assert count(engine, "shop_order") == 1 and count(engine, "outbox") == 1


def test_the_decorator_runs_the_function_once_per_key(
    django_database: str, engine: sa.Engine
) -> None:
    calls: list[str] = []

    @idempotent(lambda order_id: f"order-{order_id}", scope="orders")
    def place(order_id: int, uow: Any) -> dict[str, int]:
        calls.append(str(order_id))
        Order.objects.create(order_key=str(order_id), amount=order_id)
        return {"id": order_id}

    assert place(7) == place(7) == {"id": 7}
    assert calls == ["7"] and count(engine, "shop_order") == 1


def test_bad_input_is_refused_before_any_statement(django_database: str, engine: sa.Engine) -> None:
    from outbox.errors import ValidationError

    with pytest.raises(ValidationError), unit_of_work(""):
        pass  # pragma: no cover
    refused = pytest.raises(ConfigurationError, match=r"not in settings\.DATABASES")
    with refused, unit_of_work("k", using="elsewhere"):
        pass  # pragma: no cover
    assert count(engine, "idempotency_keys") == 0


def test_django_migrate_and_alembic_recognise_each_other(
    django_database: str, engine: sa.Engine
) -> None:
    from django.core.management import call_command

    migrate.downgrade(engine, "base")  # a database neither has migrated
    call_command("migrate", "outbox", verbosity=0)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
    assert _place("after-django-migrate") == {"order": "after-django-migrate"}
    # Migrated by alembic first: Django records its migration, alembic has nothing to do.
    call_command("migrate", "outbox", "zero", verbosity=0)  # the reverse is a no-op
    call_command("migrate", "outbox", verbosity=0)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
    assert count(engine, "idempotency_keys") == 1
