"""What every request body is built from: a model that refuses unknown fields, as OpenAI's
API does, and JSON's types, strictly."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


# Numbers as JSON has them: true, false and "1.5" are not numbers, though pydantic's lax
# mode would take them (form fields, text by nature, are parsed from their strings all the
# same: model_validate_strings). JSON has no inf or nan, but an overflowing 1e999 parses
# as inf and form fields spell both: refused everywhere.
Integer = Annotated[int, Strict()]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[Number, Field(ge=0)]
Seed = Annotated[Integer, Field(ge=0, le=2**63 - 1)]
Positive = Annotated[Integer, Field(ge=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]


def given(**params: Any) -> dict[str, Any]:
    """``params`` without those left unset (None)."""
    return {name: value for name, value in params.items() if value is not None}
