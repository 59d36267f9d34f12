"""Tools on the chat route: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI
and vLLM define them, checked and made into a ``ToolPlan`` (docs/api.md, "Tools and
reasoning").

"required" and a named function are constrained decoding: their ``Constraint`` is one JSON
schema the scheduler compiles like any structured output, so a client's ``response_format``
beside them is a second constraint and refused. The schema engine judges ``parameters``
(a 400 naming the tool's field); before that, a name that is not OpenAI's
``^[a-zA-Z0-9_-]{1,64}$``, a name given twice, ``parameters`` that are not an object schema,
``tool_choice`` without ``tools`` and ``tool_choice`` naming a tool not in ``tools`` are 400s
naming their field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pipeline.io_struct import Constraint
from tokenizer_proc.openai.calls_schema import calls_schema
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.schema_support import check_schema

__all__ = [
    "ChatTool",
    "FunctionDefinition",
    "NamedToolChoice",
    "ToolChoice",
    "ToolPlan",
    "plan_tools",
]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""A function without ``parameters`` takes none: its arguments are ``{}``."""


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # The arguments always follow the schema where the output is constrained, which is what
    # strict asks; under "auto" the model's own text is parsed, strict or not.
    strict: bool | None = None


class ChatTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        """As ``apply_chat_template(tools=...)`` hands a tool to a template: the OpenAI
        shape, fields that were not given left out."""
        function: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        if self.function.parameters is not None:
            function["parameters"] = self.function.parameters
        return {"type": "function", "function": function}


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools make of its prompt and its answer, by ``tool_choice``:

    - ``"none"``: the prompt has the tools; the output is free, and all of it is content.
    - ``"auto"`` (the default with tools): the prompt has the tools; the output is free, and
      ``--tool-call-parser`` reads calls out of it (the first only, with ``parallel``
      false: ``parallel_tool_calls: false``).
    - ``"required"``: the output is a JSON array of one or more calls,
      ``[{"name": ..., "arguments": {...}}]`` (exactly one with ``parallel`` false), each
      ``arguments`` valid against its tool's ``parameters`` (``calls_schema``).
    - ``{"type": "function", "function": {"name": ...}}``: the output is that function's
      arguments object, valid against its ``parameters``.

    ``named``: the forced function (mode ``named``); ``constraint``: the output's schema
    (modes ``required`` and ``named``)."""

    mode: ToolMode
    names: frozenset[str]
    template_tools: list[dict[str, Any]]
    parallel: bool = True
    named: str | None = None
    constraint: Constraint | None = None


def plan_tools(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None
) -> ToolPlan | None:
    """The request's ``ToolPlan``; None when it gives no tools (and ``tool_choice`` is absent
    or ``"none"``). Raises RequestValidationError naming the field at fault."""
    if tools is None:
        if tool_choice is not None and tool_choice != "none":
            raise RequestValidationError(
                "tool_choice needs tools: give the functions the model may call", "tool_choice"
            )
        return None
    if not tools:
        raise RequestValidationError(
            "tools must hold at least one tool (leave tools out for none)", "tools"
        )
    parameters = _checked_parameters(tools)
    names = frozenset(parameters)
    template_tools = [tool.to_template() for tool in tools]
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", names, template_tools, parallel)
    if tool_choice == "none":
        return ToolPlan("none", names, template_tools, parallel)
    if tool_choice == "required":
        for i, tool_schema in enumerate(parameters.values()):  # each named by its own field
            check_schema(tool_schema, f"tools[{i}].function.parameters")
        schema = calls_schema(parameters, one=not parallel)
        return ToolPlan(
            "required",
            names,
            template_tools,
            parallel,
            constraint=_schema_constraint(schema, "tools"),
        )
    name = tool_choice.function.name
    if name not in parameters:
        raise RequestValidationError(
            f"tool_choice names the function {name!r}, which is not in tools "
            f"({', '.join(sorted(names))})",
            "tool_choice.function.name",
        )
    index = next(i for i, tool in enumerate(tools) if tool.function.name == name)
    schema = parameters[name]
    check_schema(schema, f"tools[{index}].function.parameters")
    return ToolPlan(
        "named",
        names,
        template_tools,
        parallel,
        named=name,
        constraint=_schema_constraint(schema, f"tools[{index}].function.parameters"),
    )


def _checked_parameters(tools: list[ChatTool]) -> dict[str, dict[str, Any]]:
    """Each tool's name and arguments schema, in order, checked for what the engine would not
    name as clearly."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function"
        name = tool.function.name
        if _NAME.fullmatch(name) is None:
            raise RequestValidationError(
                f"{where}.name {name!r} must be 1 to 64 letters, digits, underscores or dashes",
                f"{where}.name",
            )
        if name in out:
            raise RequestValidationError(
                f"{where}.name {name!r} is given twice: tool names must be unique", f"{where}.name"
            )
        schema = tool.function.parameters
        if schema is not None and schema.get("type", "object") != "object":
            raise RequestValidationError(
                f"{where}.parameters must be a JSON Schema of an object (the arguments), not of "
                f"type {schema.get('type')!r}",
                f"{where}.parameters",
            )
        out[name] = schema if schema is not None else NO_ARGUMENTS
    return out


def _schema_constraint(schema: dict[str, Any], param: str) -> Constraint:
    """The output's schema; its tools' parameters were checked (``check_schema``) by name."""
    return Constraint("json_schema", msgspec.json.encode(schema).decode(), param)
