"""The base of the pipeline schema's models: snake_case fields in Python, camelCase on the wire.

camelCase is the Kubernetes spelling and what ``dump_pipeline`` writes; input may use either
spelling, so the engine's snake_case deploy YAML loads as it is. Free-form dicts (sampling
params, engine args, connector extras) keep their keys exactly as written.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# snake_case in Python, camelCase on the wire, either accepted; unknown fields refused. The
# operator's API models (omni_operator.api) share it.
CAMEL_CASE_CONFIG = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    serialize_by_alias=True,
    extra="forbid",
)


class SchemaModel(BaseModel):
    """A model of the pipeline schema (CAMEL_CASE_CONFIG, and hints for missing fields)."""

    model_config = CAMEL_CASE_CONFIG

    # Per-field text for "required" errors: what to set, and why it could not be defaulted.
    missing_hints: ClassVar[dict[str, str]] = {}
