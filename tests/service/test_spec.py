"""Spec validation: everything a user can get wrong, named by field."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from service.spec.job import JobSpec, parse_memory

OK = {"entrypoint": {"callable": "examples.mlp:train_loop"}}


def errors_of(data: dict) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in err.value.errors()]


def test_example_spec_is_valid(repo_root) -> None:
    spec = JobSpec.model_validate(yaml.safe_load((repo_root / "examples" / "mlp-ddp.yaml").read_text()))
    assert spec.resources.num_workers == 2
    assert spec.resources.per_worker() == {"CPU": 1.0}


def test_every_example_spec_is_valid_and_its_script_exists(repo_root) -> None:
    examples = sorted((repo_root / "examples").glob("*.yaml"))
    assert len(examples) >= 9
    for path in examples:
        spec = JobSpec.model_validate(yaml.safe_load(path.read_text()))
        if spec.entrypoint.script:
            assert (repo_root / spec.entrypoint.script).is_file(), path


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"resources": {"num_workers": 0}}, "resources.num_workers"),
        ({"resources": {"num_workers": -3}}, "resources.num_workers"),
        ({"entrypoint": {"callable": "no_colon"}}, "entrypoint.callable"),
        ({"entrypoint": {"callable": "a:b:c"}}, "entrypoint.callable"),
        ({"entrypoint": {"callable": "a:b", "script": "x.py"}}, "entrypoint"),
        ({"entrypoint": {}}, "entrypoint"),
        ({"entrypoint": {"recipe": "nope"}}, "entrypoint.recipe"),
        ({"strategy": {"kind": "horovod"}}, "strategy.kind"),
        ({"resources": {"placement": "diagonal"}}, "resources.placement"),
        ({"resources": {"resources_per_worker": {"memory": "lots"}}}, "resources.resources_per_worker"),
        ({"resources": {"resources_per_worker": {"GPU": 1}}}, "resources"),
        ({"runtime_env": {"workdir": "."}}, "runtime_env"),
        ({"queue": "Has Spaces"}, "queue"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"retries": {"max_attempts": 0}}, "retries.max_attempts"),
    ],
)
def test_bad_spec_names_the_field(patch: dict, field: str) -> None:
    data = {**OK, **patch}
    fields = [f for f, _ in errors_of(data)]
    assert any(f == field or f.startswith(field + ".") for f in fields), fields


def test_fp16_on_cpu_is_refused_with_the_field_named() -> None:
    (only,) = errors_of({**OK, "strategy": {"mixed_precision": "fp16"}})
    assert "strategy.mixed_precision" in only[1]


def test_memory_sizes() -> None:
    assert parse_memory("64GiB") == 64 * 1024**3
    assert parse_memory("512MB") == 512 * 1000**2
    assert parse_memory(1024) == 1024
    with pytest.raises(ValueError):
        parse_memory("12 parsecs")


@pytest.mark.parametrize(
    ("part", "value"),
    [
        ({"resources": {"num_workers": True}}, "resources.num_workers"),
        ({"retries": {"max_worker_failures": False}}, "retries.max_worker_failures"),
        ({"retries": {"backoff_seconds": True}}, "retries.backoff_seconds"),
        ({"retries": {"retry_on_timeout": 0}}, "retries.retry_on_timeout"),
        ({"resources": {"use_gpu": 1}}, "resources.use_gpu"),
        ({"strategy": {"seed": True}}, "strategy.seed"),
        ({"strategy": {"seed": 2**40}}, "strategy.seed"),
    ],
)
def test_a_bool_is_not_a_number_nor_a_number_a_bool(part: dict, value: str) -> None:
    """JSON's true/false and 0/1 are different things (schemathesis found both read as the other)."""
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"entrypoint": {"callable": "a:b"}, **part})
    assert value in {".".join(str(x) for x in e["loc"]) for e in info.value.errors()}


def test_integral_numbers_still_count_as_integers() -> None:
    spec = JobSpec.model_validate({"entrypoint": {"callable": "a:b"}, "retries": {"max_attempts": 2.0}})
    assert spec.retries.max_attempts == 2
