"""Which partition a job belongs to, and the filter that keeps a scheduler replica to the
partitions whose lease it holds (the leases are kept by dispatch.partitions).

A job's partition is the last 32 bits of its id (random in every UUID the project makes)
modulo the partition count, computed in the query: nothing is stored, so changing
SCHEDULER_PARTITIONS needs no migration, only that every replica restarts with the new
count (docs/architecture.md, "Partitions"). Runs belong to their job's partition.
"""

from __future__ import annotations

import dataclasses
import uuid

from django.db.models import BooleanField, Expression, F, Func, IntegerField, Subquery
from django.db.models.functions import Now
from django.db.models.lookups import In

from storage.partitions import in_held_partitions_sql, job_partition_sql

from .models import PartitionLease


@dataclasses.dataclass(frozen=True)
class PartitionScope:
    """The partitions a scheduler replica dispatches: those whose lease `holder` holds on
    the database's clock at the moment of the query that uses `in_held_partitions`."""

    holder: str
    partitions: int  # SCHEDULER_PARTITIONS

    def __post_init__(self) -> None:
        if not self.holder:
            raise ValueError("PartitionScope.holder must not be empty")
        if self.partitions < 1:
            raise ValueError(
                f"PartitionScope.partitions must be at least 1, not {self.partitions!r}"
            )


def job_partition(job_id: uuid.UUID, partitions: int) -> int:
    """The partition of a job (the same as JobPartition computes in SQL)."""
    return (job_id.int & 0xFFFFFFFF) % partitions


class JobPartition(Func):
    """The partition of a job id column, in a query (storage.partitions.job_partition_sql):
    its last 8 hex digits as an unsigned 32-bit number, modulo the partition count."""

    output_field = IntegerField()

    def __init__(self, job_id: str | Expression, partitions: int) -> None:
        super().__init__(F(job_id) if isinstance(job_id, str) else job_id)
        self.partitions = partitions

    def as_sql(self, compiler, connection, **extra_context):
        sql, params = compiler.compile(self.get_source_expressions()[0])
        return job_partition_sql(sql), (*params, self.partitions)


def partitions_held(scope: PartitionScope) -> list[int]:
    """The partitions `scope.holder` holds now, on the database's clock."""
    return list(
        PartitionLease.objects.filter(
            holder=scope.holder, expires_at__gt=Now(), partition__lt=scope.partitions
        ).values_list("partition", flat=True)
    )


def in_partitions(partitions: list[int], scope: PartitionScope, job_id: str = "id") -> In:
    """A filter: the row's job (`job_id` names its column) is in one of `partitions`."""
    return In(JobPartition(job_id, scope.partitions), partitions)


class _InHeldPartitions(Func):
    """A partition among those of a subquery of held leases, read once per statement
    (storage.partitions.in_held_partitions_sql says why in that shape)."""

    conditional = True
    output_field = BooleanField()

    def as_sql(self, compiler, connection, **extra_context):
        partition, held = self.get_source_expressions()
        partition_sql, partition_params = compiler.compile(partition)
        held_sql, held_params = compiler.compile(held)
        return (
            in_held_partitions_sql(partition_sql, held_sql),
            (*partition_params, *held_params, *held_params),
        )


def in_held_partitions(scope: PartitionScope, job_id: str = "id") -> Func:
    """A filter: the row's job (`job_id` names its column) is in a partition whose lease
    `scope.holder` holds now, on the database's clock (the statement's start). Inside the
    claim's own statement, so a replica resumed after its leases expired claims nothing,
    whatever its own threads believe."""
    held = PartitionLease.objects.filter(
        holder=scope.holder, expires_at__gt=Now(), partition__lt=scope.partitions
    ).values("partition")
    return _InHeldPartitions(JobPartition(job_id, scope.partitions), Subquery(held))
