"""Policies models: priority classes, tier policies, namespace quotas, modes and their schedules, and the
versions of it all.

The field rules live in rules.py (shared with a mode's overrides); the constraints here repeat the
simple ones so that no write that skips the services can store a policy the planner cannot use.
"""

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q

from controlplane.directory.choices import TierLevel
from controlplane.policies.choices import Algorithm, ModeKind, QuotaTier, RemoteWrite


class PriorityClass(models.Model):
    """A class of blocks (by namespace) with a weight and a cap on the device tier.

    `device_share` is the largest fraction of a node's device tier that blocks of the class may
    hold; the shares of all classes add up to at most 1, so each class can always reach its own.
    `weight` ranks classes when the planner must choose whose blocks leave a tier first (lower
    leaves first). A namespace belongs to one class at most; namespaces in none belong to `default`.
    `remote_write` says when the class's blocks reach the shared remote tier (L3): when the planner
    demotes them (on-demotion), or at write-back beside the node's own copy (write-through), so that
    any node of the fleet finds them at once."""

    name = models.SlugField(max_length=63, unique=True)
    weight = models.FloatField(default=1.0)
    device_share = models.FloatField(default=1.0)
    namespaces = ArrayField(
        models.SlugField(max_length=63),
        default=list,
        blank=True,
        help_text="Names of the namespaces whose blocks belong to this class.",
    )
    remote_write = models.CharField(
        max_length=16,
        choices=RemoteWrite.choices,
        default=RemoteWrite.ON_DEMOTION,
        help_text="When the class's blocks reach L3: on-demotion (by the planner) or write-through (at write-back).",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "priority classes"
        constraints = [
            models.CheckConstraint(condition=Q(weight__gt=0), name="priorityclass_weight_positive"),
            models.CheckConstraint(
                condition=Q(device_share__gte=0) & Q(device_share__lte=1), name="priorityclass_device_share_fraction"
            ),
            models.CheckConstraint(
                condition=Q(remote_write__in=["on-demotion", "write-through"]), name="priorityclass_remote_write_known"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class TierPolicy(models.Model):
    """How full one tier may get and which blocks leave it first, fleet-wide (`node_group` empty)
    or for the nodes of one group (which then wins over the fleet-wide one).

    Effective capacity = min(capacity_bytes, the node's report) × capacity_fraction (capacity_bytes
    empty: the report). Above high_watermark × that, the planner moves blocks out, in `algorithm`
    order, blocks with fewer than `min_accesses` accesses first, until low_watermark × that is
    reached; blocks idle longer than `ttl_seconds` leave at any fill level. They go to
    `demote_tier` (empty: the next slower tier the node has)."""

    tier = models.CharField(max_length=8, choices=TierLevel.choices)
    node_group = models.CharField(
        max_length=63, blank=True, default="", help_text="Empty: every node; otherwise the nodes of this group."
    )
    capacity_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Cap on the tier; empty: what the node reports."
    )
    capacity_fraction = models.FloatField(
        default=1.0, help_text="Share of the capacity the cache may fill; the rest is headroom."
    )
    high_watermark = models.FloatField(default=0.90)
    low_watermark = models.FloatField(default=0.75)
    algorithm = models.CharField(max_length=16, choices=Algorithm.choices, default=Algorithm.LRU)
    ttl_seconds = models.PositiveIntegerField(
        null=True, blank=True, help_text="Blocks idle this long leave the tier; empty: never by age."
    )
    min_accesses = models.PositiveIntegerField(default=0)
    demote_tier = models.CharField(
        max_length=8,
        choices=TierLevel.choices,
        blank=True,
        default="",
        help_text="Where leaving blocks go; empty: the next slower tier.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tier", "node_group"]
        verbose_name_plural = "tier policies"
        constraints = [
            models.UniqueConstraint(fields=["tier", "node_group"], name="tierpolicy_tier_group_uniq"),
            models.CheckConstraint(
                condition=Q(low_watermark__gt=0)
                & Q(low_watermark__lt=models.F("high_watermark"))
                & Q(high_watermark__lte=1),
                name="tierpolicy_watermarks_ordered",
            ),
            models.CheckConstraint(
                condition=Q(capacity_fraction__gt=0) & Q(capacity_fraction__lte=1), name="tierpolicy_capacity_fraction"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tier}@{self.node_group or 'fleet'}"


class Mode(models.Model):
    """A named set of overrides laid over the base policies while the mode is active (one at most).

    `overrides` = {"tiers": [partial tier policies keyed by tier and node_group],
                   "classes": [partial priority classes keyed by name]}; every field obeys the
    rules of the policy it overrides (rules.overrides_parse)."""

    name = models.SlugField(max_length=63, unique=True)
    kind = models.CharField(max_length=16, choices=ModeKind.choices, default=ModeKind.CUSTOM)
    description = models.CharField(max_length=255, blank=True)
    overrides = models.JSONField(default=dict, blank=True)
    active = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["active"], condition=Q(active=True), name="mode_one_active"),
        ]

    def __str__(self) -> str:
        return self.name


class ModeSchedule(models.Model):
    """Switch to a mode at the times of a cron expression ("m h dom mon dow", UTC), through a
    django-celery-beat entry that this row owns (created, changed and deleted with it)."""

    mode = models.ForeignKey(Mode, on_delete=models.CASCADE, related_name="schedules")
    cron = models.CharField(max_length=128, help_text='Five fields, "minute hour day-of-month month day-of-week", UTC.')
    enabled = models.BooleanField(default=True)
    periodic_task = models.OneToOneField(
        "django_celery_beat.PeriodicTask",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        editable=False,
    )
    author = models.CharField(max_length=150, blank=True, help_text="User name of the last change.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.mode_id} at {self.cron}"


class PolicyVersion(models.Model):
    """One state of all policies: written by every edit, mode switch and rollback. `number` grows
    by one each time; `snapshot` holds classes, tier policies, namespace quotas, modes and the
    active mode in full, so a rollback can restore any version."""

    number = models.PositiveIntegerField(unique=True)
    snapshot = models.JSONField()
    action = models.CharField(max_length=64, help_text="What changed, e.g. priority-class.update.")
    author = models.CharField(max_length=150, blank=True, help_text="User name; empty for the system.")
    comment = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-number"]

    def __str__(self) -> str:
        return f"v{self.number}"


class NamespaceQuota(models.Model):
    """At most `bytes` of one namespace's blocks in one tier: in each node's host or disk tier, or
    in the shared remote tier. The planner moves the namespace's own coldest blocks out of a tier
    it is over (never another namespace's); the nodes enforce the same number at write-back."""

    namespace = models.SlugField(max_length=63, help_text="Name of the namespace the quota caps.")
    tier = models.CharField(max_length=8, choices=QuotaTier.choices)
    bytes = models.PositiveBigIntegerField(help_text="Bytes the namespace may hold (per node for host and disk).")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["namespace", "tier"]
        constraints = [
            models.UniqueConstraint(fields=["namespace", "tier"], name="namespacequota_namespace_tier_uniq"),
            models.CheckConstraint(condition=Q(bytes__gt=0), name="namespacequota_bytes_positive"),
            models.CheckConstraint(condition=Q(tier__in=QuotaTier.values), name="namespacequota_tier_known"),
        ]

    def __str__(self) -> str:
        return f"{self.namespace}@{self.tier}"


class LoadFollowing(models.Model):
    """The settings and state of load-following (one row): when enabled, the control plane switches
    to chat-peak, long-doc or nightly-batch (or no mode) as the nodes' traffic calls for
    (loadfollow.Thresholds: each mode's enter and looser leave threshold, the minimum dwell).

    A mode switch by anyone else holds load-following off: a manual one for `manual_hold_seconds`,
    a scheduled one for `schedule_hold_seconds` (the schedule's window), or until resumed."""

    enabled = models.BooleanField(default=False)
    window_seconds = models.FloatField(
        default=180.0, help_text="Only nodes whose traffic was reported this recently count."
    )
    long_prompt_tokens = models.PositiveIntegerField(
        default=2048, help_text="Prompts of at least this many tokens are long documents (a power of two, 128-32768)."
    )
    chat_enter_rpm = models.FloatField(default=120.0)
    chat_leave_rpm = models.FloatField(default=80.0)
    long_enter_share = models.FloatField(default=0.5)
    long_leave_share = models.FloatField(default=0.3)
    quiet_enter_rpm = models.FloatField(default=5.0)
    quiet_leave_rpm = models.FloatField(default=15.0)
    pressure_enter = models.FloatField(default=0.85, help_text="L1 pressure that, with a queue, makes a chat peak.")
    queue_enter = models.FloatField(
        default=8.0, help_text="Fleet queue depth that, with L1 pressure, makes a chat peak."
    )
    min_dwell_seconds = models.FloatField(default=600.0)
    manual_hold_seconds = models.FloatField(default=3600.0)
    schedule_hold_seconds = models.FloatField(default=3600.0)
    mode = models.CharField(max_length=63, blank=True, default="", help_text="Mode load-following last switched to.")
    switched_at = models.DateTimeField(null=True, blank=True)
    resumed_at = models.DateTimeField(null=True, blank=True, help_text="Switches before this hold nothing.")
    checked_at = models.DateTimeField(null=True, blank=True)
    last_reason = models.CharField(max_length=255, blank=True, default="")
    author = models.CharField(max_length=150, blank=True, help_text="User name of the last change of settings.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "load following"
        constraints = [models.CheckConstraint(condition=Q(id=1), name="loadfollowing_singleton")]

    def __str__(self) -> str:
        return "load-following " + ("on" if self.enabled else "off")
