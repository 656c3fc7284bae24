"""The worker's consumer (CELERY_WORKER_CONSUMER) has no native delayed delivery step:
with quorum queues Celery would otherwise declare its delayed-delivery exchanges at every
(re)connection, and retry them against a lost node for about 18 s before consuming."""

from celery.utils.imports import symbol_by_name
from kombu import Queue

from scheduler_project.celery import DELAYED_DELIVERY_STEP, app


def test_the_workers_consumer_has_no_delayed_delivery_step_even_with_quorum_queues(
    monkeypatch,
):
    quorum = [Queue("jobs", queue_arguments={"x-queue-type": "quorum"})]
    monkeypatch.setattr(app.amqp, "queues", app.amqp.Queues(quorum))
    consumer = symbol_by_name(app.conf.worker_consumer)
    blueprint = consumer.Blueprint(steps=app.steps["consumer"])
    steps = blueprint._finalize_steps(blueprint.claim_steps())
    names = [step.name for step in steps]
    assert "celery.worker.consumer.tasks.Tasks" in names
    assert not [name for name in names if "delayed_delivery" in name]
    # Celery's own consumer would have it: the test can fail.
    assert DELAYED_DELIVERY_STEP in consumer.__mro__[1].Blueprint.default_steps
