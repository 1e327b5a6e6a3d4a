"""Tool calling (OpenAI's ``tools`` / ``tool_choice``) in the model's own format: Qwen2.5's and Hermes'
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, which its chat template teaches the model
when it is given the tools.

- ``Tools`` checks a request's tools and tool choice, and says what the prompt and the output need: the tools the
  chat template renders (none under ``tool_choice: "none"``), and, when a call is forced (``"required"`` or a named
  function), a grammar (SamplingParams.grammar: llguidance's Lark dialect) whose every sentence is one call, or one or
  more with ``parallel_tool_calls``, each naming an allowed function and with arguments that match its JSON schema. The
  mask is a logits processor like any other (sampling/grammar.py): exact under speculative decoding.
- ``ToolCallParser`` turns the generated text into content and calls, incrementally (a stream feeds it each step's
  text; a whole answer feeds it once): text outside blocks is content, a block whose JSON names a known function with
  an object of arguments is a call (``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``), any
  other block stays content, verbatim. A partial ``<tool_call>`` at the end of the text so far is held back.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .config import schema_error  # the same check as response_format's
from .errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
# arguments as the chat template writes them (tojson: ", " and ": "), so a forced call reads as the model's own
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}]``), ``choice`` ("none", "auto", "required" or ``{"type": "function", "function": {"name"}}``) and
    ``parallel`` calls allowed. Raises ConfigError, its message starting with the field at fault."""

    tools: Sequence[dict]
    choice: str | dict = "auto"
    parallel: bool = True
    functions: dict[str, dict] = field(init=False, repr=False)  # name -> its JSON schema of arguments

    def __post_init__(self):
        _check(isinstance(self.tools, (list, tuple)) and 0 < len(self.tools) <= MAX_TOOLS,
               f"tools: a list of 1 to {MAX_TOOLS} tools")
        functions = {}
        for i, tool in enumerate(self.tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            _check(isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict),
                   f'tools.{i}: expected {{"type": "function", "function": {{"name": ...}}}}')
            name = fn.get("name")
            _check(isinstance(name, str) and NAME.fullmatch(name) is not None,
                   f"tools.{i}.function.name: 1 to 64 letters, digits, _ or -, got {name!r:.70}")
            _check(name not in functions, f"tools.{i}.function.name: {name!r} is given twice")
            schema = fn.get("parameters", {"type": "object"})
            _check(isinstance(schema, dict), f"tools.{i}.function.parameters: a JSON schema object")
            error = schema_error(json.dumps(schema, separators=(",", ":")))
            _check(not error, f"tools.{i}.function.parameters: invalid JSON schema: {error}")
            functions[name] = schema
        object.__setattr__(self, "functions", functions)
        choice = self.choice
        if isinstance(choice, dict):
            fn = choice.get("function")
            _check(choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str),
                   'tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
            _check(fn["name"] in functions, f"tool_choice: the function {fn['name']!r:.70} is not in tools")
        else:
            _check(choice in CHOICES, f'tool_choice: "none", "auto", "required" or a named function, '
                                      f"got {choice!r:.70}")
        _check(isinstance(self.parallel, bool), "parallel_tool_calls: true or false")

    @property
    def named(self) -> str | None:
        """The function a named choice forces, else None."""
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None

    @property
    def forced(self) -> bool:
        """A call must be made: ``"required"`` or a named function."""
        return self.choice == "required" or self.named is not None

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template renders into the prompt; None under "none" (the model is not told of them)."""
        return None if self.choice == "none" else [dict(t) for t in self.tools]

    def grammar(self, literal: Callable[[str], str] = json.dumps) -> str | None:
        """A forced choice's grammar (llguidance's Lark dialect), else None. ``literal``: a text -> the grammar's
        term for it (the model's special token where it has one: sampling.Grammars.literal)."""
        if not self.forced:
            return None
        names = [self.named] if self.named else list(self.functions)
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": self.functions[n]},
                  "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_STYLE}
        more = ' ("\\n" call)*' if self.parallel else ""
        return (f"start: call{more}\n"
                f'call: {literal(OPEN)} "\\n" args "\\n" {literal(CLOSE)}\n'
                f"args: %json {json.dumps(schema, ensure_ascii=False)}\n")

    def parser(self) -> ToolCallParser:
        return ToolCallParser(frozenset(self.functions), self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer -> (content, calls): content None when the answer is calls only."""
        parser = self.parser()
        content, calls = parser.feed(text)
        rest, more = parser.close()
        content += rest
        calls += more
        return (content.strip() or None) if calls else content, calls


@dataclass
class ToolCallParser:
    """Text in, in pieces -> (content, calls) out as soon as they are known (module docstring)."""

    names: frozenset[str]
    parallel: bool = True
    held: str = ""  # text not yet given out: a possible start of OPEN, or a block still open
    inside: bool = False  # held starts after an OPEN
    num_calls: int = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, calls = [], []
        self.held += text
        while True:
            if not self.inside:
                at = self.held.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.held, OPEN)
                    content.append(self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    break
                content.append(self.held[:at])
                self.held, self.inside = self.held[at + len(OPEN):], True
            else:
                end = self.held.find(CLOSE)
                if end < 0:
                    break
                block, self.held, self.inside = self.held[:end], self.held[end + len(CLOSE):], False
                call = self._call(block)
                if call is None:
                    content.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
        return "".join(content), calls

    def close(self) -> tuple[str, list[dict]]:
        """The end of the text: a block left open is a call if its JSON is whole (the model stopped before its
        CLOSE), else content; held text is content."""
        held, self.held = self.held, ""
        if self.inside:
            self.inside = False
            call = self._call(held)
            return ("", [call]) if call is not None else (OPEN + held, [])
        return held, []

    def _call(self, block: str) -> dict | None:
        if self.num_calls and not self.parallel:
            return None
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not (isinstance(call, dict) and call.get("name") in self.names
                and isinstance(call.get("arguments", {}), dict)):
            return None
        self.num_calls += 1
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        return {"id": call_id(), "type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def template_message(message: dict) -> dict:
    """An OpenAI assistant message's ``tool_calls`` as chat templates take them: arguments as an object, not JSON
    text. Raises ConfigError for arguments that are not a JSON object."""
    calls = []
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        except ValueError:
            arguments = None
        _check(isinstance(arguments, dict), f"messages: tool_calls.{i}.function.arguments must be a JSON object")
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return {**message, "tool_calls": calls} if calls else message
