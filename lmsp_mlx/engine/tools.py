"""Function tools in the prompt, for templates with and without tool support.

A chat template that refers to `tools` gets them natively (`apply_chat_template(tools=...)`)
and earlier calls as `tool_calls` on assistant messages, results as `tool` messages.
Templates without tool support (the default SmolLM2's ChatML) get the project's own
format, the Hermes/Qwen2.5 convention:
- the system message gains a block that lists each function as JSON inside
  `<tools></tools>` and asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- earlier calls are rendered that way in the assistant turn;
- results are a user turn of `<tool_response>...</tool_response>` blocks.
"""

from __future__ import annotations

import json

from ..protocol.requests import FunctionTool

TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def native_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


CUSTOM_PROMPT = (
    "\n\nTools of type \"custom\" take their input as raw text, not JSON: write the tool name "
    "on the first line and the input after it:\n<tool_call>\n{{\"name\": <tool-name>}}\n<input>\n</tool_call>"
)


def tool_specs(tools: list[FunctionTool]) -> list[dict]:
    """The tools as chat templates (and mlx-lm's tool parsers) expect them. A custom tool is
    shown as a function of one string, `input`, to templates that only know functions."""
    return [
        {"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.parameters or {"type": "object", "properties": {}},
        }} if not t.custom else
        {"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
        }}
        for t in tools
    ]


def tool_prompt(tools: list[FunctionTool]) -> str:
    """The Hermes block; custom tools are listed as they are (with their grammar) and the
    raw-input call form is explained."""
    specs = [json.dumps(s, ensure_ascii=False) for t, s in zip(tools, tool_specs(tools)) if not t.custom]
    specs += [json.dumps({"type": "custom", "name": t.name, "description": t.description or "",
                          **({"grammar": t.grammar} if t.grammar else {})}, ensure_ascii=False)
              for t in tools if t.custom]
    prompt = TOOL_PROMPT.format(tools="\n".join(specs))
    return prompt + (CUSTOM_PROMPT.format() if any(t.custom for t in tools) else "")


def call_text(name: str, arguments: str, custom: bool = False) -> str:
    """A call in the project's format, for calls the server did not sample itself; a custom
    tool's call carries its raw input after the name line."""
    if custom:
        return "<tool_call>\n" + json.dumps({"name": name}, ensure_ascii=False) + "\n" + arguments + "\n</tool_call>"
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def response_text(outputs: list[str]) -> str:
    return "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in outputs)
