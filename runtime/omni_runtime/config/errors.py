"""PipelineConfigError, and the translation of pydantic's errors into it.

Users see field paths in the canonical camelCase spelling (``stages[1].inputConnectors``)
whichever spelling they wrote, and messages that say what is allowed, never pydantic's raw
dump or a traceback.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

ROOT_PATH = "<root>"


class PipelineConfigError(ValueError):
    """A pipeline config that cannot be used, with every problem found.

    ``issues`` is a list of ``(field_path, message)``; ``str()`` is one "field: message"
    line per issue. Validators may raise it with paths relative to the field they check;
    the loader joins those onto the field's own path.
    """

    def __init__(self, issues: Iterable[tuple[str, str]], *, source: str | None = None) -> None:
        self.issues: list[tuple[str, str]] = list(issues)
        self.source = source
        super().__init__(str(self))

    def __reduce__(self) -> tuple[Any, ...]:
        # The default rebuilds from ``args`` (the message text), which is not our signature;
        # copying and sending the error to another process need the issues back.
        return (_rebuild, (self.issues, self.source))

    def __str__(self) -> str:
        return "\n".join(f"{path or ROOT_PATH}: {message}" for path, message in self.issues)

    @classmethod
    def from_validation_error(
        cls, error: ValidationError, model_type: type[BaseModel], *, source: str | None = None
    ) -> PipelineConfigError:
        """Translate ``error``, raised while validating ``model_type``."""
        issues: list[tuple[str, str]] = []
        for detail in error.errors(include_url=False):
            issues.extend(_translate(detail, model_type))
        return cls(issues, source=source)


def _rebuild(issues: list[tuple[str, str]], source: str | None) -> PipelineConfigError:
    return PipelineConfigError(issues, source=source)


def join_path(prefix: str, rest: str) -> str:
    """``join_path("stages[1]", "inputConnectors.x")`` -> ``stages[1].inputConnectors.x``."""
    if not prefix:
        return rest
    if not rest:
        return prefix
    return prefix + rest if rest.startswith("[") else f"{prefix}.{rest}"


def format_path(parts: Sequence[str | int]) -> str:
    path = ""
    for part in parts:
        path = join_path(path, f"[{part}]" if isinstance(part, int) else part)
    return path


def _translate(detail: Any, model_type: type[BaseModel]) -> list[tuple[str, str]]:
    loc: tuple[str | int, ...] = tuple(detail["loc"])
    is_key = bool(loc) and loc[-1] == "[key]"
    if is_key:
        loc = loc[:-1]
    parts, owner = _resolve(model_type, loc)
    path = format_path(parts)
    kind: str = detail["type"]
    ctx: dict[str, Any] = detail.get("ctx") or {}
    cause = ctx.get("error")

    if isinstance(cause, PipelineConfigError):
        return [(join_path(path, sub), message) for sub, message in cause.issues]
    if kind in ("value_error", "assertion_error") and cause is not None:
        message = str(cause)
    elif kind == "missing":
        message = _missing_message(owner, loc[-1] if loc else None)
    elif kind == "extra_forbidden" and owner is not None and loc:
        message = _unknown_field_message(owner, str(loc[-1]))
    else:
        message = _lower_first(str(detail["msg"]))
    if is_key and parts:
        # The key itself is bad: point at the dict holding it, and name the key.
        path = format_path(parts[:-1])
        message = f"key {parts[-1]!r}: {message}"
    return [(path, message)]


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _resolve(
    model_type: type[BaseModel], loc: Sequence[str | int]
) -> tuple[list[str | int], type[BaseModel] | None]:
    """Walk ``loc`` through the model's fields, naming each field by its alias.

    Returns the rendered parts and the model that holds the last part (None once the walk
    has left the models, e.g. inside a free-form dict).
    """
    node: Any = model_type
    owner: type[BaseModel] | None = None
    parts: list[str | int] = []
    for item in loc:
        model = _as_model(node)
        owner = model
        if model is not None and isinstance(item, str):
            name = _field_name(model, item)
            if name is None:
                parts.append(item)
                node = None
                continue
            field = model.model_fields[name]
            parts.append(field.alias or name)
            node = field.annotation
        else:
            parts.append(item)
            node = _element_type(node)
    return parts, owner


def _field_name(model: type[BaseModel], key: str) -> str | None:
    if key in model.model_fields:
        return key
    for name, field in model.model_fields.items():
        if field.alias == key:
            return name
    return None


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _as_model(annotation: Any) -> type[BaseModel] | None:
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _element_type(annotation: Any) -> Any:
    annotation = _strip_optional(annotation)
    args = get_args(annotation)
    if get_origin(annotation) in (list, tuple) and args:
        return args[0]
    if get_origin(annotation) is dict and len(args) == 2:
        return args[1]
    return None


def _allowed_fields(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _missing_message(owner: type[BaseModel] | None, key: str | int | None) -> str:
    hints: dict[str, str] = getattr(owner, "missing_hints", {}) if owner is not None else {}
    if isinstance(key, str):
        name = _field_name(owner, key) if owner is not None else None
        hint = hints.get(name or key)
        if hint:
            return f"required: {hint}"
    return "required"


def _unknown_field_message(owner: type[BaseModel], key: str) -> str:
    name = _field_name(owner, key)
    if name is not None:
        alias = owner.model_fields[name].alias or name
        # Both spellings of one field were given; pydantic kept one and calls the other extra.
        return f"given twice, as {alias!r} and {name!r}; keep one"
    allowed = _allowed_fields(owner)
    # Match against both spellings, so a snake_case typo still finds its field.
    spellings = dict(zip(owner.model_fields, allowed, strict=True))
    spellings.update({alias: alias for alias in allowed})
    close = difflib.get_close_matches(key, list(spellings), n=1)
    suggestion = f" (did you mean {spellings[close[0]]!r}?)" if close else ""
    return f"unknown field {key!r}{suggestion}; allowed: {', '.join(allowed)}"
