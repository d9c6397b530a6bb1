from __future__ import annotations

from django.contrib import admin
from django.urls import path

from tests.django.project import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("probe", views.probe),
    path("orders", views.orders),
    path("api/orders", views.api_orders),
]
