"""Round trip is an invariant: every spec the API accepts validates again, unchanged, from each form it is kept in.

The spec is stored as its full JSON dump (every default filled in), read back from the database by the dispatcher
and handed to the driver as JSON; a validator that depends on which fields were *given* breaks that. The generator
below builds valid spec bodies across every entrypoint, strategy and resources shape; the properties check the full
dump, the `exclude_unset` dump, JSON text and a real SQLite / PostgreSQL row.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.lifecycle.jobs import submit
from service.spec.job import JobSpec
from service.store.db import session_scope
from service.store.models import Job, JobState
from service.tenancy.auth import Caller

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DB_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    # One database per test function (a fresh one per example is far too slow); examples only append jobs to it.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,8}"
MEMORY_UNITS = ["", "B", "K", "KB", "KiB", "M", "MB", "MiB", "mib", "G", "GB", "GiB", "g", "T", "TiB"]

# JSON values: what an HTTP body can carry (no NaN or infinity, which the spec refuses).
json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
positive_floats = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


def optional(draw: st.DrawFn, out: dict[str, Any], key: str, values: st.SearchStrategy[Any]) -> None:
    """Give `key` half the time: a field left out and a field given must both survive the trip."""
    if draw(st.booleans()):
        out[key] = draw(values)


@st.composite
def entrypoints(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["callable", "script", "recipe"]))
    if kind == "callable":
        path = draw(st.from_regex(rf"{IDENT}(\.{IDENT}){{0,2}}:{IDENT}(\.{IDENT})?", fullmatch=True))
        return {"callable": path}
    if kind == "recipe":
        return {"recipe": "causal-lm"}
    out: dict[str, Any] = {"script": draw(st.text(min_size=1, max_size=20))}
    optional(draw, out, "args", st.lists(st.text(max_size=10), max_size=4))
    # Output directories: distinct single-part names (none inside another), some hidden ones among them.
    optional(draw, out, "outputs", st.lists(st.from_regex(r"\.?[a-z0-9_-][a-z0-9_.-]{0,8}", fullmatch=True),
                                            max_size=4, unique=True))  # fmt: skip
    optional(draw, out, "resume_arg", st.from_regex(r"--?[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True))
    return out


@st.composite
def resources(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ranges = st.tuples(st.integers(1, 16), st.integers(0, 16)).map(lambda t: {"min": t[0], "max": t[0] + t[1]})
    optional(draw, out, "num_workers", st.integers(1, 16) | ranges)  # a number, or an elastic {min, max}
    optional(draw, out, "use_gpu", st.booleans())
    optional(draw, out, "placement", st.sampled_from(["pack", "spread", "strict_pack", "strict_spread"]))
    if draw(st.booleans()):
        per: dict[str, Any] = {}
        optional(draw, per, "CPU", st.integers(1, 64) | st.floats(0.0001, 64))  # a worker holds some CPU
        if out.get("use_gpu"):
            optional(draw, per, "GPU", st.integers(1, 8) | st.sampled_from([0.25, 0.5, 1.0]))
        memory_strings = st.builds(
            lambda n, frac, unit, space: f"{n}{frac}{space}{unit}",
            st.integers(0, 4096),
            st.sampled_from(["", ".5", ".25"]),
            st.sampled_from(MEMORY_UNITS),
            st.sampled_from(["", " "]),
        )
        optional(draw, per, "memory", memory_strings | st.integers(0, 2**40))
        custom = st.dictionaries(
            st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: k not in ("memory",)),
            st.integers(0, 100) | st.floats(0, 100),
            max_size=2,
        )
        per.update(draw(custom))
        out["resources_per_worker"] = per
    return out


def fsdp_options(draw: st.DrawFn, workers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    shardings = ["full_shard", "shard_grad_op"] + (["hybrid_shard"] if workers >= 2 else [])
    optional(draw, out, "sharding", st.sampled_from(shardings))
    if out.get("sharding") == "hybrid_shard":
        optional(draw, out, "shard_size", st.sampled_from([d for d in range(1, workers + 1) if workers % d == 0]))
    optional(draw, out, "cpu_offload", st.booleans())
    optional(draw, out, "activation_checkpointing", st.booleans())
    optional(draw, out, "wrap_classes", st.none() | st.lists(st.from_regex(IDENT, fullmatch=True), max_size=3))
    return out


def deepspeed_short(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    optional(draw, out, "zero_stage", st.integers(0, 3))
    stage = out.get("zero_stage", 2)
    optional(draw, out, "offload_optimizer", st.sampled_from(["none", "cpu"] if stage else ["none"]))
    optional(draw, out, "offload_param", st.sampled_from(["none", "cpu"] if stage == 3 else ["none"]))
    optional(draw, out, "overlap_comm", st.booleans())
    optional(draw, out, "reduce_bucket_size", st.integers(1, 10**9))
    optional(draw, out, "allgather_bucket_size", st.integers(1, 10**9))
    return out


def deepspeed_config(draw: st.DrawFn, strategy: dict[str, Any], *, workers: int, use_gpu: bool) -> dict[str, Any]:
    """A full DeepSpeed config that agrees with the rest of the spec, "auto" where the spec fills it in."""
    config: dict[str, Any] = {}
    spec_micro = strategy.get("micro_batch_size")
    spec_accum = strategy.get("gradient_accumulation_steps")
    optional(draw, config, "train_micro_batch_size_per_gpu", st.just("auto") | st.just(spec_micro or 4))
    optional(draw, config, "gradient_accumulation_steps", st.just("auto") | st.just(spec_accum or 2))
    micro = config.get("train_micro_batch_size_per_gpu")
    micro = spec_micro if micro in (None, "auto") else micro
    accum = config.get("gradient_accumulation_steps")
    accum = (spec_accum or 1) if accum in (None, "auto") else accum
    if micro is not None:
        total = st.just(micro * accum * workers)
    else:
        total = st.integers(1, 8).map(lambda k: k * accum * workers)
    optional(draw, config, "train_batch_size", st.just("auto") | total)
    clip = strategy.get("gradient_clipping")
    optional(draw, config, "gradient_clipping", st.just("auto") | (st.just(clip) if clip else positive_floats))
    precision = draw(st.sampled_from([None, "auto", "fp16", "bf16"] if use_gpu else [None, "auto"]))
    for name in ("fp16", "bf16"):
        if precision == "auto":
            optional(draw, config, name, st.just({"enabled": "auto"}))
        elif precision == name:
            config[name] = {"enabled": True}
        elif draw(st.booleans()):
            config[name] = {"enabled": False}
    if draw(st.booleans()):
        zero: dict[str, Any] = {}
        optional(draw, zero, "stage", st.integers(0, 3))
        stage = zero.get("stage", 0)
        if stage:
            optional(draw, zero, "offload_optimizer", st.sampled_from([{"device": "cpu"}, {"device": "none"}]))
        if stage == 3:
            devices = ["cpu", "none"] + (["nvme"] if use_gpu else [])
            optional(draw, zero, "offload_param", st.sampled_from(devices).map(lambda d: {"device": d}))
            optional(draw, zero, "stage3_prefetch_bucket_size", st.just("auto") | st.integers(1, 10**8))
        optional(draw, zero, "overlap_comm", st.booleans())
        optional(draw, zero, "contiguous_gradients", st.booleans())
        optional(draw, zero, "reduce_bucket_size", st.just("auto") | st.integers(1, 10**9))
        config["zero_optimization"] = zero
    if draw(st.booleans()):
        params = draw(
            st.dictionaries(st.sampled_from(["lr", "weight_decay", "eps"]), st.just("auto") | positive_floats)
        )
        config["optimizer"] = {"type": draw(st.sampled_from(["AdamW", "Adam", "SGD"])), "params": params}
    optional(draw, config, "steps_per_print", st.integers(1, 10**6))
    return config


@st.composite
def strategies(draw: st.DrawFn, *, workers: int, use_gpu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kind = draw(st.sampled_from(["ddp", "fsdp", "deepspeed", "deepspeed-config", None]))
    if kind is not None:
        out["kind"] = kind.removesuffix("-config")
    precisions = ["no", "auto"] + (["fp16", "bf16"] if use_gpu else [])
    optional(draw, out, "mixed_precision", st.sampled_from(precisions))
    optional(draw, out, "gradient_accumulation_steps", st.integers(1, 4096))
    optional(draw, out, "gradient_clipping", positive_floats)
    optional(draw, out, "micro_batch_size", st.integers(1, 64))
    if draw(st.booleans()):
        out["scale_lr"] = "linear"
        out["base_batch_size"] = draw(st.integers(1, 4096))
    else:
        optional(draw, out, "scale_lr", st.just("none"))
        optional(draw, out, "base_batch_size", st.integers(1, 4096))
    optional(draw, out, "seed", st.integers(0, 2**32 - 1))
    if kind == "fsdp":
        optional(draw, out, "fsdp", st.just(fsdp_options(draw, workers)))
    elif kind == "deepspeed":
        optional(draw, out, "deepspeed", st.just(deepspeed_short(draw)))
    elif kind == "deepspeed-config":
        out["deepspeed"] = {"config": deepspeed_config(draw, out, workers=workers, use_gpu=use_gpu)}
    return out


STATE_NAMES = ["QUEUED", "STARTING", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"]


@st.composite
def notify_entries(draw: st.DrawFn, *, with_secret: bool) -> dict[str, Any]:
    """A `notify` entry. Its secret is write-only (never dumped): the generic properties draw entries without one, and
    test_notify_secrets_are_the_one_thing_not_dumped states that exception."""
    host = draw(st.sampled_from(["hooks.example.com", "example.org:8443", "93.184.215.14", "[2606:4700::1]"]))
    path = draw(st.from_regex(r"(/[A-Za-z0-9._~-]{0,8}){0,3}(\?[a-z]=[0-9]{1,3})?", fullmatch=True))
    entry: dict[str, Any] = {"url": f"{draw(st.sampled_from(['http', 'https']))}://{host}{path}"}
    optional(draw, entry, "events", st.lists(st.sampled_from(STATE_NAMES), min_size=1, max_size=7, unique=True))
    optional(draw, entry, "format", st.sampled_from(["json", "slack"]))
    if with_secret:
        # Any text but control characters (refused: PostgreSQL could not keep a NUL as written).
        secrets = st.text(st.characters(codec="utf-8", exclude_categories=("Cc",)), min_size=16, max_size=40)
        optional(draw, entry, "secret", secrets)
    return entry


@st.composite
def spec_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid JobSpec body, as a client would POST it: some fields given, the rest left to their defaults."""
    body: dict[str, Any] = {"entrypoint": draw(entrypoints())}
    res = draw(resources())
    if res or draw(st.booleans()):
        body["resources"] = res
    workers, use_gpu = res.get("num_workers", 1), res.get("use_gpu", False)
    if isinstance(workers, int):  # the strategies drawn suit one size; a range's are tested in test_elastic.py
        optional(draw, body, "strategy", strategies(workers=workers, use_gpu=use_gpu))
    optional(draw, body, "name", st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True))
    optional(draw, body, "queue", st.sampled_from(["default", "gpu", "batch-2", "a_b"]))
    optional(draw, body, "priority", st.integers(-1000, 1000))
    optional(draw, body, "config", st.dictionaries(st.text(max_size=8), json_values, max_size=5))
    retries: dict[str, Any] = {}
    optional(draw, retries, "max_worker_failures", st.integers(0, 100))
    optional(draw, retries, "max_attempts", st.integers(1, 100))
    optional(draw, retries, "backoff_seconds", st.integers(0, 86400) | st.floats(0, 86400))
    optional(draw, retries, "max_backoff_seconds", st.floats(0, 86400))
    optional(draw, retries, "retry_on_timeout", st.booleans())
    optional(draw, body, "retries", st.just(retries))
    checkpoint: dict[str, Any] = {}
    optional(draw, checkpoint, "storage", st.none() | st.sampled_from(["/tmp/ckpt", "s3://bucket/prefix", "ckpts"]))
    optional(draw, checkpoint, "keep", st.integers(1, 1000))
    ids = st.integers(1, 2**31 - 1).map(str)  # a row id (32-bit on PostgreSQL)
    optional(draw, checkpoint, "resume_from", st.sampled_from(["latest", "none"]) | ids)
    optional(draw, body, "checkpoint", st.just(checkpoint))
    runtime_env: dict[str, Any] = {}
    optional(
        draw,
        runtime_env,
        "env_vars",
        st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True), st.text(max_size=10), max_size=3),
    )
    optional(draw, runtime_env, "working_dir", st.just("."))
    optional(draw, runtime_env, "pip", st.lists(st.sampled_from(["numpy", "tqdm==4.66.0"]), max_size=2))
    optional(draw, body, "runtime_env", st.just(runtime_env))
    optional(draw, body, "timeout_seconds", st.integers(1, 30 * 86400) | st.floats(0.001, 30 * 86400))
    preflight: dict[str, Any] = {}
    optional(draw, preflight, "enabled", st.booleans())
    optional(draw, preflight, "slow_factor", st.integers(1, 1000) | st.floats(1.0, 1000.0))
    optional(draw, preflight, "timeout_seconds", st.integers(1, 600) | st.floats(1.0, 600.0))
    optional(draw, body, "preflight", st.just(preflight))
    optional(draw, body, "stall_timeout_seconds", st.integers(1, 7 * 86400) | st.floats(0.001, 7 * 86400))
    optional(draw, body, "notify", st.lists(notify_entries(with_secret=False), max_size=3))
    dependencies(draw, body)
    return body


def dependencies(draw: st.DrawFn, body: dict[str, Any]) -> None:
    """depends_on entries (some named, each condition), and config references to the named ones."""
    if draw(st.booleans()):
        jobs = draw(st.lists(st.from_regex(r"j[0-9a-f]{1,6}", fullmatch=True), max_size=3, unique=True))
        entries: list[dict[str, Any]] = []
        for i, job in enumerate(jobs):
            entry: dict[str, Any] = {"job": job}
            optional(draw, entry, "on", st.sampled_from(["succeeded", "ended"]))
            optional(draw, entry, "as", st.sampled_from([f"d{i}", f"_{i}x"]) | st.none())
            entries.append(entry)
        body["depends_on"] = entries
        named = [e["as"] for e in entries if e.get("as")]
        if named and draw(st.booleans()):
            ref = f"${{deps.{draw(st.sampled_from(named))}.{draw(st.sampled_from(['checkpoint', 'model']))}}}"
            body["config"] = {**body.get("config", {}), "init_from": draw(st.sampled_from([ref, f"{ref}/w.pt"]))}
    optional(draw, body, "on_dependency_failure", st.sampled_from(["fail", "cancel"]))


def accepted(body: dict[str, Any]) -> JobSpec:
    """The generator aims at valid specs only; whatever the model still refuses is filtered (and must stay rare)."""
    try:
        return JobSpec.model_validate(body)
    except ValidationError:
        assume(False)
        raise


@SETTINGS
@given(spec_bodies())
def test_full_dump_round_trips(body: dict[str, Any]) -> None:
    spec = accepted(body)
    dump = spec.model_dump(mode="json")
    again = JobSpec.model_validate(dump)
    assert again == spec
    assert again.model_dump(mode="json") == dump
    through_text = JobSpec.model_validate(json.loads(json.dumps(dump)))
    assert through_text == spec and through_text.model_dump(mode="json") == dump
    from_json = JobSpec.model_validate_json(spec.model_dump_json())  # what the driver receives
    assert from_json == spec and from_json.model_dump(mode="json") == dump


@SETTINGS
@given(spec_bodies())
def test_exclude_unset_dump_round_trips(body: dict[str, Any]) -> None:
    spec = accepted(body)
    sparse = spec.model_dump(mode="json", exclude_unset=True)
    again = JobSpec.model_validate(sparse)
    assert again == spec
    assert again.model_dump(mode="json") == spec.model_dump(mode="json")
    assert JobSpec.model_validate(json.loads(json.dumps(sparse))) == spec


def test_generator_yields_only_valid_specs() -> None:
    """Guard on the generator itself: the round-trip tests mean little if it mostly builds refused specs."""
    refused: list[str] = []

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(spec_bodies())
    def check(body: dict[str, Any]) -> None:
        try:
            JobSpec.model_validate(body)
        except ValidationError as exc:
            refused.append(str(exc))

    check()
    assert not refused, refused[:3]


@DB_SETTINGS
@given(body=spec_bodies())
def test_stored_spec_round_trips_through_the_database(db: Engine, body: dict[str, Any]) -> None:
    spec = accepted(body)
    with session_scope(db) as session:
        for dep in spec.depends_on:  # the jobs it depends on exist, and run: the new one waits for them
            if session.get(Job, dep.job) is None:
                session.add(Job(id=dep.job, name="dep", owner="roundtrip", state=JobState.RUNNING, spec={}))
        session.flush()
        job, created = submit(session, spec, caller=Caller(owner="roundtrip"))
        job_id = job.id
    assert created
    with Session(db) as session:
        row = session.get(Job, job_id)
        assert row is not None
        stored = JobSpec.model_validate(row.spec)
    assert stored == spec
    assert stored.model_dump(mode="json") == spec.model_dump(mode="json")


BUG_SPEC = {
    "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"},
    "config": {"steps": 6},
    "strategy": {"kind": "deepspeed", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}},
    "resources": {"num_workers": 2},
}


def test_full_deepspeed_config_survives_its_own_dump() -> None:
    """Issue 11: accepted at submission, then refused ("not both") when the dispatcher re-read the stored dump."""
    spec = JobSpec.model_validate(BUG_SPEC)
    dump = spec.model_dump(mode="json")
    assert JobSpec.model_validate(dump) == spec
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    assert dump["strategy"]["deepspeed"]["zero_stage"] is None  # "not given" is stored as such, not as stage 2
    assert spec.strategy.deepspeed_options.config == {"zero_optimization": {"stage": 3}}


def test_spec_gradient_accumulation_survives_its_own_dump() -> None:
    """A config's own accumulation steps beside an unset spec value must not turn into a contradiction."""
    body = {
        **BUG_SPEC,
        "strategy": {"kind": "deepspeed", "deepspeed": {"config": {"gradient_accumulation_steps": 4}}},
    }
    spec = JobSpec.model_validate(body)
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec
    assert spec.strategy.gradient_accumulation_steps is None and spec.strategy.accumulation_steps == 1
    # Given explicitly, even at the old default, a contradicting value is still refused.
    with pytest.raises(ValidationError, match="gradient_accumulation_steps: 4 contradicts"):
        JobSpec.model_validate({**body, "strategy": {**body["strategy"], "gradient_accumulation_steps": 1}})


@pytest.mark.parametrize(
    "value", ["²", "0", "01", "1" * 30, "-1", "1.5", " 1", "1\n", "", "LATEST", "١", "2147483648", "9" * 18]
)
def test_resume_from_refuses_what_is_no_checkpoint_id(value: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({**BUG_SPEC, "checkpoint": {"resume_from": value}})
    (only,) = err.value.errors()
    assert only["loc"] == ("checkpoint", "resume_from")
    assert "must be 'latest', 'none' or a checkpoint id" in only["msg"]


@pytest.mark.parametrize("value", ["latest", "none", "1", "123", "2147483647"])
def test_resume_from_accepts_latest_none_and_ids(value: str) -> None:
    spec = JobSpec.model_validate({**BUG_SPEC, "checkpoint": {"resume_from": value}})
    assert spec.checkpoint.resume_from == value
    assert spec.checkpoint.checkpoint_id == (None if value in ("latest", "none") else int(value))


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"name": "job\n"}, "name"),
        ({"queue": "default\n"}, "queue"),
        ({"entrypoint": {"callable": "examples.mlp:train_loop\n"}}, "entrypoint.callable"),
    ],
)
def test_trailing_newline_is_refused(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({**BUG_SPEC, **patch})
    assert [".".join(str(p) for p in e["loc"]).startswith(field) for e in err.value.errors()] == [True]


@pytest.mark.parametrize(
    "patch",
    [
        {"config": {"lr": float("nan")}},
        {"config": {"schedule": [1.0, float("inf")]}},
        {"strategy": {"gradient_clipping": float("inf")}},
        {"resources": {"resources_per_worker": {"CPU": float("nan")}}},
        {"resources": {"resources_per_worker": {"memory": float("inf")}}},
        {"resources": {"resources_per_worker": {"memory": "9" * 400}}},
        {"strategy": {"kind": "deepspeed", "deepspeed": {"config": {"train_batch_size": float("inf")}}}},
        {"runtime_env": {"config": {"setup_timeout_seconds": float("-inf")}}},
    ],
)
def test_non_json_numbers_are_refused(patch: dict[str, Any]) -> None:
    """NaN and infinity do not survive JSON (model_dump_json writes null; PostgreSQL refuses them): a 422, not a
    spec that comes back different, nor an OverflowError (a 500)."""
    with pytest.raises(ValidationError):
        JobSpec.model_validate({**BUG_SPEC, **patch})


@DB_SETTINGS
@given(body=spec_bodies(), entries=st.lists(notify_entries(with_secret=True), min_size=1, max_size=3))
def test_notify_secrets_are_the_one_thing_not_dumped(db: Engine, body: dict[str, Any], entries: list[Any]) -> None:
    """A notify entry's secret is write-only: no dump of the spec holds it (the API returns the stored spec, the driver
    gets it), and everything else round-trips exactly as the generic properties say; the secret itself is stored
    apart (notify_secrets), exactly as written."""
    from service.store.notify_tables import NotifySecret

    body = {k: v for k, v in body.items() if k != "depends_on"}  # no jobs to depend on in this database
    spec = accepted({**body, "notify": entries})
    without = accepted({**body, "notify": [{k: v for k, v in e.items() if k != "secret"} for e in entries]})
    dump = spec.model_dump(mode="json")
    assert dump == without.model_dump(mode="json")
    assert JobSpec.model_validate(dump) == without
    assert JobSpec.model_validate_json(spec.model_dump_json()) == without
    with session_scope(db) as session:
        job, _ = submit(session, spec, caller=Caller(owner="roundtrip"))
        job_id = job.id
    with Session(db) as session:
        row = session.get(Job, job_id)
        assert row is not None and JobSpec.model_validate(row.spec) == without
        kept = {s.target: s.secret for s in session.exec(select(NotifySecret).where(NotifySecret.job_id == job_id))}
    assert kept == {i: e["secret"] for i, e in enumerate(entries) if "secret" in e}


@DB_SETTINGS
@given(body=spec_bodies())
def test_a_job_written_in_one_statement_reads_back_as_the_orm_writes_it(db: Engine, body: dict[str, Any]) -> None:
    """POST /v1/jobs on PostgreSQL writes the job, its event and its signals in one statement (`written_at_once`):
    every column, JSON nulls included, and the event must read back as the ORM's own path writes them."""
    spec = accepted(body)
    assume(not spec.depends_on)  # (a job with dependencies is always written by the ORM)
    ids = []
    # The ORM's path; the statement as a transaction of its own; the statement in a transaction that read first (an
    # Idempotency-Key is looked up), where the ORM's columns (idempotency_key) must come out the same.
    for at_once, key in ((False, None), (True, None), (True, f"k-{uuid.uuid4().hex}")):
        with session_scope(db) as session:
            job, created = submit(session, spec, caller=Caller(owner="roundtrip", team="t"), written_at_once=at_once,
                                  idempotency_key=key)  # fmt: skip
            assert created
            ids.append(job.id)
    columns = [c.name for c in Job.__table__.columns if c.name not in ("id", "created_at", "updated_at")]  # type: ignore[attr-defined]
    raw = text(f"SELECT {', '.join(f'CAST({c} AS TEXT)' for c in columns)} FROM jobs WHERE id = :id")
    event = text(
        "SELECT kind, from_state, to_state, reason, message, attempt, actor FROM job_events WHERE job_id = :id"
    )
    with db.connect() as conn:
        orm, alone, keyed = (dict(zip(columns, conn.execute(raw, {"id": i}).one(), strict=True)) for i in ids)
        events = [conn.execute(event, {"id": i}).all() for i in ids]
    assert alone == orm
    assert keyed.pop("idempotency_key") is not None
    assert keyed == {k: v for k, v in orm.items() if k != "idempotency_key"}
    assert events[2] == events[1] == events[0] and len(events[0]) == 1
    with Session(db) as session:
        for job_id in ids:
            row = session.get(Job, job_id)
            assert row is not None and JobSpec.model_validate(row.spec) == spec


HEX64 = st.text("0123456789abcdef", min_size=64, max_size=64)
# What a zip member's path can be once `service.tenancy.code_store.check_archive` took it: any text but NUL and
# backslash.
member_paths = st.lists(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\\/"), min_size=1, max_size=12),
    min_size=1,
    max_size=4,
).map("/".join)


@DB_SETTINGS
@given(files=st.dictionaries(member_paths, HEX64, max_size=12), sealed=st.none() | HEX64)
def test_what_proves_storage_reads_back_as_written(db: Engine, files: dict[str, str], sealed: str | None) -> None:
    """A code archive's listing (paths to sha256, recorded at upload) and a checkpoint's manifest hash (recorded at its
    report) read back exactly as written: what an attempt is handed to prove its storage by is what was recorded."""
    from service.lifecycle import reports
    from service.store.models import ACTIVE_STATES, Attempt, CodeArchive
    from service.tenancy import code_manifest, code_proof

    owner, archive = f"o{uuid.uuid4().hex[:8]}", uuid.uuid4().hex * 2
    with session_scope(db) as session:
        session.add(CodeArchive(owner=owner, sha256=archive, size=1))
    code_proof.record(db, owner=owner, sha256=archive, files=files)
    job = Job(name="j", owner=owner, spec={}, state=JobState.RUNNING, attempt=1)
    with session_scope(db) as session:
        session.add(job)
        session.flush()
        session.add(Attempt(job_id=job.id, number=1, submission_id=f"shunter-{job.id}-1"))
        job_id = job.id
    assert JobState.RUNNING in ACTIVE_STATES
    uri = f"s3://bucket/{job_id}/{next(iter(files), 'checkpoint')}"
    assert reports.record_report(db, job_id=job_id, attempt=1, metrics={}, checkpoint_uri=uri, manifest_sha256=sealed)
    with Session(db) as session:
        row = session.exec(select(CodeArchive).where(CodeArchive.owner == owner)).one()
    assert row.tree == files and row.tree_sha256 == code_manifest.digest(files) == code_manifest.digest(dict(row.tree))
    assert reports.checkpoint_manifest(db, job_id=job_id, uri=uri) == (True, sealed)
