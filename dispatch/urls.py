from django.urls import path

from . import dashboard

urlpatterns = [
    path("", dashboard.dashboard_page, name="dashboard"),
    path("panel/", dashboard.dashboard_panel, name="dashboard-panel"),
]
