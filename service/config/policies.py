"""The policy objects that the settings configure (issue 36, item 5): `settings.py` parses the values and checks their
shapes only, and imports no policy; the rules themselves are built here from a `Settings`: the quotas, fair share,
node exclusion, the declared node types and stall detection.

`check` builds them all and raises a ValueError naming the key of the first mistake. A process runs it where it is
wired (`service.runtime.Runtime.open`), and `shunter config check` runs it on a file, so a mistake stops start-up,
not an admission pass later.
"""

from __future__ import annotations

from datetime import timedelta

from service.config.settings import Settings
from service.policy.demand import NodeType
from service.policy.exclusion import Rules
from service.policy.fairshare import FairShare
from service.policy.quotas import Quotas, parse_queue_limit
from service.policy.stall import StallPolicy


def quota_rules(settings: Settings) -> Quotas:
    return Quotas.parse(settings.quotas)


def fair_share(settings: Settings) -> FairShare:
    return FairShare.parse(settings.fair_share)


def exclusion_rules(settings: Settings) -> Rules:
    owners = settings.node_exclusion_owners or (2 if settings.api_tokens else 1)
    return Rules(repeats=settings.node_exclusion_repeats, jobs=settings.node_exclusion_jobs, owners=owners,
                 cooldown=timedelta(seconds=settings.node_exclusion_cooldown_seconds))  # fmt: skip


def node_types(settings: Settings) -> list[NodeType]:
    return [NodeType(name, dict(t.resources), t.max) for name, t in sorted(settings.node_types.items())]


def stall_policy(settings: Settings) -> StallPolicy:
    return StallPolicy(detect=settings.stall_detection, min_seconds=settings.stall_min_seconds,
                       factor=settings.stall_factor)  # fmt: skip


def check(settings: Settings) -> None:
    """Build every policy the settings configure; a ValueError names the key of the first mistake."""
    for name, conf in settings.queues.items():
        parse_queue_limit(conf, f"queues.{name}")
    for build in (quota_rules, fair_share, exclusion_rules, node_types, stall_policy):
        build(settings)
