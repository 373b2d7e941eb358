"""Hypothesis settings for the scheduler core's property tests.

Registered as a named profile, not loaded globally: the property tests apply
it with `@settings(parent=settings.get_profile(PROFILE))`, so other test
folders keep their own settings. Example counts keep this folder under ~60 s
on 2 cores.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

PROFILE = "scheduler_svc"

settings.register_profile(
    PROFILE,
    max_examples=300,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
