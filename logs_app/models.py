"""Run logs: small metadata rows here, content in a Django storage backend (or inline).

An attempt's output is shipped as numbered chunks of lines. Each chunk's row holds where
its content is, its size and checksum; the content itself lives in the `scheduler_logs`
storage (the filesystem by default; any django-storages backend by configuration), or in
the row itself when it is small or the storage is unreachable. An attempt that ended
through its own worker gets a manifest, committed with its outcome: the proof its logs are
complete.
"""

from django.db import models


class LogChunk(models.Model):
    attempt = models.ForeignKey("jobs.Attempt", on_delete=models.CASCADE, related_name="log_chunks")
    # Denormalized for retrieval and pruning without a join. No database constraint: its
    # check would take a share lock on the run row, which a handler inside `ctx.effect`
    # holds, and the shipper would wait on it while holding the attempt's row lock.
    run = models.ForeignKey(
        "jobs.Run", on_delete=models.CASCADE, related_name="log_chunks", db_constraint=False
    )
    sequence = models.PositiveIntegerField()  # 0, 1, 2 ... per attempt
    first_line = models.PositiveIntegerField()  # number of the chunk's first line in the attempt
    line_count = models.PositiveIntegerField()
    byte_count = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)
    # Either `content` (inline) or `storage_name` (a name in the `scheduler_logs` storage).
    content = models.TextField(blank=True, default="")
    storage_name = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            # A chunk sent again (a retry after a lost answer) is stored once.
            models.UniqueConstraint(fields=["attempt", "sequence"], name="log_chunk_once"),
        ]
        indexes = [models.Index(fields=["created_at"], name="log_chunk_age_idx")]

    def __str__(self) -> str:
        return f"log chunk {self.sequence} of attempt {self.attempt_id}"


class LogManifest(models.Model):
    """Written in the transaction that ends the attempt through its own worker: every chunk
    it shipped is stored. An attempt without one (lost, killed) has incomplete logs."""

    attempt = models.OneToOneField(
        "jobs.Attempt", on_delete=models.CASCADE, related_name="log_manifest"
    )
    chunk_count = models.PositiveIntegerField()
    line_count = models.PositiveIntegerField()
    byte_count = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)  # over the chunks' checksums, in order
    dropped_lines = models.PositiveIntegerField(default=0)  # past the per-attempt limit
    created_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"log manifest of attempt {self.attempt_id}"
