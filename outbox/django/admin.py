"""Admin pages for parked outbox rows, handled dead letters and idempotency keys.

Invariant: every page is read-only (the models' only default permission is ``view``); parked rows
are retried or discarded only by a user with ``outbox.retry_parked`` or
``outbox.discard_parked``, through :func:`outbox.admin.retry_parked` and
:func:`outbox.admin.discard_parked` in a transaction of their own. Dead letters live in Kafka:
these pages show the ones recorded as handled (``manage.py outbox_dlq`` lists the others).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import path

from outbox import admin as ops
from outbox.django._settings import alias_of, outbox_for, outbox_settings
from outbox.django.models import HandledDeadLetter, IdempotencyKey, ParkedEvent


class _ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class _ListOnly(_ReadOnly):
    """A list without a page per row: the model's ``pk`` is one column of a composite key."""

    list_display_links = None

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name=f"{self.opts.app_label}_{self.opts.model_name}_changelist")]


def _parked(
    modeladmin: ParkedEventAdmin, request: HttpRequest, queryset: QuerySet[Any], retry: bool
) -> None:
    chosen = list(queryset.values_list("event_id", flat=True))
    act = ops.retry_parked if retry else ops.discard_parked
    with outbox_for(alias_of(None)).engine.begin() as conn:
        done = act(conn, outbox_settings().get("SCHEMA"), event_ids=chosen)
    verb = "retried" if retry else "discarded"
    modeladmin.message_user(request, f"{done} parked row(s) {verb}", messages.SUCCESS)


@admin.action(description="Retry the selected parked rows", permissions=["retry_parked"])
def retry(modeladmin: ParkedEventAdmin, request: HttpRequest, queryset: QuerySet[Any]) -> None:
    _parked(modeladmin, request, queryset, retry=True)


@admin.action(description="Discard the selected parked rows", permissions=["discard_parked"])
def discard(modeladmin: ParkedEventAdmin, request: HttpRequest, queryset: QuerySet[Any]) -> None:
    _parked(modeladmin, request, queryset, retry=False)


@admin.register(ParkedEvent)
class ParkedEventAdmin(_ReadOnly):
    list_display = ("id", "event_id", "topic", "key_text", "attempts", "last_error", "parked_at")
    list_filter = ("topic",)
    search_fields = ("event_id",)
    ordering = ("id",)
    actions = [retry, discard]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).filter(parked_at__isnull=False)

    @admin.display(description="key")
    def key_text(self, row: ParkedEvent) -> str:
        """The key as ``outbox parked list`` prints it."""
        if row.key is None:
            return "-"
        try:
            return bytes(row.key).decode("utf-8")
        except UnicodeDecodeError:
            return repr(bytes(row.key))

    def has_retry_parked_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("outbox.retry_parked"))

    def has_discard_parked_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("outbox.discard_parked"))


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(_ListOnly):
    list_display = ("scope", "key", "status", "attempts", "error", "updated_at")
    list_filter = ("status", "scope")
    search_fields = ("key",)
    ordering = ("-updated_at",)
    actions = None


@admin.register(HandledDeadLetter)
class HandledDeadLetterAdmin(_ListOnly):
    list_display = ("dlq_topic", "partition", "offset", "how", "handled_by", "handled_at")
    list_filter = ("dlq_topic", "how")
    ordering = ("-handled_at",)
    actions = None
