"""Write the docs site's reference pages from the code itself: the job spec (`service.spec.job.JobSpec`) and the
settings (`service.config.settings.Settings`), field by field, with their types, defaults and descriptions.

    .venv/bin/python docs/gen_reference.py        # rewrite docs/reference/*.md
    .venv/bin/python docs/gen_reference.py --check  # exit 1 if they are stale (tests/test_docs_site.py)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "reference"


def _type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " | ".join(_type(p, defs) for p in prop["anyOf"])
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list[{_type(prop.get('items', {}), defs)}]"
    if kind == "object" and "additionalProperties" in prop and isinstance(prop["additionalProperties"], dict):
        return f"map[str, {_type(prop['additionalProperties'], defs)}]"
    return str(kind)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(schema: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        default = json.dumps(prop["default"]) if "default" in prop else ("required" if name in schema.get(
            "required", ()) else "")  # fmt: skip
        rows.append(
            f"| `{name}` | {_cell(_type(prop, defs))} | {_cell(default)} | {_cell(prop.get('description', ''))} |"
        )
    return rows


def spec_page() -> str:
    from service.spec.job import JobSpec

    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    lines = ["# Job spec reference", "",
             "Generated from `service.spec.job.JobSpec` by `docs/gen_reference.py`: every field a job spec may hold. "
             "The same schema is served at `/openapi.json`.", "", "## JobSpec", "", *_table(schema, defs)]  # fmt: skip
    for name in sorted(defs):
        if defs[name].get("properties"):
            lines += ["", f"## {name}", ""]
            if defs[name].get("description"):
                lines += [_cell(defs[name]["description"]), ""]
            lines += _table(defs[name], defs)
    return "\n".join(lines) + "\n"


def _comments(path: Path) -> dict[str, str]:
    """Each setting's comment lines just above it in settings.py (what most settings are documented by)."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if line.startswith("    # "):
            above.append(stripped[2:])
        elif line.startswith("    ") and not line.startswith("     ") and ":" in stripped and stripped[0].isalpha():
            out.setdefault(stripped.split(":", 1)[0], " ".join(above))
            above = []
        else:
            above = []
    return out


def settings_page() -> str:
    from service.config.settings import Settings

    said = _comments(ROOT / "service" / "config" / "settings.py")

    lines = ["# Settings reference", "",
             "Generated from `service.config.settings.Settings` by `docs/gen_reference.py`. Each setting is the "
             "environment variable `SHUNTER_<NAME>`, or `<name>:` in the YAML file that `SHUNTER_CONFIG` names "
             "(the environment wins); JSON values go in the variable as JSON and in the file as YAML.", "",
             "| variable | type | default | meaning |", "|---|---|---|---|"]  # fmt: skip
    for name, field in Settings.model_fields.items():
        kind = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
        default = "" if field.is_required() else repr(field.get_default(call_default_factory=True))
        meaning = _cell(field.description or said.get(name, ""))
        lines.append(f"| `SHUNTER_{name.upper()}` | {_cell(kind)} | {_cell(default)} | {meaning} |")
    return "\n".join(lines) + "\n"


def end_reasons_page() -> str:
    from service.policy.end_reasons import TABLE

    lines = ["# End reasons", "",
             "Generated from `service.policy.end_reasons.TABLE` by `docs/gen_reference.py`: why an attempt ended, and "
             "what the service does about it. *retried*: another attempt runs while `retries.max_attempts` allows "
             "(backoff between them); *free*: when a retry costs no attempt (at most `SHUNTER_MAX_FREE_RETRIES` per "
             "job); *driver may record*: a job's own driver may say it ended so (the others the service finds "
             "itself); *job ends*: the job's state when it is not retried.", "",
             "| reason | meaning | retried | free | driver may record | job ends |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for reason, m in TABLE.items():
        retried = "yes" if m.retryable else (f"with `retries.{m.opt_in}`" if m.opt_in else "no")
        free = {None: "", "preempted": "yes", "confirmed_node": "once the cluster shows the node going",
                "elastic_node": "an elastic job, once the cluster shows the node gone",
                "head_restart": "unless `SHUNTER_COUNT_CLUSTER_RESTARTS`"}  # fmt: skip
        free_when = free[m.free.value if m.free else None]
        claim = ("yes, confirmed by the cluster" if m.confirm else "yes") if m.claimable else "no"
        lines.append(f"| `{reason.value}` | {_cell(m.says)} | {retried} | {free_when} | {claim} | {m.state.value} |")
    return "\n".join(lines) + "\n"


PAGES = {"spec.md": spec_page, "settings.md": settings_page, "end-reasons.md": end_reasons_page}


def main(argv: list[str]) -> int:
    stale = []
    for name, make in PAGES.items():
        text, path = make(), OUT / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python docs/gen_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
