"""The module-level API and the @idempotent decorator on the real database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import outbox
from outbox.errors import ConfigurationError, KeyInProgress, KeyReuseError
from tests.fixtures.uow import INSERT_ORDER, count, create_orders


@pytest.fixture
def default_outbox(
    engine: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[outbox.Outbox]:
    create_orders(engine)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.delenv("OUTBOX_REDIS_URL", raising=False)
    ob = outbox.configure()
    yield ob
    ob.close()
    outbox.uow._default._default = None


def test_module_level_unit_of_work_uses_the_environment(default_outbox: outbox.Outbox) -> None:
    with outbox.unit_of_work("m-1", scope="payments") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "m-1", "a": 1})
        uow.result = {"ok": 1}
    with outbox.unit_of_work("m-1", scope="payments") as uow:
        assert uow.replayed and uow.result == {"ok": 1}
    assert count(default_outbox.engine, "orders") == 1


def test_scope_defaults_to_default(default_outbox: outbox.Outbox) -> None:
    with outbox.unit_of_work("m-2"):
        pass
    with default_outbox.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT scope FROM idempotency_keys")).scalar() == "default"


def test_configure_without_url_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    outbox.uow._default._default = None
    with pytest.raises(ConfigurationError, match="OUTBOX_DATABASE_URL"):
        outbox.unit_of_work("k")
    with pytest.raises(ConfigurationError, match="OUTBOX_DATABASE_URL"):
        outbox.configure()


def test_idempotent_decorator_by_parameter_name(default_outbox: outbox.Outbox) -> None:
    calls: list[str] = []

    @outbox.idempotent(key="request_id", scope="payments")
    def charge(uow: outbox.UnitOfWork, request_id: str, amount: int) -> dict[str, int]:
        calls.append(request_id)
        uow.connection.execute(INSERT_ORDER, {"k": request_id, "a": amount})
        uow.publish("payments.charged", {"amount": amount}, key=request_id)
        return {"charged": amount}

    assert charge("req-1", 500) == {"charged": 500}
    assert charge(request_id="req-1", amount=500) == {"charged": 500}  # the same call, replayed
    with pytest.raises(KeyReuseError):  # the same key with other arguments
        charge("req-1", 999)
    assert charge(request_id="req-2", amount=7) == {"charged": 7}
    assert calls == ["req-1", "req-2"]
    assert count(default_outbox.engine, "orders") == 2
    assert charge.__name__ == "charge"


def test_idempotent_decorator_fingerprint_false_compares_keys_only(engine: sa.Engine) -> None:
    create_orders(engine)
    with outbox.Outbox(engine) as ob:

        @ob.idempotent(key="request_id", fingerprint=False)
        def charge(uow: outbox.UnitOfWork, request_id: str, amount: int) -> int:
            uow.connection.execute(INSERT_ORDER, {"k": request_id, "a": amount})
            return amount

        assert charge("req-1", 500) == 500
        assert charge("req-1", 999) == 500  # opted out: the first call's result
    assert count(engine, "orders") == 1


def test_idempotent_decorator_refuses_an_argument_without_a_stable_fingerprint(
    engine: sa.Engine,
) -> None:
    create_orders(engine)
    with outbox.Outbox(engine) as ob:

        @ob.idempotent(key="request_id")
        def charge(uow: outbox.UnitOfWork, request_id: str, client: object) -> int:
            uow.connection.execute(INSERT_ORDER, {"k": request_id, "a": 1})
            return 1

        with pytest.raises(ConfigurationError, match=r"'client' is a object.*fingerprint="):
            charge("req-1", object())
    assert count(engine, "orders") == 0
    assert count(engine, "idempotency_keys") == 0


def test_idempotent_decorator_with_key_function_fingerprint_and_explicit_outbox(
    engine: sa.Engine,
) -> None:
    create_orders(engine)
    with outbox.Outbox(engine) as ob:

        @outbox.idempotent(
            key=lambda order: f"order-{order['id']}",
            fingerprint=lambda order: str(sorted(order.items())),
            outbox=ob,
        )
        def accept(uow: outbox.UnitOfWork, order: dict[str, int]) -> list[int]:
            uow.connection.execute(INSERT_ORDER, {"k": str(order["id"]), "a": order["qty"]})
            return [order["id"], order["qty"]]

        assert accept({"id": 1, "qty": 2}) == [1, 2]
        assert accept({"id": 1, "qty": 2}) == [1, 2]
        with pytest.raises(KeyReuseError):
            accept({"id": 1, "qty": 3})
        # Method form on an Outbox instance.
        assert ob.idempotent("order_id")(lambda uow, order_id: order_id.upper())("ab") == "AB"
    assert count(engine, "orders") == 1


def test_idempotent_decorator_checks_its_arguments_early() -> None:
    with pytest.raises(ConfigurationError, match="no parameter 'missing'"):

        @outbox.idempotent(key="missing")
        def f(uow: outbox.UnitOfWork, present: str) -> None: ...

    with pytest.raises(ConfigurationError, match="first parameter"):

        @outbox.idempotent(key=lambda: "k")
        def g() -> None: ...


def test_key_in_progress_propagates_from_the_decorator(engine: sa.Engine) -> None:
    import threading

    with outbox.Outbox(engine) as ob:
        inside = threading.Event()
        release = threading.Event()

        @outbox.idempotent(key="k", outbox=ob)
        def slow(uow: outbox.UnitOfWork, k: str) -> str:
            inside.set()
            release.wait(30)
            return "done"

        t = threading.Thread(target=slow, args=("same",))
        t.start()
        assert inside.wait(30)
        try:
            with pytest.raises(KeyInProgress):
                slow("same")
        finally:
            release.set()
            t.join()
        assert slow("same") == "done"
