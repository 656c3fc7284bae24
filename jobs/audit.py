"""The audit trail: who changed what, and when. Every mutation of a job or a run writes one
event here, in the transaction of the change it records.

The actor is a user (`user:<name>`, with the user row) or a component of the system
(`system:<component>`, e.g. `system:scheduler`, `system:worker:<host>:<pid>`).
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser

from .models import AuditEvent


def actor_label(user: AbstractBaseUser) -> str:
    return f"user:{user.get_username()}"


def audit_event(
    *,
    action: str,
    actor: AbstractBaseUser | None = None,
    by: str = "scheduler",
    job_id=None,
    run_id=None,
    data: dict | None = None,
) -> AuditEvent:
    """An unsaved event (for bulk_create); `by` names the component when no user acted."""
    return AuditEvent(
        actor=actor,
        actor_label=(actor_label(actor) if actor else f"system:{by}")[:200],
        action=action,
        job_id=job_id,
        run_id=run_id,
        data=data or {},
    )


def audit_record(**event) -> AuditEvent:
    """Write one event (`audit_event`'s arguments); call inside the transaction of the
    change it records."""
    saved = audit_event(**event)
    saved.save()
    return saved
