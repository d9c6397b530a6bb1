from __future__ import annotations

from django.urls import path

from tests.django.project import views

urlpatterns = [
    path("probe", views.probe),
    path("orders", views.orders),
]
