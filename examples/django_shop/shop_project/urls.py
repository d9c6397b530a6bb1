from __future__ import annotations

from django.urls import path
from shop import views

urlpatterns = [path("orders", views.create_order)]
